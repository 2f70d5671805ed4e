"""What Slurm granted this job, read from its ``SLURM_*`` variables and its own commands.

One small class keeps the scheduler's facts (Lightning's ``SLURMEnvironment`` is the model):
the allocation's hosts, tasks per node and GPUs, the job's end time, the restart count after a
requeue, and one task's rank under ``srun``. No torch import: the front process, ``doctor``
and every rank read it.
"""

from __future__ import annotations

import datetime
import os
import re
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

#: Launched by an MPI runtime: its own variables give the ranks (DeepSpeed's mpi4py discovery).
_MPI_RANK_VARS = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK", "MV2_COMM_WORLD_RANK")


def _first_int(text: str | None) -> int | None:
    """``8(x2),4`` (Slurm's per-node counts) -> 8; ``2`` -> 2; None for anything else."""
    m = re.match(r"\s*(\d+)", text or "")
    return int(m.group(1)) if m else None


def expand_hostlist(spec: str) -> list[str]:
    """A Slurm host list (``node[01-03,07],gpu5``) as names, through ``scontrol show
    hostnames`` (Slurm's own parser); a plain comma-separated list when scontrol is missing."""
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", spec],
            capture_output=True,
            text=True,
            timeout=30,
            check=True,
        ).stdout
        hosts = out.split()
        if hosts:
            return hosts
    except (OSError, subprocess.SubprocessError):
        pass
    if "[" in spec:
        raise RuntimeError(f"cannot expand the Slurm host list {spec!r}: scontrol is not usable")
    return [h for h in spec.split(",") if h]


def _ask(cmd: list[str]) -> str | None:
    """A Slurm client command's output; None when it cannot be run or fails."""
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None


def parse_time(text: str) -> float | None:
    """Slurm's ``2026-12-03T09:10:00`` (local time) as a Unix time; None for Unknown/NONE."""
    try:
        return datetime.datetime.strptime(text.strip(), "%Y-%m-%dT%H:%M:%S").timestamp()
    except ValueError:
        return None


@dataclass(frozen=True)
class Allocation:
    """The Slurm job this process runs in (``sbatch`` or ``salloc``)."""

    job_id: str
    nodelist: str
    num_nodes: int
    tasks_per_node: int | None
    gpus_per_node: int | None
    cpus_on_node: int | None
    restart_count: int

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Allocation | None:
        """The allocation, or None outside one."""
        env = os.environ if env is None else env
        job = env.get("SLURM_JOB_ID") or env.get("SLURM_JOBID")
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST")
        if not job or not nodelist:
            return None
        gpus = _first_int(env.get("SLURM_GPUS_ON_NODE")) or _first_int(
            env.get("SLURM_GPUS_PER_NODE", "").split(":")[-1]
        )
        return cls(
            job_id=job,
            nodelist=nodelist,
            num_nodes=_first_int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES")) or 1,
            tasks_per_node=_first_int(env.get("SLURM_NTASKS_PER_NODE"))
            or _first_int(env.get("SLURM_TASKS_PER_NODE")),
            gpus_per_node=gpus,
            cpus_on_node=_first_int(env.get("SLURM_CPUS_ON_NODE")),
            restart_count=_first_int(env.get("SLURM_RESTART_COUNT")) or 0,
        )

    def hosts(self) -> list[str]:
        return expand_hostlist(self.nodelist)

    def ranks_per_node(self, nproc: int | None = None) -> tuple[int, str]:
        """Ranks to start on every node and where that number comes from: ``--nproc``, else
        the GPUs Slurm gave each node, else the tasks per node it granted, else one."""
        if nproc:
            return nproc, "--nproc"
        if self.gpus_per_node:
            return self.gpus_per_node, "the GPUs on each node"
        if self.tasks_per_node:
            return self.tasks_per_node, "the tasks per node Slurm granted"
        return 1, "one per node (Slurm granted no GPUs and no tasks per node; --nproc sets it)"

    def end_time(self) -> float | None:
        """When Slurm ends the job (its time limit), as a Unix time; None when it has none
        or cannot be asked. Read afresh each call: ``scontrol update`` can move it."""
        out = _ask(["squeue", "-h", "-j", self.job_id, "-o", "%e"])
        if out is None:
            return None
        return parse_time(out.splitlines()[0]) if out.strip() else None

    def nodes_now(self) -> list[str] | None:
        """The job's nodes as Slurm holds them now (``scontrol show job``'s NodeList): after a
        node failure under ``--no-kill`` the job keeps the others and ``SLURM_JOB_NODELIST``
        is stale. None when Slurm cannot be asked."""
        out = _ask(["scontrol", "show", "job", "-o", self.job_id])
        if out is None:
            return None
        for field in out.split():
            if field.startswith("NodeList="):
                spec = field.split("=", 1)[1]
                return [] if spec in ("", "(null)") else expand_hostlist(spec)
        return None

    def requeue(self) -> str | None:
        """``scontrol requeue`` this job: None when done, else why not. Slurm then sends
        SIGTERM to every process of the job and runs it again later."""
        try:
            done = subprocess.run(
                ["scontrol", "requeue", self.job_id], capture_output=True, text=True, timeout=60
            )
        except (OSError, subprocess.SubprocessError) as exc:
            return f"scontrol requeue {self.job_id} failed: {exc}"
        if done.returncode != 0:
            return f"scontrol requeue {self.job_id}: {(done.stderr or done.stdout).strip()}"
        return None


@dataclass(frozen=True)
class TaskRank:
    """One ``srun`` task's place in the world."""

    rank: int
    local_rank: int
    world_size: int
    local_size: int
    master_addr: str
    master_port: int


def default_port(job_id: str) -> int:
    """The rendezvous port of a job whose launcher named none: from the job id, so every
    task of the job agrees without talking (Lightning's rule, another range)."""
    digits = re.sub(r"\D", "", job_id) or "0"
    return 20000 + int(digits) % 20000


def task_rank(env: Mapping[str, str] | None = None) -> TaskRank | None:
    """This process as an ``srun`` task (one task per device), or None: not inside a job
    step, the ranks already given (``RANK``: DeepSpeed's launcher, torchrun), or an MPI
    runtime started it (mpi4py discovery is DeepSpeed's)."""
    env = os.environ if env is None else env
    if "RANK" in env or any(k in env for k in _MPI_RANK_VARS):
        return None
    if "SLURM_STEP_ID" not in env or "SLURM_PROCID" not in env:
        return None
    world = _first_int(env.get("SLURM_STEP_NUM_TASKS") or env.get("SLURM_NTASKS"))
    if world is None:
        return None
    local_size = _first_int(env.get("SLURM_STEP_TASKS_PER_NODE")) or 1
    nodes = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST") or ""
    addr = env.get("MASTER_ADDR") or (expand_hostlist(nodes)[0] if nodes else "127.0.0.1")
    port = int(env.get("MASTER_PORT") or default_port(env.get("SLURM_JOB_ID", "0")))
    return TaskRank(
        rank=int(env["SLURM_PROCID"]),
        local_rank=int(env.get("SLURM_LOCALID", "0")),
        world_size=world,
        local_size=local_size,
        master_addr=addr,
        master_port=port,
    )


def export_task_rank(env: dict[str, str] | os._Environ[str] | None = None) -> TaskRank | None:
    """Under a plain ``srun``: set the variables ``torch.distributed`` reads (``RANK``,
    ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``) from
    Slurm's. Returns what was set, or None when this process is no srun task."""
    env = os.environ if env is None else env
    got = task_rank(env)
    if got is None:
        return None
    env["RANK"], env["LOCAL_RANK"] = str(got.rank), str(got.local_rank)
    env["WORLD_SIZE"], env["LOCAL_SIZE"] = str(got.world_size), str(got.local_size)
    env["LOCAL_WORLD_SIZE"] = str(got.local_size)
    env["MASTER_ADDR"], env["MASTER_PORT"] = got.master_addr, str(got.master_port)
    return got
