"""Run one stage on this rank: load config, take the stage's plan, build, restore, fit or
evaluate.

All ranks take the same decisions: rank 0 takes the plan the front process decided (or, on
the plain ``deepspeed ... train.py`` path, runs the preflight itself) and broadcasts it; a
refusal exits 2 on every rank before anything is written. torch is imported (through
``distributed``) only inside :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from wonderland_ds.config import stages
from wonderland_ds.core.allocator import fix_threshold
from wonderland_ds.core.distributed import log
from wonderland_ds.core.findings import (
    EXIT_LOST,
    EXIT_REFUSED,
    Finding,
    GuardStop,
    Refused,
    Stopped,
    render,
)
from wonderland_ds.core.signals import StopRequest, StopSignals
from wonderland_ds.core.slurm import Allocation
from wonderland_ds.data import tasks
from wonderland_ds.launch.flags import overrides
from wonderland_ds.launch.plan import StageOptions, StagePlan
from wonderland_ds.launch.stage import (
    _task_data,
    from_front,
    load_config,
    plan_stage,
    resolve_run_dir,
)
from wonderland_ds.run import failures, manifest
from wonderland_ds.run.liveness import Heartbeat, PeerWatch
from wonderland_ds.run.manifest import AllocationRecord, StopRecord
from wonderland_ds.training import faults, startup


def run(args: argparse.Namespace, signals: StopSignals | None = None) -> int:
    """The per-rank body of ``train.py`` (distributed is initialised inside). ``signals``: the
    stop signals installed since the rank started (a training stage stops at a step, saved;
    an evaluation or export stops at once)."""
    from wonderland_ds.core import distributed as dist

    # A config refusal is the same on every rank: decide before starting the process group.
    _, _, settings = load_config(args.config, args.stage, None)
    dist.init(settings.process_group_timeout_s)
    startup.freeze_imports()  # torch and DeepSpeed are in: out of the collector's sight
    from deepspeed.accelerator import get_accelerator

    on_cpu = get_accelerator().device_name() == "cpu"
    allocator = fix_threshold(on_cpu, settings.cpu_mmap_threshold)  # before the model
    world = dist.world_size()
    run_dir: Path = dist.broadcast(
        resolve_run_dir(args.run_dir, args.resume) if dist.is_main() else Path()
    )
    # The flags end here: the layers below read typed options.
    opts = StageOptions.from_args(args, run_dir.resolve())
    as_json = bool(args.json)
    decided: StagePlan | None = None
    task: tasks.Task | None = None
    refusal: list[Finding] | None = None
    if dist.is_main():
        try:
            # The front's plan for this launch, else (the plain deepspeed path) decided here.
            got = from_front(getattr(args, "verified", None), opts, world, run_dir)
            decided, task = got or plan_stage(opts, world, run_dir)
        except Refused as exc:
            refusal = exc.findings
    refusal = dist.broadcast(refusal)
    if refusal:
        raise Refused(refusal)
    decided = dist.broadcast(decided)
    assert decided is not None
    opts = decided.options
    if task is None:  # the other ranks: only the data, the preflight is rank 0's
        task = _task_data(opts, decided.settings, run_dir, check_stale=False)[0]
    plan = decided.preflight
    ranks = dist.gather_all(dist.rank_info())
    dist.HOSTS[:] = [r["host"] for r in ranks]
    if dist.is_main():
        render(plan.findings, as_json)
    st = stages.get(opts.stage)
    signals = signals or StopSignals()
    if st.kind != "train":  # nothing to save: a stop is at once
        signals.on_first = _raise_stopped
        if signals.first is not None:
            _raise_stopped(signals.first)
    stage_dir = run_dir / f"stage{opts.stage}"
    fault = faults.parse(opts.fault)
    fault.remember(stage_dir / "faults")  # a one-shot fault acts once per stage, restarts too
    heartbeat = Heartbeat(stage_dir, dist.rank()).start()
    timeout_s = settings.elastic.heartbeat_timeout_s
    if timeout_s > 0 and len(set(dist.HOSTS)) > 1:
        # Across hosts no launcher sees a peer's power loss: the shared folder's heartbeats do.
        heartbeat.watch = PeerWatch(
            heartbeat.path.parent, dist.rank(), world, timeout_s, _leaving(stage_dir, heartbeat)
        )
    inputs = decided.inputs(task, heartbeat, signals)
    alloc = Allocation.from_env()
    first_step = plan.source_info.get("global_step") if plan.source else 0
    if dist.is_main():
        stage_dir.mkdir(parents=True, exist_ok=True)
        (stage_dir / "preflight.json").write_text(json.dumps(plan.to_dict(), indent=2))
        (stage_dir / "ds_config.json").write_text(json.dumps(decided.ds_dict, indent=2))
        (stage_dir / "ranks.json").write_text(json.dumps(ranks, indent=2))
        manifest.update_stage(
            run_dir,
            opts.stage,
            name=st.name,
            status="running",
            started=manifest.now(),
            config=str(Path(opts.config).resolve()),
            world_size=world,
            seed=decided.seed,
            resumed_from=str(plan.source) if plan.source else None,
            # Lineage: the checkpoint this stage's attempt started from, kept across the
            # resumes of its own checkpoints (status compares it with its source's newest).
            **({} if plan.continuing else _lineage(plan.source)),
            overrides=sorted(overrides(opts)),
            finished=None,
            grad_acc=decided.ds_dict["gradient_accumulation_steps"],
            # The training data a training stage reads (an evaluation's preflight says which
            # mix its checkpoint trained on).
            data_mix=task.meta.get("mix") if st.kind == "train" else None,
            data_mix_change=plan.data_mix if st.kind == "train" else None,
            argv=decided.options.argv(),
            allocator=allocator,
            stop=None,
            **_allocation_started(run_dir, opts.stage, alloc, first_step),
        )
    try:
        if st.kind == "train":
            from wonderland_ds.training.stage import train

            result = train(opts, run_dir, inputs, plan, fault)
        elif st.kind == "eval":
            from wonderland_ds.eval.evaluate import run_eval

            startup.release()  # an evaluation has no training loop to do it (train.py)

            result = run_eval(opts, run_dir, inputs, plan)
        else:
            from wonderland_ds.eval.export import run_export

            startup.release()

            result = run_export(opts, run_dir, inputs, plan)
    except BaseException as exc:
        heartbeat.stop("stopped" if isinstance(exc, (Stopped, Refused, GuardStop)) else "failed")
        # A collective timeout names no peer: find out which ranks stopped answering.
        hung = dist.explain_timeout(exc, settings.process_group_timeout_s)
        if hung:
            print(f"[wonderland] {hung}", file=sys.stderr, flush=True)
        if not isinstance(exc, (Stopped, Refused, GuardStop)):
            failures.record(stage_dir, dist.rank(), exc, hung)
        if dist.is_main() and isinstance(exc, Stopped):
            stop = _stop_record(exc)
            refused = exc.request.finding  # bad data: a failure the user fixes, then resumes
            status = "failed" if refused is not None else "preempted"
            if exc.request.reason == "disk-full":
                status = "disk-full"
            manifest.update_stage(
                run_dir,
                opts.stage,
                status=status,
                finished=manifest.now(),
                stop=stop.model_dump(),
                error=refused.line() if refused is not None else _disk(exc),
                exit_code=EXIT_REFUSED if refused is not None else None,
                **_allocation_ended(run_dir, opts.stage, alloc, exc.step, status, stop.detail),
            )
        elif dist.is_main():
            stopped = type(exc).__name__ == "GuardStop"
            status = (
                ("gate-failed" if st.kind == "eval" else "guard-stopped") if stopped else ("failed")
            )
            error = (hung or str(exc))[:500]
            manifest.update_stage(
                run_dir,
                opts.stage,
                status=status,
                finished=manifest.now(),
                error=error,
                failed_hosts=_named_hosts(hung),
                **_allocation_ended(run_dir, opts.stage, alloc, None, status, error),
            )
        raise
    heartbeat.stop()
    if dist.is_main():
        output = result.get("checkpoint") if st.kind == "train" else None
        reached = result.get("global_step") if st.kind == "train" else None
        manifest.update_stage(
            run_dir,
            opts.stage,
            status="ok",
            finished=manifest.now(),
            output_checkpoint=output,
            **result,
            **_allocation_ended(run_dir, opts.stage, alloc, reached, "ok", None),
        )
        log(f"stage {opts.stage} ({st.name}) done: {json.dumps(result, default=str)}")
    return 0


def _leaving(stage_dir: Path, heartbeat: Heartbeat) -> Any:
    """What a rank does when a peer's heartbeat stopped: say so, record it, leave at once (it
    may be blocked in a collective with the lost rank, which no exception would end)."""
    import os

    from wonderland_ds.core import distributed as dist

    def leave(beats: list[dict]) -> None:
        lost = failures.record_lost(stage_dir, dist.rank(), beats)
        names = ", ".join(f"rank {p.rank} on {p.host}" for p in lost)
        print(
            f"[wonderland] rank {dist.rank()} leaving at step {heartbeat.step}: no heartbeat"
            f" from {names} for {max(p.silent_s for p in lost):.0f} s (lost host or frozen"
            " process), so the stage can restart",
            file=sys.stderr,
            flush=True,
        )
        sys.stdout.flush()
        os._exit(EXIT_LOST)

    return leave


def _disk(exc: Stopped) -> str | None:
    return exc.request.describe() if exc.request.reason == "disk-full" else None


def _raise_stopped(stop: StopRequest) -> None:
    raise Stopped(stop)


def _stop_record(exc: Stopped) -> StopRecord:
    req = exc.request
    return StopRecord(
        reason=req.reason,
        signal=req.signal,
        detail=req.describe(),
        step=exc.step,
        checkpoint=exc.checkpoint,
        saved=exc.saved,
        seconds=round(time.time() - req.at, 3),
    )


def _allocation_started(
    run_dir: Path, stage: int, alloc: Allocation | None, first_step: Any
) -> dict[str, Any]:
    """The stage's lineage across Slurm allocations: this one appended (a requeued job's
    run, or the first)."""
    if alloc is None:
        return {}
    got = list(manifest.stage_record(run_dir, stage).allocations)
    try:
        nodes = alloc.hosts()
    except RuntimeError:
        nodes = [alloc.nodelist]
    got.append(
        AllocationRecord(
            job_id=alloc.job_id,
            restart_count=alloc.restart_count,
            nodes=nodes,
            started=manifest.now(),
            first_step=first_step if isinstance(first_step, int) else None,
        )
    )
    return {"allocations": [a.model_dump() for a in got]}


def _allocation_ended(
    run_dir: Path,
    stage: int,
    alloc: Allocation | None,
    last_step: int | None,
    outcome: str,
    why: str | None,
) -> dict[str, Any]:
    if alloc is None:
        return {}
    got = list(manifest.stage_record(run_dir, stage).allocations)
    if not got or got[-1].job_id != alloc.job_id:
        return {}
    this = got[-1]
    done = (
        last_step - this.first_step
        if last_step is not None and this.first_step is not None
        else None
    )
    got[-1] = this.model_copy(
        update={
            "ended": manifest.now(),
            "last_step": last_step,
            "steps_done": done,
            "outcome": outcome,
            "why": why,
        }
    )
    return {"allocations": [a.model_dump() for a in got]}


def _lineage(source: Path | None) -> dict[str, Any]:
    """The checkpoint a stage's attempt starts from, and its identity: the digest of its
    metadata, which a later save to the same path (a rerun reaching the same step) changes."""
    from wonderland_ds.run.liveness import checkpoint_id

    if source is None:
        return {"input_checkpoint": None, "input_checkpoint_id": None}
    return {"input_checkpoint": str(source), "input_checkpoint_id": checkpoint_id(source)}


def _named_hosts(hung: str | None) -> list[str]:
    """The hosts a timeout explanation names as not answering (``--exclude-failed-hosts``)."""
    import re

    if not hung:
        return []
    if "does not answer" in hung:  # rank 0 on HOST holds the store
        found = re.findall(r"rank 0 on (\S+) ", hung)
    else:
        found = re.findall(r"\d+ \(([^)]+)\)", hung)
    return sorted(set(found))
