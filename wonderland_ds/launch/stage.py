"""Run one stage on this rank: load config, preflight, build, restore, fit or evaluate.

All ranks take the same decisions: rank 0 runs the preflight (and any universal conversion)
and broadcasts the plan; a refusal exits 2 on every rank before anything is written.

The front process (``wonderland train``) runs :func:`plan_stage` too, before launching: this
module imports torch (through ``distributed``) only inside :func:`log` and :func:`run`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from wonderland_ds.checkpoint.contract import (
    atomic_write_text,
    export_hashes,
    import_hashes,
    stat_key,
)
from wonderland_ds.config import stages
from wonderland_ds.config.ds_config import DSConfig, deepspeed_dict, load_json, validate
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.distributed import log
from wonderland_ds.core.findings import Finding, Refused, has_errors, render
from wonderland_ds.data import lm, tasks
from wonderland_ds.launch.flags import overrides
from wonderland_ds.run import manifest, preflight
from wonderland_ds.run.liveness import Heartbeat
from wonderland_ds.training import faults, startup


def load_config(
    path: str, stage: int, world: int | None
) -> tuple[dict[str, Any], DSConfig, WonderlandSettings]:
    raw, found = load_json(path)
    if raw is None:
        raise Refused(found)
    cfg, settings, found = validate(raw, path, world, {stage})
    if has_errors(found) or cfg is None or settings is None:
        raise Refused([f for f in found if f.severity == "error"])
    return raw, cfg, settings


def default_run_dir(resume: str | None) -> Path:
    if resume and resume != "auto":
        p = Path(resume).resolve()
        for parent in [p, *p.parents]:
            if (parent / manifest.NAME).exists():
                return parent
    return Path("runs") / time.strftime("run-%Y%m%d-%H%M%S")


def resolve_run_dir(args: argparse.Namespace) -> Path:
    if args.run_dir:
        return Path(args.run_dir)
    if args.resume == "auto":
        raise Refused(
            "--resume auto needs --run-dir (the run to continue)", "pass --run-dir RUN_DIR"
        )
    return default_run_dir(args.resume)


#: Caches whose contents were checked against the task in this launch (index.json stat keys).
_FRESH_CACHES: set[tuple[str, int, int, int, int]] = set()


def write_receipt(path: Path) -> None:
    """What the front process verified (checkpoint and cache hashes, fresh caches), for rank 0
    of the launch it starts: it skips reading those files again while they are unchanged."""
    from wonderland_ds.data.tokens import export_scans

    body = {
        "hashes": export_hashes(),
        "fresh_caches": [list(k) for k in _FRESH_CACHES],
        "token_scans": export_scans(),
    }
    atomic_write_text(path, json.dumps(body))


def read_receipt(path: str | None) -> None:
    if not path:
        return
    try:
        body = json.loads(Path(path).read_text())
        import_hashes(body["hashes"])
        _FRESH_CACHES.update(tuple(k) for k in body["fresh_caches"])  # type: ignore[misc]
        from wonderland_ds.data.tokens import import_scans

        import_scans(body.get("token_scans") or {})
    except (OSError, ValueError, KeyError, TypeError):
        return  # no receipt: verify everything again


def _task_data(
    args: argparse.Namespace, settings: WonderlandSettings, run_dir: Path, check_stale: bool
) -> tuple[tasks.Task, Path]:
    """The task with its data: from its cache when one exists (verified), else raw in memory
    (the caller writes the cache once the preflight passed)."""
    from wonderland_ds.data import cache

    spec = getattr(args, "task", None) or settings.task
    task = lm.load_task(spec, settings)
    if task.train is not None and not isinstance(task.train, tasks.Split):
        return _materialize(task), run_dir / "cache" / task.name  # token files, in place
    if settings.cache:
        return cache.open_task(task, Path(settings.cache)), Path(settings.cache)
    cache_dir = run_dir / "cache" / task.name
    if cache.read_index(cache_dir) is not None:
        opened = cache.open_task(task, cache_dir)
        key = stat_key(cache_dir / cache.INDEX)
        if check_stale and key in _FRESH_CACHES:
            return opened, cache_dir  # checked by this launch's front process, unchanged since
        # A built-in task proves its source unchanged from file sizes and times (tasks.py);
        # anything else, or any difference, rebuilds the data and compares fingerprints.
        same_source = (
            check_stale
            and task.source_key is not None
            and opened.source_key_value is not None
            and task.source_key() == opened.source_key_value
        )
        if check_stale and not same_source and _materialize(task).fingerprint != opened.fingerprint:
            raise Refused(
                Finding(
                    "cache-stale",
                    "error",
                    f"the run's cache {cache_dir} holds other data than task {spec!r} now produces",
                    "use a new --run-dir, or point wonderland.cache at the cache you mean",
                    str(cache_dir),
                )
            )
        if check_stale:
            _FRESH_CACHES.add(key)
        return opened, cache_dir
    return _materialize(task), cache_dir


def _materialize(task: tasks.Task) -> tasks.Task:
    # The task's own code, on a rank whose collector is held through the start (startup.py):
    # whatever cyclic garbage it makes is collected as Python normally would.
    with startup.collecting():
        return task.materialize()


def plan_stage(args: argparse.Namespace, world: int, run_dir: Path) -> dict[str, Any]:
    """Everything decided before launching or training; raises Refused with all findings."""
    raw, cfg, settings = load_config(args.config, args.stage, world)
    if args.min_warmup_steps is not None:
        settings = settings.model_copy(update={"min_warmup_steps": args.min_warmup_steps})
    seed = settings.seed if args.seed is None else args.seed
    try:
        ds_dict = deepspeed_dict(raw, args.grad_acc_steps, world)
    except ValueError as exc:
        raise Refused(
            Finding(
                "batch-triangle",
                "error",
                str(exc),
                "fix the batch sizes or --grad-acc-steps",
                args.config,
            )
        ) from None
    task, cache_dir = _task_data(args, settings, run_dir, check_stale=True)
    st = stages.get(args.stage)
    plan = preflight.check(
        args.stage,
        args.resume,
        run_dir,
        min_warmup=settings.min_warmup_steps,
        seed=seed,
        fingerprint=task.fingerprint,
        task=task.name,
        config=str(args.config),
        world_size=world,
        zero_stage=cfg.zero_optimization.stage,
        precision=cfg.precision,
        overrides=overrides(args),
        own_folder=not getattr(args, "rerun_pending", False),
    )
    required = st.preflight or args.optimizer_state or args.scheduler_state
    if not required:
        # Outside stage 16 a missing optimizer/scheduler is only refused when asked for.
        plan.findings = [
            f
            if f.rule not in ("ckpt-optimizer-state", "ckpt-scheduler-state")
            else Finding(f.rule, "warn", f.message, f.fix, f.file, f.path)
            for f in plan.findings
        ]
    if has_errors(plan.findings):
        raise Refused([f for f in plan.findings if f.severity == "error"])
    if (
        isinstance(task.train, tasks.Split)
        and not isinstance(task.train.x, np.memmap)
        and not getattr(args, "dry_run", False)
    ):
        # Preflight passed: now (and only now) write the cache; training reads nothing else.
        # A dry run writes nothing.
        from wonderland_ds.data import cache

        cache.write(task, cache_dir)
        task = cache.open_task(task, cache_dir)
        _FRESH_CACHES.add(stat_key(cache_dir / cache.INDEX))  # written from the task just now
    return {
        "raw": raw,
        "cfg": cfg,
        "settings": settings,
        "seed": seed,
        "ds_dict": ds_dict,
        "task": task,
        "plan": plan,
    }


def run(args: argparse.Namespace) -> int:
    """The per-rank body of ``train.py`` (distributed is initialised inside)."""
    from wonderland_ds.core import distributed as dist

    # A config refusal is the same on every rank: decide before starting the process group.
    _, _, settings = load_config(args.config, args.stage, None)
    dist.init(settings.process_group_timeout_s)
    startup.freeze_imports()  # torch and DeepSpeed are in: out of the collector's sight
    world = dist.world_size()
    run_dir: Path = dist.broadcast(resolve_run_dir(args) if dist.is_main() else Path())
    decided: dict[str, Any] | None = None
    refusal: list[Finding] | None = None
    if dist.is_main():
        read_receipt(getattr(args, "verified", None))
        try:
            decided = plan_stage(args, world, run_dir)
        except Refused as exc:
            refusal = exc.findings
    refusal = dist.broadcast(refusal)
    if refusal:
        raise Refused(refusal)
    if not dist.is_main():
        decided = plan_stage_quiet(args, world, run_dir)
    assert decided is not None
    plan = dist.broadcast(decided["plan"])
    ranks = dist.gather_all(dist.rank_info())
    dist.HOSTS[:] = [r["host"] for r in ranks]
    if dist.is_main():
        render(plan.findings, args.json)
    st = stages.get(args.stage)
    stage_dir = run_dir / f"stage{args.stage}"
    fault = faults.parse(args.fault)
    fault.remember(stage_dir / "faults")  # a one-shot fault acts once per stage, restarts too
    heartbeat = Heartbeat(stage_dir, dist.rank()).start()
    decided["heartbeat"] = heartbeat
    if dist.is_main():
        stage_dir.mkdir(parents=True, exist_ok=True)
        (stage_dir / "preflight.json").write_text(json.dumps(plan.to_dict(), indent=2))
        (stage_dir / "ds_config.json").write_text(json.dumps(decided["ds_dict"], indent=2))
        (stage_dir / "ranks.json").write_text(json.dumps(ranks, indent=2))
        manifest.update_stage(
            run_dir,
            args.stage,
            name=st.name,
            status="running",
            started=manifest.now(),
            config=str(Path(args.config).resolve()),
            world_size=world,
            seed=decided["seed"],
            resumed_from=str(plan.source) if plan.source else None,
            # Lineage: the checkpoint this stage's attempt started from, kept across the
            # resumes of its own checkpoints (status compares it with its source's newest).
            **({} if plan.continuing else _lineage(plan.source)),
            overrides=sorted(overrides(args)),
            finished=None,
            grad_acc=decided["ds_dict"]["gradient_accumulation_steps"],
            argv=sys.argv[1:],
        )
    try:
        if st.kind == "train":
            from wonderland_ds.training.stage import train

            result = train(args, run_dir, decided, plan, fault)
        elif st.kind == "eval":
            from wonderland_ds.eval.evaluate import run_eval

            startup.release()  # an evaluation has no training loop to do it (train.py)

            result = run_eval(args, run_dir, decided, plan)
        else:
            from wonderland_ds.eval.export import run_export

            startup.release()

            result = run_export(args, run_dir, decided, plan)
    except BaseException as exc:
        heartbeat.stop()
        # A collective timeout names no peer: find out which ranks stopped answering.
        hung = dist.explain_timeout(exc, settings.process_group_timeout_s)
        if hung:
            print(f"[wonderland] {hung}", file=sys.stderr, flush=True)
        if dist.is_main():
            stopped = type(exc).__name__ == "GuardStop"
            status = (
                ("gate-failed" if st.kind == "eval" else "guard-stopped") if stopped else ("failed")
            )
            manifest.update_stage(
                run_dir,
                args.stage,
                status=status,
                finished=manifest.now(),
                error=(hung or str(exc))[:500],
                failed_hosts=_named_hosts(hung),
            )
        raise
    heartbeat.stop()
    if dist.is_main():
        output = result.get("checkpoint") if st.kind == "train" else None
        manifest.update_stage(
            run_dir,
            args.stage,
            status="ok",
            finished=manifest.now(),
            output_checkpoint=output,
            **result,
        )
        log(f"stage {args.stage} ({st.name}) done: {json.dumps(result, default=str)}")
    return 0


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


def plan_stage_quiet(args: argparse.Namespace, world: int, run_dir: Path) -> dict[str, Any]:
    """Non-zero ranks need the config and task, not the (already broadcast) preflight."""
    raw, cfg, settings = load_config(args.config, args.stage, world)
    seed = settings.seed if args.seed is None else args.seed
    return {
        "raw": raw,
        "cfg": cfg,
        "settings": settings,
        "seed": seed,
        "ds_dict": deepspeed_dict(raw, args.grad_acc_steps, world),
        "task": _task_data(args, settings, run_dir, check_stale=False)[0],
        "plan": None,
    }
