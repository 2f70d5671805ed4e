"""A stage's attempts: a completed training stage is not trained over unless ``--rerun``
moves its old folder aside; the hint that continues a failed one."""

from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from wonderland_ds.core.findings import Finding, Refused


def refuse_rerun(args: argparse.Namespace, run_dir: Path) -> None:
    """A completed training stage is never trained over: refused unless ``--rerun`` starts a
    new attempt (its old folder is moved aside, with a record, after the preflight passed).
    Evaluation and export write no checkpoints: running them again replaces their report."""
    from wonderland_ds.config import stages
    from wonderland_ds.run import manifest

    entry = manifest.stage_record(run_dir, args.stage)
    if stages.get(args.stage).kind != "train":
        return
    if entry.status != "ok" or getattr(args, "rerun", False):
        return
    made = entry.output_checkpoint or entry.checkpoint or entry.report
    raise Refused(
        Finding(
            "stage-complete",
            "error",
            f"stage {args.stage} is complete in {run_dir} ({made or 'no output recorded'},"
            f" finished {entry.finished}): training it again would mix two attempts",
            "pass --rerun to start a new attempt (the old stage folder is moved to"
            f" stage{args.stage}.attemptN, recorded in run.json), or use a new --run-dir",
            str(run_dir / manifest.NAME),
            f"stages.{args.stage}.status",
        )
    )


def move_attempt_aside(run_dir: Path, stage: int) -> None:
    """``RUN/stageN`` -> ``RUN/stageN.attemptK``, recorded in the stage's ``attempts``."""
    from wonderland_ds.run import manifest

    folder = run_dir / f"stage{stage}"
    entry = manifest.stage_record(run_dir, stage)
    attempts = list(entry.attempts)
    if folder.exists():
        k = len(attempts) + 1
        while (run_dir / f"stage{stage}.attempt{k}").exists():
            k += 1
        aside = run_dir / f"stage{stage}.attempt{k}"
        folder.rename(aside)
        attempts.append(
            {
                "folder": str(aside.resolve()),
                "status": entry.status,
                "output_checkpoint": entry.output_checkpoint,
                "finished": entry.finished,
                "moved": manifest.now(),
            }
        )
    manifest.replace_stage(run_dir, stage, {"attempts": attempts} if attempts else {})


def continue_hint(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run: the one the user typed, with ``--resume auto``
    and ``--run-dir`` for ``train``."""
    argv = list(getattr(args, "invoked", None) or ["train", *sys.argv[1:]])
    if argv and argv[0] == "train":
        argv = [a for a in argv if a != "--rerun"]
        for flag in ("--resume", "--run-dir"):  # replaced by the two the hint ends with
            while flag in argv[:-1]:
                i = argv.index(flag)
                del argv[i : i + 2]
        argv += ["--resume", "auto", "--run-dir", str(run_dir)]
    return "wonderland " + shlex.join(argv)
