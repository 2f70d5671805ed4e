"""``wonderland train``: one stage, validated and preflighted in this process, then handed to
DeepSpeed's own launcher (which runs ``python -m wonderland_ds.train`` on every rank). A
refusal here means nothing was launched or written; a failed launch may restart the stage."""

from __future__ import annotations

import argparse
import copy
import json
import os
import shlex
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wonderland_ds.cli.attempts import continue_hint, move_attempt_aside, refuse_rerun
from wonderland_ds.cli.common import Commands, add_launch_flags, add_rerun_flag
from wonderland_ds.core.findings import (
    EXIT_DISK,
    EXIT_GUARD,
    EXIT_OK,
    EXIT_REFUSED,
    EXIT_STOPPED,
    Stopped,
    render,
)
from wonderland_ds.launch.flags import add_stage_flags

if TYPE_CHECKING:  # imported where used: the plan module brings pydantic and the config models
    from wonderland_ds.launch.plan import StagePlan
    from wonderland_ds.launch.supervise import Supervisor

#: What a launch runs: (command, environment, notes for the user) for a stage's flags.
CommandFor = Callable[[argparse.Namespace], tuple[list[str], dict[str, str], list[str]]]


def _dry_run(
    args: argparse.Namespace,
    run_dir: Path,
    world: int,
    cmd: list[str],
    decided: StagePlan,
    notes: list[str],
) -> int:
    plan = decided.preflight
    report = {
        "run_dir": str(run_dir),
        "world_size": world,
        "command": cmd,
        "deepspeed_config": decided.ds_dict,
        "preflight": plan.to_dict(),
        "notes": notes,
    }
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print("resolved DeepSpeed config:")
        print(json.dumps(decided.ds_dict, indent=2))
        print("preflight:")
        render(plan.findings, False)
        print("launch command:\n  " + shlex.join(cmd))
        for note in notes:
            print(f"note: {note}")
        print("dry run: nothing launched")
    return EXIT_OK


def cmd_train(args: argparse.Namespace) -> int:
    """``wonderland train``: the stage under this process's stop signals; a stop that asks for
    it requeues the Slurm job afterwards."""
    from wonderland_ds.launch.supervise import Supervisor

    with Supervisor() as sup:
        rc = train_stage(args, sup)
        from wonderland_ds.cli.requeue import after_stop

        return after_stop(args, rc, sup, Path(args.run_dir) if args.run_dir else None)


def train_stage(args: argparse.Namespace, sup: Supervisor) -> int:
    """One stage, restarted as ``--max-restarts`` allows; a signal before a launch stops it
    with nothing started (exit 4)."""
    try:
        return _train(args, sup)
    except Stopped as exc:
        print(
            f"stage {args.stage}: stopped on {exc.request.describe()} before its launch;"
            " nothing was started",
            file=sys.stderr,
            flush=True,
        )
        return EXIT_STOPPED


def _train(args: argparse.Namespace, sup: Supervisor) -> int:
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.launch.plan import StageOptions
    from wonderland_ds.launch.stage import plan_stage, resolve_run_dir
    from wonderland_ds.launch.target import decide
    from wonderland_ds.run import manifest

    target = decide(args.hostfile, args.launcher, args.nproc)
    run_dir = resolve_run_dir(args.run_dir, args.resume)
    refuse_rerun(args, run_dir)
    exclude: list[str] = []

    def command(a: argparse.Namespace) -> tuple[list[str], dict[str, str], list[str]]:
        # The ranks' flags, from the same options the plan records (paths made absolute).
        argv = StageOptions.from_args(a, run_dir.resolve()).argv()
        return target.command(a.nproc, argv, run_dir, a.master_port, exclude)

    if args.dry_run:
        cmd, _, notes = command(args)
        world = target.world(args.nproc, exclude)
        opts = StageOptions.from_args(args, run_dir.resolve())
        decided = plan_stage(opts, world, run_dir, dry_run=True)[0]
        return _dry_run(args, run_dir, world, cmd, decided, notes)
    restarts: list[dict] = []
    attempt_args = args
    started = time.time()
    port_retries = 0
    from wonderland_ds.launch.elastic import Nodes

    nodes = Nodes(args, run_dir, target, exclude)
    while True:
        world = target.world(args.nproc, exclude)
        attempt_args = nodes.before_launch(attempt_args, world)
        rc, settings, port_taken = _launch_once(
            attempt_args, run_dir, world, command, started, sup, target.srun
        )
        nodes.after_launch()
        if rc in (EXIT_OK, EXIT_REFUSED, EXIT_GUARD, EXIT_STOPPED, EXIT_DISK) or sup.stop:
            break
        if port_taken and args.master_port is None and port_retries < 2:
            # The automatically chosen port was taken between its choice and the rendezvous:
            # not the stage's fault, not a restart; another port.
            port_retries += 1
            print(f"stage {args.stage}: the chosen port was taken; launching again on another")
            started = time.time()
            continue
        allowed = args.max_restarts if args.max_restarts is not None else settings.max_restarts
        entry = manifest.stage_record(run_dir, args.stage)
        cause = str(entry.error or f"the deepspeed launcher exited with {rc}")
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
        failed = entry.failed_hosts
        many_hosts = len(target.hostfile.hosts) > 1 if target.hostfile else len(target.hosts) > 1
        if args.exclude_failed_hosts and failed and many_hosts:
            exclude[:] = sorted(set(exclude) | set(failed))
        shrink = nodes.lost(entry)
        if shrink is False:
            break  # fewer nodes left than --min-nodes: said
        restarts.append(
            {
                "attempt": len(restarts) + 1,
                "cause": cause[:500],
                "exit_code": rc,
                "rank": entry.failed_rank,
                "host": failed[0] if failed else None,
                "excluded_hosts": list(exclude),
                "resumed_from_step": ck.step_of(newest.tag_dir.name) if newest else None,
                "seconds_lost": round(max(0.0, time.time() - since), 1),
                "at": manifest.now(),
            }
        )
        # A lost node left out is a known cause: relaunch at once on the others.
        backoff = (
            0.0 if shrink else min(300.0, settings.restart_backoff_s * 2 ** (len(restarts) - 1))
        )
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
    command: CommandFor,
    started: float,
    sup: Supervisor,
    srun: bool,
) -> tuple[int, Any, bool]:
    """One launch of the stage: preflight here (a refusal raises), then DeepSpeed's
    launcher or srun. (exit code, the stage's settings, whether no rank started on a taken
    port)."""
    from wonderland_ds.launch import command as launch
    from wonderland_ds.launch import plan as plan_mod
    from wonderland_ds.launch import stage
    from wonderland_ds.launch.supervise import clear_request, wait_for_ranks
    from wonderland_ds.run import liveness as runstate
    from wonderland_ds.run import manifest

    sup.arm()
    cmd, env, notes = command(args)
    if getattr(args, "verbose", False):
        from wonderland_ds.core.console import VERBOSE_ENV

        env[VERBOSE_ENV] = "1"
        if "--log_level" in cmd:
            del cmd[cmd.index("--log_level") : cmd.index("--log_level") + 2]
    receipt = run_dir / f".verified-stage{args.stage}.json"
    cmd += ["--verified", str(receipt.resolve())]
    stage_dir = run_dir / f"stage{args.stage}"
    # With --preload-launcher, DeepSpeed's launcher imports itself while the preflight below
    # runs; it launches nothing until released, and is killed if the preflight refuses.
    early = launch.Launch(cmd, env, preload=getattr(args, "preload_launcher", False) and not srun)
    try:
        rerun = bool(getattr(args, "rerun", False))  # the preflight looks past the old attempt
        opts = plan_mod.StageOptions.from_args(args, run_dir.resolve())
        decided, _ = stage.plan_stage(opts, world, run_dir, rerun_pending=rerun)
        settings = decided.settings
        render(decided.preflight.findings, False)
        if rerun:
            move_attempt_aside(run_dir, args.stage)
            args.rerun = False
        run_dir.mkdir(parents=True, exist_ok=True)
        if not srun:
            notes += launch.write_env_file(run_dir, env)[1]
        # Rank 0 takes this plan, and what was verified here, instead of deciding again: the
        # checkpoint and data are read once (the plain `deepspeed ... train.py` path decides
        # on rank 0).
        plan_mod.write(receipt, decided, stage.receipt())
        for note in notes:
            print(f"note: {note}")
        print("launch: " + shlex.join(cmd), flush=True)
        clear_request(stage_dir)
        from wonderland_ds.run import failures

        failures.clear(stage_dir)
        manifest.update_stage(
            run_dir,
            args.stage,
            status="running",
            front={
                "pid": os.getpid(),
                "host": runstate.host(),
                "started": manifest.now(),
                "launch_flags": _launch_flags(args),
            },
            error=None,
            exit_code=None,
            lost=[],
        )
    except BaseException:
        early.cancel()
        raise
    sup.launching(stage_dir, srun)
    from wonderland_ds.launch.elastic import LaunchWatch

    with LaunchWatch(stage_dir, started, sup):  # ends a launcher that waits for a lost host
        rc = early.go(on_start=sup.attach)
    sup.detach()
    if sup.stop is not None and not wait_for_ranks(stage_dir, started):
        print(f"stage {args.stage}: ranks still alive after the stop; not waiting longer")
    port_taken = False
    # Killed or crashed ranks leave DeepSpeed's /dev/shm all-reduce buffers behind: no rank of
    # this launch is alive now, so its buffers (named by its port) can go.
    from wonderland_ds.core.distributed import shm_buffers

    port = env["MASTER_PORT"] if srun else cmd[cmd.index("--master_port") + 1]
    for path in shm_buffers(port):
        Path(path).unlink(missing_ok=True)
    entry = manifest.stage_record(run_dir, args.stage)
    if entry.status == "preempted":
        return EXIT_STOPPED, settings, False  # the ranks stopped on a signal, saved
    if entry.status == "disk-full":
        print(f"stage {args.stage}: {entry.error}", file=sys.stderr)
        return EXIT_DISK, settings, False
    if rc not in (EXIT_OK, EXIT_REFUSED, EXIT_GUARD):
        beats = runstate.heartbeats(run_dir / f"stage{args.stage}")
        ranks_started = any(b.get("time", 0) >= started for b in beats)
        taken = "" if launch.port_free(int(port)) else f"; port {port} is taken by another process"
        port_taken = bool(taken) and not ranks_started
        first = failures.launch_failure(stage_dir, started, beats)
        record: dict[str, Any] = {}  # what run.json gets beyond the failed status
        if first is not None:
            why = first.summary
            record = {"error": why[:1000], "failed_rank": first.rank}
            if first.lost:  # peers whose heartbeat stopped: their hosts may be gone
                record["lost"] = [p.model_dump() for p in first.lost]
                record["failed_hosts"] = sorted({p.host for p in first.lost})
        elif entry.status == "running" and not entry.error:
            why = (
                "no rank recorded a failure"
                if ranks_started
                else f"no rank started{taken or ' (see the output above)'}"
            )
            record = {"error": f"launcher exit code {rc}; {why}"}
        else:
            why = f"rank 0 reported: {entry.error or 'no error text'}"
        if record:
            record["finished"] = manifest.now()
        manifest.update_stage(run_dir, args.stage, status="failed", exit_code=rc, **record)
        print(
            f"stage {args.stage} failed: the launcher exited with {rc}; {why}."
            f" Continue with: {continue_hint(args, run_dir)}",
            file=sys.stderr,
        )
    return rc, settings, port_taken


def _launch_flags(args: argparse.Namespace) -> list[str]:
    """The launch flags this stage was started with (the hint that continues it repeats them)."""
    out: list[str] = []
    for flag in ("hostfile", "nproc", "launcher"):
        value = getattr(args, flag, None)
        if value is not None and value != "auto":
            out += [f"--{flag}", str(value)]
    return out


def _train_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    add_stage_flags(p)
    add_launch_flags(p)
    add_rerun_flag(p)
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config, launch command and preflight; launch nothing",
    )
    return p


def build_train_parser() -> argparse.ArgumentParser:
    """``train``'s flags alone: ``pipeline`` and ``eval`` run their stages through it."""
    return _train_flags(argparse.ArgumentParser(prog="wonderland train"))


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("train", help="run one stage through the deepspeed launcher")
    _train_flags(p).set_defaults(func=cmd_train)
