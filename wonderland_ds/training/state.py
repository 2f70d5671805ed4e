"""What one rank's training stage is and carries: the stage, its progress, its trained steps."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.config.ds_config import DSConfig
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.data.blend import ORDER as BLEND_ORDER
from wonderland_ds.data.blend import Blend
from wonderland_ds.data.sampler import LoaderState
from wonderland_ds.data.tasks import Split, Task, normalization_stats
from wonderland_ds.data.tokens import TokenData
from wonderland_ds.training import faults

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StageRun:
    """Everything one rank needs to run one training stage."""

    stage: int
    run_dir: Path
    task: Task
    ds_dict: dict[str, Any]
    cfg: DSConfig
    settings: WonderlandSettings
    seed: int
    steps: int
    fault: faults.FaultPlan = field(default_factory=faults.FaultPlan)
    heartbeat: Any = None
    """The rank's :class:`~wonderland_ds.run.liveness.Heartbeat`; the loop sets its ``step``."""
    signals: Any = None
    """The rank's :class:`~wonderland_ds.core.signals.StopSignals` (None: none installed)."""

    @property
    def stage_dir(self) -> Path:
        return self.run_dir / f"stage{self.stage}"

    @property
    def ckpt_root(self) -> Path:
        return self.stage_dir / "checkpoints"


@dataclass
class Progress:
    """The state the loop carries and every checkpoint records."""

    samples_consumed: int = 0
    stage_start_step: int = 0
    stream_start: int = 0
    """Samples consumed before the training data's stream began (a stage's own mix)."""
    norm_mean: list[float] = field(default_factory=list)
    norm_std: list[float] = field(default_factory=list)


@dataclass
class TrainedStep:
    """One trained step waiting for the next check: this rank's guard vector and what the log
    and the judge need, as it was right after the step."""

    step: int
    vec: list[float]
    losses: list[torch.Tensor]  # the micro-batch losses, where they were computed
    sq: torch.Tensor | None  # this rank's squared gradient norm (guard hooks), likewise
    lr: float
    grad_norm: Any  # DeepSpeed's global norm: a float, a device tensor or None
    skipped: int
    scale: float | None
    samples: int
    step_s: float
    wait_s: float
    wall: float
    aux: list[torch.Tensor] = field(default_factory=list)  # MoE router losses, likewise


def loss_scale(engine: Any) -> float | None:
    """The current fp16 loss scale: ZeRO's optimizers have ``cur_scale``; DeepSpeed 0.19.8's
    FP16_Optimizer (fp16 without ZeRO) keeps it in ``loss_scale_config``."""
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(opt, "loss_scale_config", None), "cur_scale", None)
    return None if scale is None else float(scale)


def loader_state(run: StageRun, prog: Progress) -> LoaderState:
    train = run.task.train
    assert train is not None
    sources = getattr(train, "sources", None)
    return LoaderState(
        run.seed,
        prog.samples_consumed,
        run.task.fingerprint,
        len(train),
        mix=str(run.task.meta.get("mix", "train")),
        stream_start=prog.stream_start,
        blend=BLEND_ORDER if sources else None,
        sources=source_epochs(run, prog) if sources else None,
    )


def source_epochs(run: StageRun, prog: Progress) -> dict[str, dict[str, float | int]] | None:
    """Each weighted source's samples and epochs in the stream so far (None: one source)."""
    train = run.task.train
    if not isinstance(train, TokenData) or not train.sources:
        return None
    return Blend(train.sources, run.seed).epochs(prog.samples_consumed - prog.stream_start)


def fresh_progress(run: StageRun) -> tuple[Progress, tuple[np.ndarray, np.ndarray] | None]:
    """The pre-normalization pass: statistics over the cached training data, once (tasks
    without input normalization, such as the byte-level LM, skip it)."""
    assert run.task.train is not None
    if not run.task.normalize:
        return Progress(), None
    assert isinstance(run.task.train, Split)
    mean, std = normalization_stats(np.asarray(run.task.train.x))
    return Progress(norm_mean=mean.tolist(), norm_std=std.tolist()), (mean, std)


def dump_json(path: Path, obj: Any) -> None:
    ck.atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))
