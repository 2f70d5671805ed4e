"""What several commands share: the launch flags of ``train``, ``pipeline`` and ``eval``, and
a hostfile read or refused."""

from __future__ import annotations

import argparse

from wonderland_ds.config import hostfile as hostfile_mod
from wonderland_ds.config import shipped
from wonderland_ds.core.findings import Refused
from wonderland_ds.launch.flags import DEFAULT_HOSTFILE, non_negative, positive

#: ``parser.add_subparsers()``: where each command module adds its sub-command.
Commands = argparse._SubParsersAction  # type: ignore[type-arg]


def hostfile_or_refuse(path: str | None) -> hostfile_mod.Hostfile:
    hf, found = hostfile_mod.parse(path or str(DEFAULT_HOSTFILE))
    if hf is None:
        raise Refused(found)
    return hf


def add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hostfile",
        type=shipped.hostfile_path,
        help="DeepSpeed hostfile, a path or a shipped one's name (default: the Slurm"
        f" allocation inside one, else {DEFAULT_HOSTFILE})",
    )
    p.add_argument(
        "--nproc",
        type=positive,
        help="processes per node (default: the hostfile's slots; in a Slurm allocation the GPUs"
        " or tasks it granted each node)",
    )
    p.add_argument("--master-port", type=positive, help="rendezvous port (default: a free one)")
    p.add_argument(
        "--max-restarts",
        type=non_negative,
        help="relaunch a stage whose rank died or timed out, from its newest complete"
        " checkpoint, up to N times (default: wonderland.max_restarts, 0)",
    )
    p.add_argument(
        "--min-nodes",
        type=positive,
        help="with --max-restarts: a node lost mid-stage is left out and the stage relaunched"
        " on the nodes left, with the same global batch, while at least N remain"
        " (default: wonderland.elastic.min_nodes; unset: restarts use the same nodes)",
    )
    p.add_argument(
        "--exclude-failed-hosts",
        action="store_true",
        help="on a restart, leave out the hosts the failure named (DeepSpeed's --exclude);"
        " the world shrinks and the resume goes through the universal path",
    )
    from wonderland_ds.launch.command import LAUNCHERS

    p.add_argument(
        "--launcher",
        choices=("auto", "slurm", *LAUNCHERS),
        default="auto",
        help="how ranks start: slurm (srun on the allocation's nodes), or DeepSpeed's pdsh (over"
        " ssh) or openmpi (mpirun with mpi4py discovery) on a hostfile's hosts. auto: slurm"
        " inside an allocation without --hostfile, else pdsh. One-host hostfiles start locally",
    )
    p.add_argument(
        "--verbose",
        action="store_true",
        help="show every rank's output on the console, DeepSpeed's and the launcher's too (by"
        " default the console shows rank 0's engine lines; everything is in RUN/stageN/logs/)",
    )
    p.add_argument(
        "--requeue",
        action="store_true",
        help="in a Slurm job: after a stop on the warning signal or the time limit, saved,"
        " `scontrol requeue` the job so it runs again and continues (wonderland.preemption.requeue)",
    )
    p.add_argument(
        "--preload-launcher",
        action="store_true",
        help="start DeepSpeed's launcher while the preflight runs, so its import overlaps the"
        " checks (pays on a CPU-only box, where that import is a good part of a launch; off by default)",
    )


def add_rerun_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rerun",
        action="store_true",
        help="train a completed stage again as a new attempt (its old folder is moved to"
        " stageN.attemptK, recorded in run.json)",
    )
