"""What a stage will be, decided before any rank trains: its config, its data and the
preflight's verdict on the checkpoint it starts from (a ``plan.StagePlan``).

The front process (``wonderland train``) decides it and hands it, with a receipt of what it
verified, to rank 0 (:func:`from_front`); the plain ``deepspeed ... train.py`` path has no
front, so rank 0 decides it there (:func:`plan_stage`). This module never imports torch.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint import zero_layout
from wonderland_ds.checkpoint.contract import export_hashes, import_hashes, stat_key
from wonderland_ds.config import auto, stages
from wonderland_ds.config.ds_config import DSConfig, deepspeed_dict, load_json, validate
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.findings import Finding, Refused, has_errors
from wonderland_ds.data import lm, tasks
from wonderland_ds.launch import plan as plan_mod
from wonderland_ds.launch.flags import overrides
from wonderland_ds.launch.plan import Receipt, StageOptions, StagePlan
from wonderland_ds.run import manifest, preflight
from wonderland_ds.training import startup


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


def resolve_run_dir(run_dir: str | None, resume: str | None) -> Path:
    """``--run-dir``, else the run a ``--resume`` path lies in, else a new one."""
    if run_dir:
        return Path(run_dir)
    if resume == "auto":
        raise Refused(
            "--resume auto needs --run-dir (the run to continue)", "pass --run-dir RUN_DIR"
        )
    return default_run_dir(resume)


#: Caches whose contents were checked against the task in this launch (index.json stat keys).
_FRESH_CACHES: set[tuple[str, int, int, int, int]] = set()


def receipt() -> Receipt:
    """What this process verified (checkpoint and cache hashes, fresh caches, token scans)."""
    from wonderland_ds.data.scans import export_scans

    return Receipt(
        hashes=export_hashes(),
        fresh_caches=[list(k) for k in _FRESH_CACHES],
        token_scans=export_scans(),
    )


def take_receipt(got: Receipt) -> None:
    """Files verified elsewhere are not read again here while their size, times and inode
    are unchanged."""
    from wonderland_ds.data.scans import import_scans

    try:
        import_hashes(got.hashes)
        _FRESH_CACHES.update(tuple(k) for k in got.fresh_caches)  # type: ignore[misc]
        import_scans(got.token_scans)
    except (ValueError, TypeError):
        return  # a damaged receipt: verify everything again


def _task_data(
    opts: StageOptions, settings: WonderlandSettings, run_dir: Path, check_stale: bool
) -> tuple[tasks.Task, Path]:
    """The task with its data: from its cache when one exists (verified), else raw in memory
    (the caller writes the cache once the preflight passed)."""
    from wonderland_ds.data import cache

    spec = opts.task or settings.task
    task = lm.load_task(spec, settings, opts.stage)
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


def _mix_args(task: tasks.Task, settings: WonderlandSettings) -> dict[str, Any]:
    """The preflight's view of the config's training mixes (causal-lm only)."""
    data = settings.data
    if data is None or "mix" not in task.meta:
        return {}
    sources = getattr(task.train, "sources", [])
    label = ", ".join(f"{s.name} {s.weight:.3g}" for s in sources) or "one source"
    return {
        "mix": task.meta["mix"],
        "mix_fingerprint": lambda name: lm.mix_fingerprint(data, name),
        "mix_label": label,
    }


def plan_stage(
    opts: StageOptions,
    world: int,
    run_dir: Path,
    rerun_pending: bool = False,
    dry_run: bool = False,
) -> tuple[StagePlan, tasks.Task]:
    """Everything decided before launching or training, and the task with its data; raises
    Refused with all findings. ``rerun_pending``: the preflight looks past the attempt a
    ``--rerun`` moves aside; ``dry_run``: writes nothing."""
    raw, cfg, settings = load_config(opts.config, opts.stage, world)
    if opts.min_warmup_steps is not None:
        settings = settings.model_copy(update={"min_warmup_steps": opts.min_warmup_steps})
    seed = settings.seed if opts.seed is None else opts.seed
    try:
        ds_dict = deepspeed_dict(raw, opts.grad_acc_steps, world)
    except ValueError as exc:
        raise Refused(
            Finding(
                "batch-triangle",
                "error",
                str(exc),
                "fix the batch sizes or --grad-acc-steps",
                opts.config,
            )
        ) from None
    task, cache_dir = _task_data(opts, settings, run_dir, check_stale=True)
    st = stages.get(opts.stage)
    plan = preflight.check(
        opts.stage,
        opts.resume,
        run_dir,
        min_warmup=settings.min_warmup_steps,
        seed=seed,
        fingerprint=task.fingerprint,
        task=task.name,
        config=str(opts.config),
        world_size=world,
        zero_stage=cfg.zero_optimization.stage,
        precision=cfg.precision,
        overrides=overrides(opts),
        own_folder=not rerun_pending,
        reshard_blocker=zero_layout.target_blocker(ds_dict),
        **_mix_args(task, settings),
    )
    filled = auto.fill(raw, opts.config, world)[1]  # shown with the preflight, recorded there
    plan.findings[:0] = auto.findings(filled, opts.config)
    required = st.preflight or opts.optimizer_state or opts.scheduler_state
    if not required:
        # Outside stage 16 a missing optimizer/scheduler is only refused when asked for.
        plan.findings = [
            f
            if f.rule not in ("ckpt-optimizer-state", "ckpt-scheduler-state")
            else Finding(f.rule, "warn", f.message, f.fix, f.file, f.path)
            for f in plan.findings
        ]
    if st.kind == "eval" and settings.eval.tasks:
        from wonderland_ds.eval.task_check import settings_findings

        plan.findings += settings_findings(settings, world, str(opts.config))
    if has_errors(plan.findings):
        raise Refused([f for f in plan.findings if f.severity == "error"])
    if (
        isinstance(task.train, tasks.Split)
        and not isinstance(task.train.x, np.memmap)
        and not dry_run
    ):
        # Preflight passed: now (and only now) write the cache; training reads nothing else.
        # A dry run writes nothing.
        from wonderland_ds.data import cache

        cache.write(task, cache_dir)
        task = cache.open_task(task, cache_dir)
        _FRESH_CACHES.add(stat_key(cache_dir / cache.INDEX))  # written from the task just now
    decided = StagePlan(
        options=opts,
        world_size=world,
        raw=raw,
        cfg=cfg,
        settings=settings,
        seed=seed,
        ds_dict=ds_dict,
        preflight=plan,
    )
    return decided, task


def from_front(
    path: str | None, opts: StageOptions, world: int, run_dir: Path
) -> tuple[StagePlan, tasks.Task] | None:
    """Rank 0: the plan the front process decided for this launch, when it wrote one for these
    options and this world (else None: decide here). Still checked on this rank: the checkpoint
    it starts from is complete and unchanged, and the task's data."""
    got = plan_mod.read(path)
    if got is None:
        return None
    take_receipt(got.receipt)
    if got.options != opts or got.world_size != world:
        return None
    source = got.preflight.source
    if source is not None:
        verdict = ck.verify(source)  # hashes from the receipt: unchanged files are not read
        if not verdict.complete:
            raise Refused(verdict.findings)
    task, _ = _task_data(opts, got.settings, run_dir, check_stale=True)
    return got, task
