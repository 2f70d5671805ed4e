"""What a stage was decided to be, before any rank trains: the stage's options, its config,
seed and preflight verdict, as one typed object.

The front process (``wonderland train``) decides it once and writes it, with a receipt of the
files it verified, to ``RUN/.verified-stageN.json``; rank 0 of the launch reads it back through
the same model instead of deciding again (``stage.py``).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from wonderland_ds.config.ds_config import DSConfig
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.files import atomic_write_text
from wonderland_ds.data.tasks import Task
from wonderland_ds.run.inputs import StageInputs
from wonderland_ds.run.preflight import Plan

#: The receipt's layout; a file of another format is not read (rank 0 then decides itself).
FORMAT = 1

#: Stage flags that name files: made absolute, so every rank reads the same ones.
_PATH_FLAGS = ("config", "run_dir", "baseline", "out")
#: The flags with a value, then the switches, in the order the ranks' command line gives them.
_VALUE_FLAGS = (
    "resume",
    "grad_acc_steps",
    "steps",
    "seed",
    "min_warmup_steps",
    "task",
    "baseline",
    "out",
    "fault",
)
_SWITCHES = (
    "optimizer_state",
    "scheduler_state",
    "allow_seed_change",
    "allow_data_change",
    "trust_checkpoint",
)


class StageOptions(BaseModel):
    """The flags of one stage (``flags.add_stage_flags``) as its launch runs it."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    stage: int
    config: str
    run_dir: str
    resume: str | None = None
    grad_acc_steps: int | None = None
    steps: int | None = None
    seed: int | None = None
    min_warmup_steps: int | None = None
    task: str | None = None
    baseline: str | None = None
    out: str | None = None
    fault: str | None = None
    optimizer_state: bool = False
    scheduler_state: bool = False
    allow_seed_change: bool = False
    allow_data_change: bool = False
    trust_checkpoint: bool = False

    @classmethod
    def from_args(cls, args: argparse.Namespace, run_dir: Path) -> StageOptions:
        values: dict[str, Any] = {k: getattr(args, k, None) for k in _VALUE_FLAGS}
        values |= {k: bool(getattr(args, k, False)) for k in _SWITCHES}
        values |= {"stage": args.stage, "config": args.config, "run_dir": str(run_dir)}
        for key in _PATH_FLAGS:
            if values[key] is not None:
                values[key] = str(Path(values[key]).resolve())
        if values["resume"] not in (None, "auto"):
            values["resume"] = str(Path(values["resume"]).resolve())
        return cls(**values)

    def argv(self) -> list[str]:
        """The stage flags that give these options (the ranks' command line, and run.json's)."""
        out = ["--stage", str(self.stage), "--config", self.config, "--run-dir", self.run_dir]
        for key in _VALUE_FLAGS:
            value = getattr(self, key)
            if value is not None:
                out += [f"--{key.replace('_', '-')}", str(value)]
        return out + [f"--{key.replace('_', '-')}" for key in _SWITCHES if getattr(self, key)]


class Receipt(BaseModel):
    """What the front verified (file hashes, fresh dataset caches, token-file scans), keyed by
    each file's size, times and inode: rank 0 does not read those files again while unchanged."""

    hashes: list[list[Any]] = Field(default_factory=list)
    fresh_caches: list[list[Any]] = Field(default_factory=list)
    token_scans: dict[str, list[Any]] = Field(default_factory=dict)


class StagePlan(BaseModel):
    """Everything decided before launching or training a stage."""

    format: int = FORMAT
    options: StageOptions
    world_size: int
    raw: dict[str, Any]
    """The DeepSpeed JSON config as read (with its ``wonderland`` section)."""
    cfg: DSConfig
    settings: WonderlandSettings
    """The config's ``wonderland`` section, with ``--min-warmup-steps`` applied."""
    seed: int
    ds_dict: dict[str, Any]
    """The config handed to ``deepspeed.initialize`` (batch sizes resolved for the world)."""
    preflight: Plan
    """The checkpoint to start from and the preflight's findings."""
    receipt: Receipt = Field(default_factory=Receipt)

    @property
    def run_dir(self) -> Path:
        return Path(self.options.run_dir)

    def inputs(self, task: Task, heartbeat: Any = None, signals: Any = None) -> StageInputs:
        """What the training, evaluation and export code is handed."""
        return StageInputs(
            signals=signals,
            task=task,
            cfg=self.cfg,
            settings=self.settings,
            seed=self.seed,
            ds_dict=self.ds_dict,
            raw=self.raw,
            preflight=self.preflight,
            heartbeat=heartbeat,
        )


def write(path: Path, plan: StagePlan, receipt: Receipt) -> None:
    atomic_write_text(path, plan.model_copy(update={"receipt": receipt}).model_dump_json())


def read(path: str | None) -> StagePlan | None:
    """The plan at ``path``; None when there is none, it is unreadable, or of another format."""
    if not path:
        return None
    try:
        text = Path(path).read_text()
        body = json.loads(text)
        if not isinstance(body, dict) or body.get("format") != FORMAT:
            return None
        return StagePlan.model_validate_json(text)
    except (OSError, ValueError, ValidationError):
        return None
