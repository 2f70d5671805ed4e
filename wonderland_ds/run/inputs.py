"""What a stage's training, evaluation or export is handed once its plan is decided."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from wonderland_ds.config.ds_config import DSConfig
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.data.tasks import Task
from wonderland_ds.run.preflight import Plan


@dataclass(frozen=True)
class StageInputs:
    task: Task
    cfg: DSConfig
    settings: WonderlandSettings
    seed: int
    ds_dict: dict[str, Any]
    raw: dict[str, Any]
    preflight: Plan
    heartbeat: Any = None  # run.liveness.Heartbeat on a launched rank; None in tests
    signals: Any = None  # core.signals.StopSignals on a launched rank; None in tests
