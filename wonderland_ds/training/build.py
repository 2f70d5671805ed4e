"""The stage's DeepSpeed engine: build it, and repair what DeepSpeed's checkpoint load leaves
wrong (the optimizer's LR, a universal load's frozen parameters and buffers)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wonderland_ds.checkpoint.describe import safe_load
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data.tasks import Normalize
from wonderland_ds.model import construct
from wonderland_ds.training.state import StageRun


def build(run: StageRun, norm: tuple[np.ndarray, np.ndarray] | None) -> Any:
    """The task's model (its ``.norm`` set to ``norm``) under ``deepspeed.initialize``."""
    import deepspeed

    torch.manual_seed(run.seed)
    model = construct.build(run.task, run.ds_dict)  # partitioned at construction under ZeRO-3
    if norm is not None:
        normalize = getattr(model, "norm", None)
        if not isinstance(normalize, Normalize):
            raise Refused(
                f"task {run.task.name!r}: its model has no .norm Normalize module",
                "make the model's first module wonderland_ds.data.tasks.Normalize as .norm",
            )
        normalize.set_stats(*norm)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=run.ds_dict)
    return engine


def sync_lr(engine: Any) -> list[Finding]:
    """DeepSpeed's scheduler load sets last_batch_iteration but not the optimizer's lr: make the optimizer run at the scheduler's LR for the restored iteration."""
    sched = engine.lr_scheduler
    if sched is None:
        return []
    want = sched.get_lr()
    groups = engine.optimizer.param_groups
    have = [g["lr"] for g in groups]
    if all(math.isclose(h, w, rel_tol=1e-9, abs_tol=1e-15) for h, w in zip(have, want)):
        return [Finding("lr-sync", "ok", f"optimizer lr {have[0]:.3g} matches the scheduler")]
    for g, w in zip(groups, want):
        g["lr"] = w
    return [
        Finding(
            "lr-sync",
            "warn",
            f"DeepSpeed left the optimizer lr at {have[0]:.3g}; set it to the scheduler's"
            f" {want[0]:.3g} at iteration {sched.last_batch_iteration}",
        )
    ]


def restore_module_extras(engine: Any, source: Path) -> list[Finding]:
    """Under a universal load DeepSpeed restores trained weights only: frozen parameters and
    buffers keep their fresh values. Copy them from the source checkpoint's module
    states (``mp_rank_00_model_states.pt``, or rank 0's file under ZeRO-3)."""
    files = sorted(source.glob("mp_rank_00_model_states.pt")) or sorted(
        source.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    states, why = safe_load(files[0]) if files else (None, "no model states file")
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        return [
            Finding(
                "restore-extras",
                "error",
                f"cannot read module states: {why}",
                "resume from a complete checkpoint",
                str(source),
            )
        ]
    saved = states["module"]
    module = engine.module
    names = [n for n, p in module.named_parameters() if not p.requires_grad]
    names += [n for n, _ in module.named_buffers()]
    restored, skipped = 0, []
    with torch.no_grad():
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        for n in names:
            if n in saved and saved[n].numel() == own[n].numel() and saved[n].numel() > 0:
                own[n].copy_(saved[n].to(own[n].dtype).view_as(own[n]))
                restored += 1
            else:
                skipped.append(n)
    out = [
        Finding(
            "restore-extras",
            "ok",
            f"restored {restored} frozen parameter(s)/buffer(s) DeepSpeed's universal load skips",
        )
    ]
    if skipped:
        # ZeRO-3 partitions frozen parameters too (frozen_param_fragments, one slice per rank):
        # they keep the model's initial values. Say so rather than pretend.
        out.append(
            Finding(
                "restore-extras",
                "warn",
                f"not restored (partitioned under ZeRO-3 or absent): {skipped[:5]}",
                "make frozen parameters deterministic at init, or use ZeRO-1/2",
                str(source),
            )
        )
    return out
