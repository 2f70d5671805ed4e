"""``wonderland train | pipeline | status | inspect | convert``: the front process.

``train`` validates and preflights in this process, then hands the stage to DeepSpeed's own
launcher (which runs ``wonderland_ds/train.py`` on every rank). A refusal here means nothing was
launched or written.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from . import hostfile as hostfile_mod
from .findings import EXIT_GUARD, EXIT_OK, EXIT_REFUSED, Finding, Refused, has_errors, render
from .stage_args import DEFAULT_HOSTFILE, add_stage_flags, positive


def _hostfile(path: str) -> hostfile_mod.Hostfile:
    hf, found = hostfile_mod.parse(path)
    if hf is None:
        raise Refused(found)
    return hf


def _stage_argv(args: argparse.Namespace, run_dir: Path) -> list[str]:
    out = [
        "--stage",
        str(args.stage),
        "--config",
        str(Path(args.config).resolve()),
        "--run-dir",
        str(run_dir.resolve()),
    ]
    for flag in (
        "resume",
        "grad_acc_steps",
        "steps",
        "seed",
        "min_warmup_steps",
        "task",
        "baseline",
        "out",
        "fault",
    ):
        value = getattr(args, flag)
        if value is not None:
            if flag in ("baseline", "out") or (flag == "resume" and value != "auto"):
                value = str(Path(value).resolve())
            out += [f"--{flag.replace('_', '-')}", str(value)]
    for flag in (
        "optimizer_state",
        "scheduler_state",
        "allow_seed_change",
        "allow_data_change",
        "trust_checkpoint",
    ):
        if getattr(args, flag):
            out.append(f"--{flag.replace('_', '-')}")
    return out


def _dry_run(
    args: argparse.Namespace,
    run_dir: Path,
    world: int,
    cmd: list[str],
    decided: dict,
    notes: list[str],
) -> int:
    plan = decided["plan"]
    report = {
        "run_dir": str(run_dir),
        "world_size": world,
        "command": cmd,
        "deepspeed_config": decided["ds_dict"],
        "preflight": plan.to_dict(),
        "notes": notes,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("resolved DeepSpeed config:")
        print(json.dumps(decided["ds_dict"], indent=2))
        print("preflight:")
        render(plan.findings, False)
        print("launch command:\n  " + shlex.join(cmd))
        for note in notes:
            print(f"note: {note}")
        print("dry run: nothing launched")
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    from . import launch, manifest
    from .stage import plan_stage, resolve_run_dir

    hf = _hostfile(args.hostfile)
    world = args.nproc * len(hf.hosts) if args.nproc else hf.world_size
    run_dir = resolve_run_dir(args)
    cmd, env, notes = launch.build(
        hf, args.nproc, _stage_argv(args, run_dir), run_dir, args.master_port, args.launcher
    )
    if args.dry_run:
        return _dry_run(args, run_dir, world, cmd, plan_stage(args, world, run_dir), notes)
    receipt = run_dir / f".verified-stage{args.stage}.json"
    cmd += ["--verified", str(receipt.resolve())]
    # DeepSpeed's launcher imports itself while the preflight below runs; it launches
    # nothing until released (launch.Launch), and is killed if the preflight refuses.
    early = launch.Launch(cmd, env)
    try:
        plan = plan_stage(args, world, run_dir)["plan"]
        render(plan.findings, False)
        run_dir.mkdir(parents=True, exist_ok=True)
        notes += launch.write_env_file(run_dir, env)[1]
        # Rank 0 preflights again (the plain `deepspeed ... train.py` path has no front
        # process); hand it what was verified here so it reads the checkpoint and data once.
        from .stage import write_receipt

        write_receipt(receipt)
        for note in notes:
            print(f"note: {note}")
        print("launch: " + shlex.join(cmd), flush=True)
    except BaseException:
        early.cancel()
        raise
    rc = early.go()
    # Killed or crashed ranks leave DeepSpeed's /dev/shm all-reduce buffers behind: no rank of
    # this launch is alive now, so its buffers (named by its port) can go.
    from .distributed import shm_buffers

    port = cmd[cmd.index("--master_port") + 1]
    for path in shm_buffers(port):
        Path(path).unlink(missing_ok=True)
    if rc not in (EXIT_OK, EXIT_REFUSED, EXIT_GUARD):
        entry = ((manifest.read(run_dir) or {}).get("stages") or {}).get(str(args.stage), {})
        if entry.get("status") == "running":
            # Rank 0 records every failure it lives through (a timeout with the ranks that
            # stopped answering): when it recorded none, rank 0 itself died or hung.
            why = "rank 0 recorded no failure: rank 0 itself died or hung"
            manifest.update_stage(
                run_dir,
                args.stage,
                status="failed",
                finished=manifest.now(),
                error=f"launcher exit code {rc}; {why}",
            )
        else:
            why = f"rank 0 reported: {entry.get('error') or 'no error text'}"
        print(
            f"stage {args.stage} failed: the deepspeed launcher exited with {rc}; {why}"
            f" (each rank's output is above). Continue with --resume auto --run-dir {run_dir}",
            file=sys.stderr,
        )
    return rc


def cmd_pipeline(args: argparse.Namespace) -> int:
    from . import manifest, stages

    if args.to < args.from_:
        raise Refused(f"--to {args.to} is before --from {args.from_}", "use --from <= --to")
    run_dir = (
        Path(args.run_dir)
        if args.run_dir
        else Path("runs") / __import__("time").strftime("run-%Y%m%d-%H%M%S")
    )
    rc = EXIT_OK
    for n in range(args.from_, args.to + 1):
        done = ((manifest.read(run_dir) or {}).get("stages") or {}).get(str(n), {})
        if done.get("status") == "ok":
            print(f"stage {n}: already done in {run_dir}, skipped")
            continue
        st = stages.get(n)
        has_own = (run_dir / f"stage{n}" / "checkpoints").is_dir()
        resume = "auto" if (st.resumes or has_own) else None
        argv = [
            "--stage",
            str(n),
            "--config",
            args.config,
            "--run-dir",
            str(run_dir),
            "--hostfile",
            args.hostfile,
        ]
        if resume:
            argv += ["--resume", resume]
        if stages.get(n).preflight:
            argv += ["--optimizer-state", "--scheduler-state"]
        if args.nproc:
            argv += ["--nproc", str(args.nproc)]
        argv += ["--launcher", args.launcher]
        print(f"== stage {n}: {st.name}", flush=True)
        sub = build_train_parser()
        rc = cmd_train(sub.parse_args(argv))
        if rc != EXIT_OK:
            print(f"pipeline stopped at stage {n} (exit {rc})", file=sys.stderr)
            break
    print(run_dir.resolve())
    return rc


def _live(stage_dir: Path, entry: dict) -> dict:
    """Last metrics row, ETA while running, and guard events, read from the stage folder."""
    import csv

    out: dict = {}
    try:
        with open(stage_dir / "metrics.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError:
        rows = []
    if rows:
        out["last_metrics"] = rows[-1]
        target = entry.get("end_step")
        if entry.get("status") == "running" and target and len(rows) > 1:
            per_step = (float(rows[-1]["wall"]) - float(rows[0]["wall"])) / (len(rows) - 1)
            out["eta_s"] = round(max(0, target - int(rows[-1]["step"])) * per_step, 1)
    try:
        lines = (stage_dir / "guards.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    counts: dict[str, int] = {}
    for line in lines:
        guard = json.loads(line).get("guard", "?")
        counts[guard] = counts.get(guard, 0) + 1
    if counts:
        out["warnings"] = counts
    return out


def cmd_status(args: argparse.Namespace) -> int:
    from . import checkpoint as ck
    from . import manifest

    run_dir = Path(args.run_dir)
    data = manifest.read(run_dir)
    if data is None:
        raise Refused(
            Finding(
                "status",
                "error",
                f"no readable {manifest.NAME} here",
                "pass a run directory made by wonderland train/pipeline",
                str(run_dir),
            )
        )
    for key, entry in data["stages"].items():
        root = run_dir / f"stage{key}" / "checkpoints"
        newest = ck.newest_complete(root, deep=False)
        entry["latest_complete_checkpoint"] = str(newest.tag_dir) if newest else None
        entry.update(_live(run_dir / f"stage{key}", entry))
    report = run_dir / "stage17" / "report.json"
    if report.exists():
        data["gate"] = json.loads(report.read_text())["gate"]["verdict"]
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(f"run {data['run_dir']}")
    for key in sorted(data["stages"], key=int):
        e = data["stages"][key]
        extra = f" loss {e['final_loss']:.4f}" if isinstance(e.get("final_loss"), float) else ""
        print(
            f"  stage {key:>2} {e.get('name', ''):<24} {e.get('status', '?'):<12}"
            f" step {e.get('global_step', '-')}{extra}"
        )
        if e.get("latest_complete_checkpoint"):
            print(f"           latest complete checkpoint: {e['latest_complete_checkpoint']}")
        if e.get("last_metrics"):
            m = e["last_metrics"]
            eta = f", ETA {e['eta_s']:.0f} s" if e.get("eta_s") is not None else ""
            print(
                f"           last step {m.get('step')}: loss {m.get('loss')} lr {m.get('lr')}{eta}"
            )
        for guard, count in (e.get("warnings") or {}).items():
            print(f"           guard {guard}: {count} event(s)")
    if "gate" in data:
        print(f"  stage-17 gate: {data['gate']}")
    return EXIT_OK


def cmd_inspect(args: argparse.Namespace) -> int:
    from .ckpt_inspect import describe

    info, found = describe(Path(args.checkpoint))
    if args.json:
        print(
            json.dumps(
                {"checkpoint": info, "findings": [f.to_dict() for f in found]},
                indent=2,
                default=str,
            )
        )
    else:
        for key in (
            "path",
            "written_by",
            "complete",
            "stage",
            "global_step",
            "skipped_steps",
            "warmup_progress",
            "has_optimizer_state",
            "has_scheduler_state",
            "world_size",
            "zero_stage",
            "precision",
            "loss_scale",
            "data",
            "versions",
            "deepspeed_version",
            "optimizer_state_files",
            "client_state_keys",
        ):
            if key in info:
                print(f"{key:>22}: {info[key]}")
        render(found, False)
    return EXIT_REFUSED if has_errors(found) else EXIT_OK


def cmd_convert(args: argparse.Namespace) -> int:
    from . import checkpoint as ck
    from .ckpt_inspect import resolve_tag_dir
    from .universal import convert

    source = resolve_tag_dir(Path(args.checkpoint))
    v = ck.verify(source)
    if not v.complete and not args.unverified:
        raise Refused(
            v.findings
            + [
                Finding(
                    "convert",
                    "error",
                    "refusing to convert an unverified checkpoint",
                    "pass --unverified for plain DeepSpeed checkpoints you trust",
                    str(source),
                )
            ]
        )
    out, found = convert(source, Path(args.out) if args.out else source.parent)
    render(found, False)
    print(out)
    return EXIT_OK


def _eval_defaults(home: Path | None, meta: dict[str, object]) -> tuple[str, str | None]:
    """The config and --task the checkpoint's stage ran with (from its run.json), else the
    default config and the config's own task."""
    from . import manifest
    from .stage_args import DEFAULT_CONFIG

    stages = ((manifest.read(home) or {}).get("stages") or {}) if home else {}
    entry = stages.get(str(meta.get("stage"))) or {}
    used, argv = entry.get("config"), entry.get("argv") or []
    config = used if isinstance(used, str) and Path(used).is_file() else str(DEFAULT_CONFIG)
    task = argv[argv.index("--task") + 1] if "--task" in argv[:-1] else None
    return config, task


def cmd_eval(args: argparse.Namespace) -> int:
    """Stage 17 on one checkpoint, outside the pipeline: same preflight, same launcher path
    (``cmd_train``), same per-rank code; only the run directory and report folder differ."""
    import os

    from . import checkpoint as ck
    from .ckpt_inspect import resolve_tag_dir
    from .evaluate import run_holding
    from .preflight import stage_ckpt_root

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
    meta = ck.read_meta(tag_dir) or {}
    config, task = (args.config, args.task) if args.config else _eval_defaults(home, meta)
    task = args.task or task
    argv = ["--stage", "17", "--config", config, "--run-dir", str(run_dir)]
    argv += ["--resume", str(tag_dir), "--hostfile", args.hostfile]
    seed = (meta.get("data") or {}).get("seed")
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


def _add_launch_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--hostfile",
        default=str(DEFAULT_HOSTFILE),
        help="DeepSpeed hostfile (default: %(default)s)",
    )
    p.add_argument("--nproc", type=positive, help="processes per node (default: hostfile slots)")
    p.add_argument("--master-port", type=positive, help="rendezvous port (default: a free one)")
    from .launch import LAUNCHERS

    p.add_argument(
        "--launcher",
        choices=LAUNCHERS,
        default="pdsh",
        help="DeepSpeed's multi-node launcher (default pdsh over ssh; openmpi: mpirun with"
        " mpi4py discovery). One-host runs start locally whatever this says",
    )


def build_train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wonderland train")
    add_stage_flags(p)
    _add_launch_flags(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, launch command and preflight; launch nothing",
    )
    return p


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser("train", help="run one stage through the deepspeed launcher")
    add_stage_flags(p)
    _add_launch_flags(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, launch command and preflight; launch nothing",
    )
    p.set_defaults(func=cmd_train)

    p = sub.add_parser("pipeline", help="run stages in order (default 15 -> 17)")
    p.add_argument("--from", dest="from_", type=int, default=15, choices=range(1, 19), metavar="N")
    p.add_argument("--to", type=int, default=17, choices=range(1, 19), metavar="N")
    p.add_argument("--run-dir")
    from .stage_args import DEFAULT_CONFIG

    p.add_argument("--config", default=str(DEFAULT_CONFIG))
    _add_launch_flags(p)
    p.set_defaults(func=cmd_pipeline)

    p = sub.add_parser("status", help="stages, outcomes and checkpoints of a run directory")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)

    p = sub.add_parser("inspect", help="what a checkpoint holds and lacks (never runs its code)")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser("convert", help="make a universal checkpoint (ds_to_universal)")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--out", help="folder for the universal checkpoint (default: beside it)")
    p.add_argument(
        "--unverified", action="store_true", help="convert a checkpoint without wonderland metadata"
    )
    p.set_defaults(func=cmd_convert)

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
    _add_launch_flags(p)
    p.add_argument("--json", action="store_true", help="print report.json (plus exit_code) only")
    p.set_defaults(func=cmd_eval)
