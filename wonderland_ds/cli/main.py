"""The ``wonderland`` command: one sub-command per concern, all refusals exit 2.

Heavy imports (torch, deepspeed) happen inside the commands that need them, so ``check`` and
``status`` answer in well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from wonderland_ds.core.findings import (
    EXIT_GUARD,
    EXIT_OK,
    EXIT_REFUSED,
    Finding,
    GuardStop,
    Refused,
    has_errors,
    render,
)
from wonderland_ds.launch.flags import positive, stage_number


def cmd_check(args: argparse.Namespace) -> int:
    from wonderland_ds.config import ds_config, hostfile

    findings: list[Finding] = []
    world = args.world_size
    if args.hostfile:
        hf, found = hostfile.parse(args.hostfile)
        findings += found
        if hf is not None and world is None:
            world = hf.world_size
    stages = {args.stage} if args.stage else set()
    for path in args.configs:
        found = ds_config.check_file(path, world, stages)
        findings += found or [Finding("config", "ok", "valid", "", path)]
        if not has_errors(found):
            findings += _task_findings(path, args.task)
    render(findings, args.json)
    if not args.json:
        n_err = sum(f.severity == "error" for f in findings)
        n_warn = sum(f.severity == "warn" for f in findings)
        verdict = "refused" if n_err else "ok"
        print(f"{verdict}: {len(args.configs)} config(s), {n_err} error(s), {n_warn} warning(s)")
    return EXIT_REFUSED if has_errors(findings) else EXIT_OK


def _task_findings(path: str, spec: str | None) -> list[Finding]:
    """The task check for a valid config that names a user task, or for ``--task``."""
    from wonderland_ds.config import ds_config
    from wonderland_ds.eval.check import check_task, names_a_task

    raw, _ = ds_config.load_json(path)
    assert raw is not None
    spec = spec or names_a_task(raw)
    if spec is None:
        return []
    _, settings, _ = ds_config.validate(raw, path)
    assert settings is not None
    micro = raw.get("train_micro_batch_size_per_gpu")
    return check_task(spec, settings, micro if isinstance(micro, int) and micro > 0 else 1, path)


def cmd_cache(args: argparse.Namespace) -> int:
    from pathlib import Path

    from wonderland_ds.data import cache, tasks

    task = tasks.load(args.source).materialize()
    index, found = cache.write(task, Path(args.out))
    if args.json:
        summary = {k: index[k] for k in ("task", "fingerprint", "rows")}
        print(
            json.dumps(
                {
                    **summary,
                    "path": str(Path(args.out).resolve()),
                    "shards": sum(len(v) for v in index["splits"].values()),
                },
                indent=2,
            )
        )
    else:
        render(found, False)
        print(f"fingerprint {index['fingerprint']}")
    return EXIT_OK


def cmd_doctor(args: argparse.Namespace) -> int:
    from wonderland_ds.doctor import doctor

    ops = None
    if args.prebuild is not None:
        ops = [o.strip() for o in args.prebuild.split(",") if o.strip()]
    return doctor.main(args.hostfile, args.checkpoint, args.run_dir, ops, args.json, args.config)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wonderland",
        description="Run and guard the Wonderland pipeline's stages on DeepSpeed.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("check", help="validate DeepSpeed JSON configs and a hostfile, no GPU")
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="DeepSpeed JSON config file(s)")
    p.add_argument("--hostfile", help="hostfile whose slots give the world size")
    p.add_argument("--world-size", type=positive, help="data-parallel size (default: hostfile)")
    p.add_argument("--stage", type=stage_number, help="apply the rules for this stage (e.g. 16)")
    p.add_argument(
        "--task",
        help="also build this task's model and run one forward and loss on one micro-batch of"
        " its data (default: the config's task when it is causal-lm or module:function)",
    )
    p.add_argument("--json", action="store_true", help="print findings as a JSON list")
    p.set_defaults(func=cmd_check)

    p = sub.add_parser("cache", help="write a dataset once as verified tensor shards")
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a built-in task (digits, pylm) or module:function returning a Task",
    )
    p.add_argument("--out", required=True, help="cache folder (created; never overwritten)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cache)

    p = sub.add_parser("doctor", help="check this machine, DeepSpeed, hosts and disk before a run")
    p.add_argument("--hostfile", help="check every host in it is reachable by ssh")
    p.add_argument("--config", help="a wonderland config: its timeout and the ops it needs")
    p.add_argument(
        "--checkpoint", help="compare the versions it was saved with to the installed ones"
    )
    p.add_argument("--run-dir", help="where checkpoints will be written (free space; default .)")
    p.add_argument(
        "--prebuild",
        nargs="?",
        const="",
        metavar="OPS",
        help="build DeepSpeed's JIT ops now (default: the ones a stage needs here;"
        " or a comma-separated list of op names)",
    )
    p.add_argument("--json", action="store_true", help="print the checks as a JSON object")
    p.set_defaults(func=cmd_doctor)

    from wonderland_ds.cli import commands

    commands.add_commands(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.invoked = list(sys.argv[1:] if argv is None else argv)  # for hints naming it
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except Refused as exc:
        if getattr(args, "json", False):
            json.dump({"refused": [f.to_dict() for f in exc.findings]}, sys.stdout, indent=2)
            print()
        else:
            render(exc.findings, False, sys.stderr)
            print("refused: nothing was started, written or deleted", file=sys.stderr)
        return EXIT_REFUSED
    except GuardStop as exc:
        render(exc.findings, False, sys.stderr)
        return EXIT_GUARD
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
