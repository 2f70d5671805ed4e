"""``wonderland eval --checkpoint CKPT``: stage 17 on any checkpoint, outside the pipeline,
through the same launch as ``train``."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from wonderland_ds.cli.common import Commands, add_launch_flags
from wonderland_ds.cli.train import build_train_parser, cmd_train
from wonderland_ds.core.findings import EXIT_GUARD, EXIT_OK, Finding, Refused
from wonderland_ds.launch.flags import DEFAULT_CONFIG


def _eval_defaults(home: Path | None, stage: int | None) -> tuple[str, str | None]:
    """The config and --task the checkpoint's stage ran with (from its run.json), else the
    default config and the config's own task."""
    from wonderland_ds.run import manifest

    entry = manifest.stage_record(home, stage) if home and stage is not None else None
    used, argv = (entry.config, entry.argv) if entry else (None, [])
    config = used if isinstance(used, str) and Path(used).is_file() else str(DEFAULT_CONFIG)
    task = argv[argv.index("--task") + 1] if "--task" in argv[:-1] else None
    return config, task


def cmd_eval(args: argparse.Namespace) -> int:
    """Stage 17 on one checkpoint, outside the pipeline: same preflight, same launcher path
    (``cmd_train``), same per-rank code; only the run directory and report folder differ."""
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint.describe import resolve_tag_dir
    from wonderland_ds.eval.evaluate import run_holding
    from wonderland_ds.run.resume_source import stage_ckpt_root

    ckpt = Path(args.checkpoint)
    if not ckpt.exists():
        raise Refused(
            Finding(
                "ckpt-missing",
                "error",
                "checkpoint path does not exist",
                "pass a global_stepN folder, or the folder holding it",
                args.checkpoint,
            )
        )
    tag_dir = resolve_tag_dir(ckpt)
    home = run_holding(tag_dir)
    # Refuse a bad baseline here, before anything is launched or written.
    if args.baseline:
        v = ck.verify(resolve_tag_dir(Path(args.baseline)))
        if not v.complete:
            raise Refused(v.findings)
    elif home is None or ck.newest_complete(stage_ckpt_root(home, 15), deep=False) is None:
        raise Refused(
            f"no baseline: {tag_dir} is not in a run with a complete stage-15 checkpoint",
            "pass --baseline PATH (the checkpoint to compare against)",
        )
    if args.out:
        run_dir = Path(args.out)  # the evaluation's own records; the source run is only read
    elif home is not None:
        run_dir = home
    else:
        raise Refused(
            f"{tag_dir} is not inside a run directory (no run.json above it)",
            "pass --out DIR for the report",
        )
    meta = ck.read_meta(tag_dir)
    stage = meta.stage if meta else None
    config, task = (args.config, args.task) if args.config else _eval_defaults(home, stage)
    task = args.task or task
    argv = ["--stage", "17", "--config", config, "--run-dir", str(run_dir)]
    argv += ["--resume", str(tag_dir)]
    argv += ["--hostfile", args.hostfile] if args.hostfile else []
    seed = meta.data.seed if meta and meta.data else None
    if isinstance(seed, int):
        # Evaluation draws no random numbers: the checkpoint's own seed keeps the preflight's
        # seed rule (about stage 16's data order) from refusing it.
        argv += ["--seed", str(seed)]
    argv += ["--task", task] if task else []
    for flag in ("baseline", "out", "nproc", "master_port", "launcher"):
        if getattr(args, flag) is not None:
            argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
    if args.allow_data_change:
        argv.append("--allow-data-change")
    if args.preload_launcher:
        argv.append("--preload-launcher")
    if args.verbose:
        argv.append("--verbose")
    on = f" on task {task}" if task else ""
    print(
        f"wonderland eval: {tag_dir} with {config}{on}",
        file=sys.stderr if args.json else sys.stdout,
    )
    train_args = build_train_parser().parse_args(argv)
    if not args.json:
        return cmd_train(train_args)
    # --json: stdout carries one JSON object; the launcher's and ranks' output goes to stderr.
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        os.dup2(2, 1)
        rc = cmd_train(train_args)
    finally:
        sys.stdout.flush()
        os.dup2(saved, 1)
        os.close(saved)
    report = (Path(args.out) if args.out else run_dir / "stage17") / "report.json"
    result = {"exit_code": rc, "report": str(report) if rc in (EXIT_OK, EXIT_GUARD) else None}
    if result["report"]:
        result |= json.loads(report.read_text())
    print(json.dumps(result, indent=2))
    return rc


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("eval", help="stage 17 on any checkpoint: per-class report, plots, gate")
    p.add_argument("--checkpoint", required=True, metavar="CKPT", help="checkpoint to evaluate")
    p.add_argument(
        "--baseline",
        metavar="CKPT",
        help="checkpoint to compare with (default: newest complete stage-15 one of its run)",
    )
    p.add_argument(
        "--out",
        metavar="DIR",
        help="folder for report.json, report.md, the plots and this evaluation's run.json"
        " (default: RUN/stage17 of the checkpoint's run)",
    )
    p.add_argument(
        "--config", help="wonderland config (default: the one the checkpoint's stage used)"
    )
    p.add_argument("--task", help="task to evaluate on (overrides the config's wonderland.task)")
    p.add_argument(
        "--allow-data-change",
        action="store_true",
        help="evaluate on a task whose training data differs from the checkpoint's",
    )
    add_launch_flags(p)
    p.add_argument("--json", action="store_true", help="print report.json (plus exit_code) only")
    p.set_defaults(func=cmd_eval)
