"""The ``"wonderland"`` section of a config: settings DeepSpeed has no key for.

A wonderland config is a DeepSpeed JSON config with one extra top-level object,
``"wonderland"``. It is validated here (unknown keys refused) and stripped before the rest is
handed to ``deepspeed.initialize``. Every field is documented in the README.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class EvalGate(_Strict):
    """Stage 17's gate: how much per-class recall may drop against stage 15's checkpoint."""

    recall_drop_margin: float = Field(0.10, ge=0.0, le=1.0)
    """A class whose recall fell by more than this (absolute) since stage 15 fails the gate."""
    minority_recall_floor: float = Field(0.50, ge=0.0, le=1.0)
    """A minority class whose recall is below this fails the gate."""


class WonderlandSettings(_Strict):
    """Run settings of a stage; every field has a default."""

    task: str = "digits"
    """Built-in task name (``digits``) or ``module:function`` returning a Task."""
    cache: str | None = None
    """Dataset cache made by ``wonderland cache`` (default: RUN_DIR/cache/TASK, built once)."""
    seed: int = Field(1234, ge=0)
    """Data-order and initialisation seed; stage 16 must use stage 15's (preflight)."""
    train_steps: int = Field(100, ge=1)
    """Optimizer steps a training stage runs (default for every stage)."""
    stage_train_steps: dict[str, int] = Field(default_factory=dict)
    """Per-stage override of ``train_steps``, keyed by stage number as a string: ``{"15": 600}``."""
    save_interval: int = Field(100, ge=1)
    """Save a checkpoint every this many optimizer steps (and always at the end of a stage)."""
    keep_last: int = Field(3, ge=1)
    """Keep this many complete checkpoints per stage; the newest complete one is never deleted."""
    min_warmup_steps: int = Field(500, ge=0)
    """Stage 16 refuses a checkpoint with fewer LR-warmup steps behind it (field notes: 500)."""
    process_group_timeout_s: int = Field(600, ge=10)
    """Process-group timeout passed to ``deepspeed.init_distributed`` (field notes: 600 s)."""
    log_interval: int = Field(50, ge=1)
    """Print a progress line every this many steps on rank 0."""
    eval: EvalGate = Field(default_factory=EvalGate)

    @model_validator(mode="after")
    def _stage_keys(self) -> WonderlandSettings:
        for key, steps in self.stage_train_steps.items():
            if not key.isdigit() or not 1 <= int(key) <= 18:
                raise ValueError(f"stage_train_steps key {key!r} is not a stage number 1..18")
            if steps < 1:
                raise ValueError(f"stage_train_steps[{key!r}] must be >= 1, got {steps}")
        return self

    def steps_for(self, stage: int) -> int:
        return self.stage_train_steps.get(str(stage), self.train_steps)
