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
from collections.abc import Callable
from pathlib import Path
from typing import Any

from wonderland_ds.config import hostfile as hostfile_mod
from wonderland_ds.config import shipped
from wonderland_ds.core.findings import (
    EXIT_GUARD,
    EXIT_OK,
    EXIT_REFUSED,
    Finding,
    Refused,
    has_errors,
    render,
)
from wonderland_ds.launch.flags import DEFAULT_HOSTFILE, add_stage_flags, non_negative, positive


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


def _refuse_rerun(args: argparse.Namespace, run_dir: Path) -> None:
    """A completed training stage is never trained over: refused unless ``--rerun`` starts a
    new attempt (its old folder is moved aside, with a record, after the preflight passed).
    Evaluation and export write no checkpoints: running them again replaces their report."""
    from wonderland_ds.config import stages
    from wonderland_ds.run import manifest

    entry = ((manifest.read(run_dir) or {}).get("stages") or {}).get(str(args.stage)) or {}
    if stages.get(args.stage).kind != "train":
        return
    if entry.get("status") != "ok" or getattr(args, "rerun", False):
        return
    made = entry.get("output_checkpoint") or entry.get("checkpoint") or entry.get("report")
    raise Refused(
        Finding(
            "stage-complete",
            "error",
            f"stage {args.stage} is complete in {run_dir} ({made or 'no output recorded'},"
            f" finished {entry.get('finished')}): training it again would mix two attempts",
            "pass --rerun to start a new attempt (the old stage folder is moved to"
            f" stage{args.stage}.attemptN, recorded in run.json), or use a new --run-dir",
            str(run_dir / manifest.NAME),
            f"stages.{args.stage}.status",
        )
    )


def _move_attempt_aside(run_dir: Path, stage: int) -> None:
    """``RUN/stageN`` -> ``RUN/stageN.attemptK``, recorded in the stage's ``attempts``."""
    from wonderland_ds.run import manifest

    folder = run_dir / f"stage{stage}"
    data = manifest.read(run_dir) or {}
    entry = (data.get("stages") or {}).get(str(stage)) or {}
    attempts = list(entry.get("attempts") or [])
    if folder.exists():
        k = len(attempts) + 1
        while (run_dir / f"stage{stage}.attempt{k}").exists():
            k += 1
        aside = run_dir / f"stage{stage}.attempt{k}"
        folder.rename(aside)
        attempts.append(
            {
                "folder": str(aside.resolve()),
                "status": entry.get("status"),
                "output_checkpoint": entry.get("output_checkpoint"),
                "finished": entry.get("finished"),
                "moved": manifest.now(),
            }
        )
    manifest.replace_stage(run_dir, stage, {"attempts": attempts} if attempts else {})


def _continue_hint(args: argparse.Namespace, run_dir: Path) -> str:
    """The command that continues this run: the one the user typed, with ``--resume auto``
    and ``--run-dir`` for ``train``."""
    argv = list(getattr(args, "invoked", None) or ["train", *sys.argv[1:]])
    if argv and argv[0] == "train":
        argv = [a for a in argv if a != "--rerun"]
        for flag, value in (("--resume", "auto"), ("--run-dir", str(run_dir))):
            if flag in argv[:-1]:
                argv[argv.index(flag) + 1] = value
            else:
                argv += [flag, value]
    return "wonderland " + shlex.join(argv)


def _failed_hosts(entry: dict) -> list[str]:
    hosts = entry.get("failed_hosts")
    return [h for h in hosts if isinstance(h, str)] if isinstance(hosts, list) else []


def cmd_train(args: argparse.Namespace) -> int:
    import copy
    import time

    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.launch import command as launch
    from wonderland_ds.launch.stage import plan_stage, resolve_run_dir
    from wonderland_ds.run import manifest

    hf = _hostfile(args.hostfile)
    run_dir = resolve_run_dir(args)
    _refuse_rerun(args, run_dir)
    exclude: list[str] = []

    def world_of() -> int:
        hosts = {h: n for h, n in hf.hosts.items() if h not in exclude}
        return args.nproc * len(hosts) if args.nproc else sum(hosts.values())

    def command(a: argparse.Namespace) -> tuple[list[str], dict[str, str], list[str]]:
        return launch.build(
            hf, a.nproc, _stage_argv(a, run_dir), run_dir, a.master_port, a.launcher, exclude
        )

    if args.dry_run:
        cmd, _, notes = command(args)
        world = world_of()
        return _dry_run(args, run_dir, world, cmd, plan_stage(args, world, run_dir), notes)
    restarts: list[dict] = []
    attempt_args = args
    started = time.time()
    port_retries = 0
    while True:
        rc, settings, port_taken = _launch_once(attempt_args, run_dir, world_of(), command, started)
        if rc in (EXIT_OK, EXIT_REFUSED, EXIT_GUARD):
            break
        if port_taken and args.master_port is None and port_retries < 2:
            # The automatically chosen port was taken between its choice and the rendezvous:
            # not the stage's fault, not a restart; another port.
            port_retries += 1
            print(f"stage {args.stage}: the chosen port was taken; launching again on another")
            started = time.time()
            continue
        allowed = args.max_restarts if args.max_restarts is not None else settings.max_restarts
        entry = ((manifest.read(run_dir) or {}).get("stages") or {}).get(str(args.stage), {})
        cause = str(entry.get("error") or f"the deepspeed launcher exited with {rc}")
        if len(restarts) >= allowed:
            if restarts:
                print(
                    f"stage {args.stage} failed after {len(restarts)} restart(s) (--max-restarts"
                    f" {allowed}): exit code {rc}; {cause}",
                    file=sys.stderr,
                )
            break
        newest = ck.newest_complete(run_dir / f"stage{args.stage}" / "checkpoints", deep=False)
        since = newest.tag_dir.stat().st_mtime if newest else started
        failed = _failed_hosts(entry)
        if args.exclude_failed_hosts and failed and len(hf.hosts) > 1:
            exclude[:] = sorted(set(exclude) | set(failed))
        restarts.append(
            {
                "attempt": len(restarts) + 1,
                "cause": cause[:500],
                "exit_code": rc,
                "rank": entry.get("failed_rank"),
                "host": failed[0] if failed else None,
                "excluded_hosts": list(exclude),
                "resumed_from_step": ck.step_of(newest.tag_dir.name) if newest else None,
                "seconds_lost": round(max(0.0, time.time() - since), 1),
                "at": manifest.now(),
            }
        )
        backoff = min(300.0, settings.restart_backoff_s * 2 ** (len(restarts) - 1))
        manifest.update_stage(run_dir, args.stage, status="restarting", restarts=restarts)
        where = f"from {newest.tag_dir}" if newest else "from where it started"
        print(
            f"stage {args.stage}: restart {len(restarts)} of {allowed} in {backoff:.0f} s,"
            f" {where} (cause: {cause[:200]})",
            file=sys.stderr,
            flush=True,
        )
        time.sleep(backoff)
        attempt_args = copy.copy(args)
        attempt_args.rerun = False  # a restart continues this attempt
        if newest is not None:
            attempt_args.resume = "auto"
        started = time.time()
    return rc


def _launch_once(
    args: argparse.Namespace,
    run_dir: Path,
    world: int,
    command: Callable[[argparse.Namespace], tuple[list[str], dict[str, str], list[str]]],
    started: float,
) -> tuple[int, Any, bool]:
    """One launch of the stage: preflight here (a refusal raises), then DeepSpeed's
    launcher. (exit code, the stage's settings, whether no rank started on a taken port)."""
    import os

    from wonderland_ds.launch import command as launch
    from wonderland_ds.launch.stage import plan_stage
    from wonderland_ds.run import liveness as runstate
    from wonderland_ds.run import manifest

    cmd, env, notes = command(args)
    receipt = run_dir / f".verified-stage{args.stage}.json"
    cmd += ["--verified", str(receipt.resolve())]
    # DeepSpeed's launcher imports itself while the preflight below runs; it launches
    # nothing until released (launch.Launch), and is killed if the preflight refuses.
    early = launch.Launch(cmd, env)
    try:
        if getattr(args, "rerun", False):
            args.rerun_pending = True  # the preflight looks past the old attempt's folder
        decided = plan_stage(args, world, run_dir)
        plan, settings = decided["plan"], decided["settings"]
        render(plan.findings, False)
        if getattr(args, "rerun", False):
            _move_attempt_aside(run_dir, args.stage)
            args.rerun, args.rerun_pending = False, False
        run_dir.mkdir(parents=True, exist_ok=True)
        notes += launch.write_env_file(run_dir, env)[1]
        # Rank 0 preflights again (the plain `deepspeed ... train.py` path has no front
        # process); hand it what was verified here so it reads the checkpoint and data once.
        from wonderland_ds.launch.stage import write_receipt

        write_receipt(receipt)
        for note in notes:
            print(f"note: {note}")
        print("launch: " + shlex.join(cmd), flush=True)
        manifest.update_stage(
            run_dir,
            args.stage,
            status="running",
            front={"pid": os.getpid(), "host": runstate.host(), "started": manifest.now()},
        )
    except BaseException:
        early.cancel()
        raise
    rc = early.go()
    port_taken = False
    # Killed or crashed ranks leave DeepSpeed's /dev/shm all-reduce buffers behind: no rank of
    # this launch is alive now, so its buffers (named by its port) can go.
    from wonderland_ds.core.distributed import shm_buffers

    port = cmd[cmd.index("--master_port") + 1]
    for path in shm_buffers(port):
        Path(path).unlink(missing_ok=True)
    if rc not in (EXIT_OK, EXIT_REFUSED, EXIT_GUARD):
        entry = ((manifest.read(run_dir) or {}).get("stages") or {}).get(str(args.stage), {})
        beats = runstate.heartbeats(run_dir / f"stage{args.stage}")
        ranks_started = any(b.get("time", 0) >= started for b in beats)
        taken = "" if launch.port_free(int(port)) else f"; port {port} is taken by another process"
        port_taken = bool(taken) and not ranks_started
        if entry.get("status") == "running" and not entry.get("error"):
            # Rank 0 records every failure it lives through (a timeout with the ranks that
            # stopped answering): when it recorded none, rank 0 itself died or hung.
            why = (
                "rank 0 recorded no failure: rank 0 itself died or hung"
                if ranks_started
                else f"no rank started{taken or ' (see the output above)'}"
            )
            manifest.update_stage(
                run_dir,
                args.stage,
                status="failed",
                finished=manifest.now(),
                exit_code=rc,
                error=f"launcher exit code {rc}; {why}",
            )
        else:
            why = f"rank 0 reported: {entry.get('error') or 'no error text'}"
            manifest.update_stage(run_dir, args.stage, status="failed", exit_code=rc)
        print(
            f"stage {args.stage} failed: the deepspeed launcher exited with {rc}; {why}"
            f" (each rank's output is above). Continue with: {_continue_hint(args, run_dir)}",
            file=sys.stderr,
        )
    return rc, settings, port_taken


def cmd_pipeline(args: argparse.Namespace) -> int:
    from wonderland_ds.config import stages
    from wonderland_ds.run import liveness as runstate
    from wonderland_ds.run import manifest

    if args.to < args.from_:
        raise Refused(f"--to {args.to} is before --from {args.from_}", "use --from <= --to")
    run_dir = (
        Path(args.run_dir)
        if args.run_dir
        else Path("runs") / __import__("time").strftime("run-%Y%m%d-%H%M%S")
    )
    rc = EXIT_OK
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
            "--hostfile",
            args.hostfile,
        ]
        if resume:
            argv += ["--resume", resume]
        if stages.get(n).preflight:
            argv += ["--optimizer-state", "--scheduler-state"]
        if args.nproc:
            argv += ["--nproc", str(args.nproc)]
        for flag in ("master_port", "max_restarts"):
            if getattr(args, flag) is not None:
                argv += [f"--{flag.replace('_', '-')}", str(getattr(args, flag))]
        if args.exclude_failed_hosts:
            argv.append("--exclude-failed-hosts")
        if rerun:
            argv.append("--rerun")
        argv += ["--launcher", args.launcher]
        print(f"== stage {n}: {st.name}", flush=True)
        sub = build_train_parser()
        stage_args = sub.parse_args(argv)
        stage_args.invoked = getattr(args, "invoked", None)
        rc = cmd_train(stage_args)
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
        if entry.get("state") == "running" and target and len(rows) > 1:
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
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.run import manifest

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
    from wonderland_ds.run import liveness as runstate

    states = runstate.true_states(run_dir, data)
    for key, entry in data["stages"].items():
        root = run_dir / f"stage{key}" / "checkpoints"
        newest = ck.newest_complete(root, deep=False)
        entry["latest_complete_checkpoint"] = str(newest.tag_dir) if newest else None
        entry.update(states.get(key, {}))
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
            f"  stage {key:>2} {e.get('name', ''):<24} {e.get('state', '?'):<12}"
            f" step {e.get('global_step', '-')}{extra}"
        )
        if e.get("state") == "interrupted":
            age = e.get("heartbeat_age_s")
            seen = f"last heartbeat {age:.0f} s ago" if age is not None else "no heartbeat"
            print(f"           no process of it is alive ({seen}); continue with --resume auto")
        if e.get("state") == "stale":
            print(f"           stale: {e['stale_because']}")
        if e.get("state") == "failed" and e.get("error"):
            code = f"exit code {e['exit_code']}: " if e.get("exit_code") is not None else ""
            print(f"           {code}{str(e['error'])[:200]}")
        for r in e.get("restarts") or []:
            print(
                f"           restart {r['attempt']}: {str(r['cause'])[:120]} (resumed from step"
                f" {r['resumed_from_step']}, {r['seconds_lost']} s lost)"
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
    from wonderland_ds.checkpoint.describe import describe

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
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint.describe import resolve_tag_dir
    from wonderland_ds.checkpoint.universal import convert

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
    from wonderland_ds.launch.flags import DEFAULT_CONFIG
    from wonderland_ds.run import manifest

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

    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint.describe import resolve_tag_dir
    from wonderland_ds.eval.evaluate import run_holding
    from wonderland_ds.run.preflight import stage_ckpt_root

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
        type=shipped.hostfile_path,
        default=str(DEFAULT_HOSTFILE),
        help="DeepSpeed hostfile, a path or a shipped one's name (default: %(default)s)",
    )
    p.add_argument("--nproc", type=positive, help="processes per node (default: hostfile slots)")
    p.add_argument("--master-port", type=positive, help="rendezvous port (default: a free one)")
    p.add_argument(
        "--max-restarts",
        type=non_negative,
        help="relaunch a stage whose rank died or timed out, from its newest complete"
        " checkpoint, up to N times (default: wonderland.max_restarts, 0)",
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
        choices=LAUNCHERS,
        default="pdsh",
        help="DeepSpeed's multi-node launcher (default pdsh over ssh; openmpi: mpirun with"
        " mpi4py discovery). One-host runs start locally whatever this says",
    )


def _add_rerun_flag(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--rerun",
        action="store_true",
        help="train a completed stage again as a new attempt (its old folder is moved to"
        " stageN.attemptK, recorded in run.json)",
    )


def build_train_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="wonderland train")
    add_stage_flags(p)
    _add_launch_flags(p)
    _add_rerun_flag(p)
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
    _add_rerun_flag(p)
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
    from wonderland_ds.launch.flags import DEFAULT_CONFIG

    p.add_argument("--config", type=shipped.config_path, default=str(DEFAULT_CONFIG))
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
