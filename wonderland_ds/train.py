"""Per-rank entry run by the ``deepspeed`` launcher (or ``mpirun``): parse, run, tear down.

deepspeed --hostfile hostfiles/localhost --no_ssh_check --module wonderland_ds.train --stage 16 ...
deepspeed --hostfile hostfiles/localhost --no_ssh_check wonderland_ds/train.py --stage 16 ...
mpirun -np 2 python -m wonderland_ds.train --stage 16 ...
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run as a script, Python puts this folder first on sys.path: its subpackages (config,
    # data, run, training, eval...) would shadow a user's task modules of those names.
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]

from wonderland_ds.core import console, quiet
from wonderland_ds.core.findings import (
    EXIT_DISK,
    EXIT_GUARD,
    EXIT_REFUSED,
    EXIT_STOPPED,
    GuardStop,
    Refused,
    Stopped,
    render,
)
from wonderland_ds.core.signals import StopSignals
from wonderland_ds.launch.flags import add_stage_flags
from wonderland_ds.training import startup


def stop_line(stage: int, exc: Stopped) -> str:
    """One line for a stop: what asked, where it stopped, what holds the work."""
    why = "refused data" if exc.request.reason == "bad-data" else exc.request.describe()
    head = f"stage {stage} stopped on {why}"
    if exc.request.reason == "disk-full":
        kept = f"; {exc.checkpoint} is the newest complete checkpoint" if exc.checkpoint else ""
        return f"stage {stage} stopped: {why}{kept}; continue with --resume auto once there is room"
    if exc.saved and exc.checkpoint:
        return f"{head} at step {exc.step}: checkpoint {exc.checkpoint} complete; resumable"
    if exc.checkpoint:
        return f"{head}: nothing trained since {exc.checkpoint}; resumable"
    return f"{head}: no checkpoint of this stage yet"


def main(argv: list[str] | None = None) -> int:
    # Before torch and DeepSpeed are imported: the collector's full scans of the start's
    # long-lived objects cost 0.81-0.87 s a rank (startup.py); it is back on at the first step.
    startup.hold()
    # From the first moment: a SIGTERM while the stage starts is acted on at its first step.
    signals = StopSignals().install()
    quiet.install()  # known-harmless third-party warnings, before DeepSpeed is imported
    parser = argparse.ArgumentParser(prog="wonderland_ds/train.py", description=__doc__)
    add_stage_flags(parser)
    parser.add_argument(
        "--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS
    )  # passed by the deepspeed launcher
    args = parser.parse_args(argv)
    rank_now = console.launch_rank()
    if args.run_dir and rank_now is not None and argv is None:
        # Before torch and DeepSpeed: their loggers write through the routed streams.
        console.route(Path(args.run_dir) / f"stage{args.stage}", rank_now)
    from wonderland_ds.core import distributed as dist
    from wonderland_ds.launch import rank

    agreed = False  # every rank reached the same end: tear down behind a barrier
    try:
        rc = rank.run(args, signals)
        agreed = True
        return rc
    except Stopped as exc:
        agreed = exc.agreed
        if dist.is_main():
            if exc.request.finding is not None:
                render([exc.request.finding], False, sys.stderr)
            print(f"[wonderland] {stop_line(args.stage, exc)}", file=sys.stderr, flush=True)
        # Data the next step would have read is refused: the user's input, exit 2.
        if exc.request.reason == "bad-data":
            return EXIT_REFUSED
        return EXIT_DISK if exc.request.reason == "disk-full" else EXIT_STOPPED
    except Refused as exc:
        agreed = True
        if dist.is_main():
            render(exc.findings, False, sys.stderr)
            print("refused: nothing was trained or written", file=sys.stderr, flush=True)
        console.drop_log()
        return EXIT_REFUSED
    except GuardStop as exc:
        agreed = True
        if dist.is_main():
            render(exc.findings, False, sys.stderr)
        return EXIT_GUARD
    except BaseException as exc:
        # Failed before the stage's own record (the process group, the first collectives):
        # the front still names this rank and its error.
        from wonderland_ds.run import failures

        if args.run_dir and rank_now is not None and not failures.recorded():
            failures.record(Path(args.run_dir) / f"stage{args.stage}", rank_now, exc)
        raise
    finally:
        startup.release(collect=False)  # a stage refused before its first step: on again
        dist.teardown(agreed)


if __name__ == "__main__":
    # Every rank reached the same end and tore its process groups down behind a barrier; all
    # files are closed: leave without interpreter finalization.
    from wonderland_ds.core import distributed

    distributed.leave(main())
