"""A training stage on this rank: build the engine, restore the plan's checkpoint, fit."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wonderland_ds.core import distributed as dist
from wonderland_ds.core.distributed import log
from wonderland_ds.core.findings import Finding, Refused, has_errors, render
from wonderland_ds.run.inputs import StageInputs
from wonderland_ds.run.manifest import ResumeRecord
from wonderland_ds.run.preflight import Plan
from wonderland_ds.training import faults
from wonderland_ds.training.build import build, restore_module_extras, sync_lr
from wonderland_ds.training.state import Progress, StageRun, fresh_progress
from wonderland_ds.training.trainer import fit

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions


def _verify(run: StageRun) -> bool:
    """All-reduce verification at stage start: configured, else on for stage 16."""
    from wonderland_ds.config import stages

    g = run.settings.guards
    return (
        stages.get(run.stage).verify_allreduce if g.allreduce_check is None else g.allreduce_check
    )


def _universal_source(plan: Plan, run_dir: Path, stage: int) -> Path:
    """Rank 0 converts (or reuses a conversion); every rank gets the path or the refusal."""
    from wonderland_ds.checkpoint.universal import convert

    result: tuple[str | None, list[Finding]] = (None, [])
    if dist.is_main():
        assert plan.source is not None
        try:
            path, found = convert(plan.source, run_dir / f"stage{stage}" / "universal")
            result = (str(path), found)
        except Refused as exc:
            result = (None, exc.findings)
    path_s, found = dist.broadcast(result)
    if path_s is None:
        raise Refused(found)
    if dist.is_main():
        render(found, False)
    return Path(path_s)


def _restore(
    run: StageRun, plan: Plan, norm: Any, fault: faults.FaultPlan
) -> tuple[Any, list[Finding], ResumeRecord]:
    """Build the engine and load the plan's checkpoint: as saved, resharded at load time, or
    through a universal checkpoint. After any load that changed the layout, the loaded fp32
    weights and moments are checked against the source's norms. (engine, findings, how)."""
    from wonderland_ds.checkpoint import reshard

    assert plan.source is not None
    load_dir, tag = plan.source.parent, plan.source.name
    how = ResumeRecord(load="universal" if plan.universal else "as saved")
    if plan.reshard:
        assert plan.layout is not None
        engine = build(run, norm)
        why = reshard.unsupported(engine, plan.layout)
        if why is None:
            report = reshard.load(engine, plan.source, plan.layout)
            found = sync_lr(engine) + _checked(engine, plan, fault)
            reads = dist.gather_all((report.bytes_read, report.io_read_bytes, report.seconds))
            how = ResumeRecord(
                load="resharded",
                from_world_size=plan.layout.world_size,
                bytes_read=[b for b, _, _ in reads],
                io_read_bytes=[io for _, io, _ in reads],
                seconds=round(max(s for _, _, s in reads), 3),
            )
            log(
                f"resharded {plan.source.name} from {plan.layout.world_size} to"
                f" {dist.world_size()} ranks in {how.seconds:.2f} s: each rank read"
                f" {max(how.bytes_read) / 1e6:.1f} MB or less of the saved partitions"
            )
            return engine, found, how
        log(f"cannot reshard into this engine ({why}): loading through a universal checkpoint")
        how = ResumeRecord(load="universal", because=why)
        del engine
    if how.load == "universal":
        uni = _universal_source(plan, run.run_dir, run.stage)
        run.ds_dict = {
            **run.ds_dict,
            "checkpoint": {**run.ds_dict.get("checkpoint", {}), "load_universal": True},
        }
        load_dir, tag = uni.parent, uni.name
    engine = build(run, norm)
    path, _client = engine.load_checkpoint(
        str(load_dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    if path is None:  # DeepSpeed only warns and starts fresh: never allow that silently
        raise Refused(
            Finding(
                "ckpt-load",
                "error",
                f"DeepSpeed returned no checkpoint for {load_dir}/{tag}",
                "check the folder with `wonderland inspect`",
                str(plan.source),
            )
        )
    found = sync_lr(engine)
    if how.load == "universal":
        found += restore_module_extras(engine, plan.source)
        found += _checked(engine, plan, fault)
    return engine, found, how


def _checked(engine: Any, plan: Plan, fault: faults.FaultPlan) -> list[Finding]:
    """The check of the loaded optimizer state against the source's norms."""
    from wonderland_ds.checkpoint import load_check

    faults.skew_loaded(fault, engine.optimizer.optimizer, int(engine.global_steps), dist.rank())
    if plan.layout is None:
        return [
            Finding(
                "reshard-check",
                "warn",
                "the loaded optimizer state was not checked: the checkpoint's layout is not one"
                " the reader knows, so there are no reference norms",
            )
        ]
    return load_check.check(engine, plan.layout)


def train(
    opts: StageOptions,
    run_dir: Path,
    inputs: StageInputs,
    plan: Plan,
    fault: faults.FaultPlan,
) -> dict[str, Any]:
    settings = inputs.settings
    run = StageRun(
        stage=opts.stage,
        run_dir=run_dir,
        task=inputs.task,
        ds_dict=inputs.ds_dict,
        cfg=inputs.cfg,
        settings=settings,
        seed=inputs.seed,
        steps=opts.steps or settings.steps_for(opts.stage),
        fault=fault,
        heartbeat=inputs.heartbeat,
        signals=inputs.signals,
    )
    if plan.source is None:
        prog, norm = fresh_progress(run)
        what = "pre-normalization statistics over" if norm is not None else "no normalization,"
        log(f"stage {opts.stage}: fresh start; {what} {len(run.task.train or ())} training samples")
        engine = build(run, norm)
        return fit(run, engine, prog, log, _verify(run))

    info = plan.source_info
    stats = info.get("norm_stats") or {}
    norm = None
    if run.task.normalize:
        if not stats.get("mean"):
            raise Refused(
                Finding(
                    "norm-stats",
                    "error",
                    "the checkpoint carries no normalization statistics",
                    "resume a checkpoint written by a wonderland stage",
                    str(plan.source),
                )
            )
        norm = (np.asarray(stats["mean"], np.float32), np.asarray(stats["std"], np.float32))
    engine, found, how = _restore(run, plan, norm, fault)
    if norm is not None:
        norm_ok = torch.allclose(engine.module.norm.mean.float(), torch.from_numpy(norm[0]))
        found.append(
            Finding(
                "norm-stats",
                "ok" if norm_ok else "error",
                "normalization statistics match stage 15's pre-normalization pass"
                if norm_ok
                else "normalization statistics differ from the checkpoint's",
            )
        )
    if dist.is_main():
        render(found, False)
    if has_errors(found):
        raise Refused([f for f in found if f.severity == "error"])
    data = info["data"]
    step = int(engine.global_steps)
    if step != info.get("global_step"):
        raise Refused(
            f"loaded global step {step}, checkpoint says {info.get('global_step')}",
            "the checkpoint and its metadata disagree: inspect it",
        )
    consumed = int(data["samples_consumed"])
    mix = str(run.task.meta.get("mix", "train"))
    # A stage's own mix is a new stream, from its first sample; the same mix continues.
    new_mix = data.get("mix", "train") != mix
    prog = Progress(
        samples_consumed=consumed,
        stage_start_step=int(info.get("stage_start_step", 0)) if plan.continuing else step,
        stream_start=consumed if new_mix else int(data.get("stream_start") or 0),
        norm_mean=list(stats.get("mean") or []),
        norm_std=list(stats.get("std") or []),
    )
    if new_mix:
        log(
            f"stage {opts.stage}: training data {mix} (the checkpoint's was"
            f" {data.get('mix', 'train')}): its stream starts at its first sample"
        )
    log(
        f"stage {opts.stage}: resumed {plan.source} at step {step}, lr {engine.get_lr()[0]:.4g},"
        f" sample {prog.samples_consumed}"
        + {"universal": " (universal)", "resharded": " (resharded)"}.get(how.load, "")
    )
    if plan.continuing and opts.steps is None:
        # An interrupted stage ends where it was going to end (a `--steps N` given to the first
        # launch is not needed again): the end step the stage recorded in run.json.
        from wonderland_ds.run import manifest

        recorded = None
        if dist.is_main():
            recorded = manifest.stage_record(run_dir, opts.stage).end_step
        recorded = dist.broadcast(recorded)
        if isinstance(recorded, int) and recorded > prog.stage_start_step:
            run.steps = recorded - prog.stage_start_step
            log(f"stage {opts.stage}: continuing to step {recorded} (recorded in run.json)")
    return fit(run, engine, prog, log, _verify(run)) | {"resume": how.model_dump()}
