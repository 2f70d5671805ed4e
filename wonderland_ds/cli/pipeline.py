"""``wonderland pipeline``: stages in order (default 15 -> 17) through ``train``, skipping the
ones already done in the run directory and running stale ones again."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from wonderland_ds.cli.common import Commands, add_launch_flags
from wonderland_ds.cli.requeue import after_stop
from wonderland_ds.cli.train import build_train_parser, train_stage
from wonderland_ds.config import shipped
from wonderland_ds.core.findings import EXIT_OK, EXIT_STOPPED, Refused
from wonderland_ds.launch.flags import DEFAULT_CONFIG

if TYPE_CHECKING:
    from wonderland_ds.launch.supervise import Supervisor


def cmd_pipeline(args: argparse.Namespace) -> int:
    from wonderland_ds.launch.supervise import Supervisor

    if args.to < args.from_:
        raise Refused(f"--to {args.to} is before --from {args.from_}", "use --from <= --to")
    run_dir = Path(args.run_dir or Path("runs") / time.strftime("run-%Y%m%d-%H%M%S"))
    if args.from_ <= 17 <= args.to:
        _check_eval_tasks(args.config)
    with Supervisor() as sup:
        rc, last = _stages(args, run_dir, sup)
        if last is not None:
            rc = after_stop(last, rc, sup, run_dir)
    print(run_dir.resolve())
    return rc


def _check_eval_tasks(config: str) -> None:
    """Stage 17's lm-eval tasks before stage 15 starts: a broken task is refused now, not
    after hours of training (stage 17 checks them again on its own world size)."""
    from wonderland_ds.core.findings import has_errors
    from wonderland_ds.eval.task_check import settings_findings
    from wonderland_ds.launch.stage import load_config

    _, _, settings = load_config(config, 17, None)
    if settings.eval.tasks:
        found = settings_findings(settings, 1, config)
        if has_errors(found):
            raise Refused([f for f in found if f.severity == "error"])


def _stages(
    args: argparse.Namespace, run_dir: Path, sup: Supervisor
) -> tuple[int, argparse.Namespace | None]:
    """The stages in order; (exit code, the flags of the last stage run)."""
    from wonderland_ds.config import stages
    from wonderland_ds.run import liveness as runstate
    from wonderland_ds.run import manifest

    rc, stage_args = EXIT_OK, None
    for n in range(args.from_, args.to + 1):
        data = manifest.read(run_dir) or {}
        state = runstate.true_states(run_dir, data).get(str(n), {})
        if state.get("state") == "done":
            print(f"stage {n}: already done in {run_dir}, skipped")
            continue
        rerun = state.get("state") == "stale"
        if rerun:
            print(f"stage {n}: stale ({state['stale_because']}): running it again")
        st = stages.get(n)
        has_own = (run_dir / f"stage{n}" / "checkpoints").is_dir() and not rerun
        resume = "auto" if (st.resumes or has_own) else None
        argv = [
            "--stage",
            str(n),
            "--config",
            args.config,
            "--run-dir",
            str(run_dir),
        ]
        if args.hostfile:
            argv += ["--hostfile", args.hostfile]
        if resume:
            argv += ["--resume", resume]
        if stages.get(n).preflight:
            argv += ["--optimizer-state", "--scheduler-state"]
        if args.nproc:
            argv += ["--nproc", str(args.nproc)]
        for flag in ("master_port", "max_restarts", "min_nodes"):
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if args.exclude_failed_hosts:
            argv.append("--exclude-failed-hosts")
        if rerun:
            argv.append("--rerun")
        if args.requeue:
            argv.append("--requeue")
        if args.verbose:
            argv.append("--verbose")
        argv += ["--launcher", args.launcher]
        if args.preload_launcher:
            argv.append("--preload-launcher")
        print(f"== stage {n}: {st.name}", flush=True)
        sub = build_train_parser()
        stage_args = sub.parse_args(argv)
        stage_args.invoked = getattr(args, "invoked", None)
        rc = train_stage(stage_args, sup)
        if rc == EXIT_OK and sup.stop is not None:
            rc = EXIT_STOPPED  # the stage ended as the stop came: the next one does not start
        if rc != EXIT_OK:
            print(f"pipeline stopped at stage {n} (exit {rc})", file=sys.stderr)
            break
    return rc, stage_args


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("pipeline", help="run stages in order (default 15 -> 17)")
    p.add_argument("--from", dest="from_", type=int, default=15, choices=range(1, 19), metavar="N")
    p.add_argument("--to", type=int, default=17, choices=range(1, 19), metavar="N")
    p.add_argument("--run-dir")
    p.add_argument(
        "--config",
        type=shipped.config_path,
        default=str(DEFAULT_CONFIG),
        help="DeepSpeed JSON config, a path or a shipped config's name (default: %(default)s)",
    )
    add_launch_flags(p)
    p.set_defaults(func=cmd_pipeline)
