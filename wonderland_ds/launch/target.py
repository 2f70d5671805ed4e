"""Where a stage's ranks run: a hostfile's hosts through DeepSpeed's launcher, or a Slurm
allocation's nodes through ``srun``, decided once per command from the flags and ``SLURM_*``.

Inside an allocation without ``--hostfile`` the allocation is used; a hostfile given inside
one wins, and that is said.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from wonderland_ds.config.hostfile import Hostfile
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.core.slurm import Allocation


@dataclass
class Target:
    hostfile: Hostfile | None
    """The hostfile's hosts (DeepSpeed's launcher); None: the Slurm allocation (srun)."""
    alloc: Allocation | None
    launcher: str
    """``slurm``, ``pdsh`` or ``openmpi``."""
    hosts: list[str] = field(default_factory=list)
    """Slurm: the allocation's nodes."""
    per_node: int = 1
    """Slurm: ranks on each node."""
    notes: list[str] = field(default_factory=list)

    @property
    def srun(self) -> bool:
        return self.hostfile is None

    def world(self, nproc: int | None, exclude: list[str]) -> int:
        if self.hostfile is None:
            return self.per_node * len([h for h in self.hosts if h not in exclude])
        hosts = {h: n for h, n in self.hostfile.hosts.items() if h not in exclude}
        return nproc * len(hosts) if nproc else sum(hosts.values())

    def command(
        self,
        nproc: int | None,
        stage_argv: list[str],
        run_dir: Path,
        master_port: int | None,
        exclude: list[str],
    ) -> tuple[list[str], dict[str, str], list[str]]:
        """(command, environment, notes) of one launch of the stage."""
        if self.hostfile is None:
            from wonderland_ds.launch import srun

            assert self.alloc is not None
            cmd, env, notes = srun.build(
                self.alloc, self.hosts, self.per_node, stage_argv, master_port, exclude
            )
        else:
            from wonderland_ds.launch import command

            cmd, env, notes = command.build(
                self.hostfile,
                nproc,
                stage_argv,
                run_dir,
                master_port,
                self.launcher,
                exclude,
            )
        return cmd, env, self.notes + notes


def decide(hostfile: str | None, launcher: str, nproc: int | None) -> Target:
    """The target of ``--hostfile``/``--launcher``/``--nproc`` here (a refusal raises)."""
    from wonderland_ds.config import hostfile as hostfile_mod
    from wonderland_ds.config.shipped import DEFAULT_HOSTFILE

    alloc = Allocation.from_env()
    if launcher == "slurm" and alloc is None:
        raise Refused(
            Finding(
                "launcher-slurm",
                "error",
                "--launcher slurm needs a Slurm allocation: no SLURM_JOB_ID and"
                " SLURM_JOB_NODELIST here",
                "run the command inside `sbatch` or `salloc`, or name a --hostfile",
            )
        )
    if launcher == "slurm" and hostfile is not None:
        raise Refused(
            Finding(
                "launcher-slurm",
                "error",
                "--launcher slurm takes its hosts from the Slurm allocation, not from --hostfile",
                "drop --hostfile (or drop --launcher slurm to use the hostfile's hosts)",
                hostfile,
            )
        )
    if alloc is not None and hostfile is None and launcher in ("auto", "slurm"):
        try:
            hosts = alloc.hosts()
        except RuntimeError as exc:
            raise Refused(
                Finding("launcher-slurm", "error", str(exc), "put Slurm's client tools on PATH")
            ) from None
        per_node, why = alloc.ranks_per_node(nproc)
        note = (
            f"Slurm job {alloc.job_id}: ranks start through srun on {len(hosts)} node(s)"
            f" ({', '.join(hosts[:4])}{', ...' if len(hosts) > 4 else ''}), {per_node} per node"
            f" from {why}"
        )
        return Target(None, alloc, "slurm", hosts, per_node, [note])
    hf, found = hostfile_mod.parse(hostfile or str(DEFAULT_HOSTFILE))
    if hf is None:
        raise Refused(found)
    chosen = "pdsh" if launcher == "auto" else launcher
    notes = []
    if alloc is not None:
        notes.append(
            f"inside Slurm job {alloc.job_id}, --hostfile {hf.path} wins: ranks start through"
            f" DeepSpeed's launcher on its hosts, not srun (drop --hostfile to use the allocation)"
        )
    return Target(hf, alloc, chosen, notes=notes)
