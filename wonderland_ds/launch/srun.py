"""A stage's ranks started by ``srun`` inside a Slurm allocation: one task per rank on the
allocation's nodes, rendezvous on its first node, never ssh or pdsh.

DeepSpeed's own ``--launcher slurm`` is not used: it runs ``python -u SCRIPT`` (no ``-m``, so an
installed package cannot be named), sets no rank variables for the tasks (its ``mpi_discovery``
expects mpi4py), and its runner process dies on the SIGUSR1 of Slurm's warning without passing
it on. The ranks read their place from ``SLURM_PROCID``, ``SLURM_LOCALID`` and
``SLURM_STEP_NUM_TASKS`` (``core/slurm.py``).
"""

from __future__ import annotations

import os
import socket
import sys

from wonderland_ds.core.carried import CARRIED_ENV
from wonderland_ds.core.slurm import Allocation, default_port
from wonderland_ds.launch.command import ENTRY, extensions_dir, pick_port


def build(
    alloc: Allocation,
    hosts: list[str],
    per_node: int,
    stage_argv: list[str],
    master_port: int | None = None,
    exclude: list[str] | None = None,
) -> tuple[list[str], dict[str, str], list[str]]:
    """Returns (command, environment, notes) for the stage's ranks on ``hosts``."""
    hosts = [h for h in hosts if h not in (exclude or [])]
    here = socket.gethostname() in (hosts[0], hosts[0].split(".")[0])
    # The rendezvous listens on the first node: a port checked free there when the front runs
    # on it (a batch script does), else one every task derives from the job id.
    port = master_port or (pick_port() if here else default_port(alloc.job_id))
    cmd = [
        "srun",
        f"--nodes={len(hosts)}",
        f"--ntasks={len(hosts) * per_node}",
        f"--ntasks-per-node={per_node}",
        f"--nodelist={','.join(hosts)}",
        "--kill-on-bad-exit=1",
        "--export=ALL",
    ]
    if exclude:
        # After a lost node the old step still holds its resources until Slurm marks that
        # node down: the new step shares them instead of waiting.
        cmd.append("--overlap")
    cpus = os.environ.get("SLURM_CPUS_PER_TASK")
    if cpus:  # Slurm 22.05+: srun no longer takes the job's --cpus-per-task by itself
        cmd.append(f"--cpus-per-task={cpus}")
    cmd += [sys.executable, "-u", "-m", ENTRY, *stage_argv]
    env = dict(os.environ)
    env.update(CARRIED_ENV)
    env["MASTER_ADDR"], env["MASTER_PORT"] = hosts[0], str(port)
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir(env))
    for key in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_SIZE"):
        env.pop(key, None)  # the tasks take theirs from Slurm
    notes = [f"Slurm job {alloc.job_id}: {len(hosts)} node(s) x {per_node} rank(s) through srun"]
    if "OMP_NUM_THREADS" not in env:
        per_rank = max(
            1, int(cpus) if cpus else (alloc.cpus_on_node or os.cpu_count() or 1) // per_node
        )
        env["OMP_NUM_THREADS"] = str(per_rank)
        notes.append(f"OMP_NUM_THREADS={per_rank} per rank (was unset)")
    return cmd, env, notes
