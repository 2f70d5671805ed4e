"""After a stage stopped on Slurm's warning signal or its time limit, saved: the requeue that
lets the same command line continue the stage in the job's next allocation."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from wonderland_ds.core.findings import EXIT_STOPPED, Refused

if TYPE_CHECKING:
    from wonderland_ds.launch.supervise import Supervisor


def after_stop(args: argparse.Namespace, rc: int, sup: Supervisor, run_dir: Path | None) -> int:
    """After a stop on Slurm's warning signal or the time limit, saved: requeue the job when
    asked (``--requeue`` or ``wonderland.preemption.requeue``). Last thing the command does:
    Slurm signals every process of the job at once."""
    from wonderland_ds.core.slurm import Allocation

    alloc = Allocation.from_env()
    if rc != EXIT_STOPPED or alloc is None:
        return rc
    record = None
    if run_dir is not None:
        from wonderland_ds.run import manifest

        record = manifest.stage_record(run_dir, args.stage)
    stop = record.stop if record is not None else None
    wanted = bool(sup.stop and sup.stop.requeue_wanted) or bool(
        stop and (stop.reason == "time-limit" or stop.signal == "SIGUSR1")
    )
    end = sup.job_end
    if not wanted and end is not None and time.time() >= end - 60:
        wanted = True  # Slurm's own SIGTERM at the time limit (no warning signal was asked)
    if not (getattr(args, "requeue", False) or _requeue_setting(args)):
        if wanted:
            print(
                f"Slurm job {alloc.job_id}: stopped for its time limit; not requeued (pass"
                " --requeue or set wonderland.preemption.requeue to continue by itself)",
                file=sys.stderr,
            )
        return rc
    if not wanted:
        print(f"Slurm job {alloc.job_id}: stopped by a cancel, not requeued", file=sys.stderr)
        return rc
    print(
        f"Slurm job {alloc.job_id}: requeued (restart {alloc.restart_count + 1}); the same command"
        " continues the stage from its newest complete checkpoint",
        file=sys.stderr,
        flush=True,
    )
    if run_dir is not None and stop is not None:
        from wonderland_ds.run import manifest

        manifest.update_stage(
            run_dir, args.stage, stop=stop.model_copy(update={"requeued": True}).model_dump()
        )
    why = alloc.requeue()
    if why is not None:
        print(f"requeue failed: {why}", file=sys.stderr)
    return rc


def _requeue_setting(args: argparse.Namespace) -> bool:
    from wonderland_ds.launch.stage import load_config

    try:
        return load_config(args.config, args.stage, None)[2].preemption.requeue
    except Refused:
        return False
