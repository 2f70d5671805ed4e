"""The 18 stages of the Wonderland pipeline, declared in one typed place."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Kind = Literal["train", "eval", "export"]


@dataclass(frozen=True)
class Stage:
    number: int
    name: str
    kind: Kind
    resumes: bool
    """Needs the previous training stage's checkpoint (--resume)."""
    produces: str
    """What the stage leaves in the run directory."""
    preflight: bool = False
    """Runs the stage-16 preflight (optimizer/scheduler state, warmup, seed)."""
    verify_allreduce: bool = False
    """Verifies the all-reduce at stage start (the health-guard issue)."""


def _ordinary(n: int) -> Stage:
    return Stage(n, f"training stage {n}", "train", resumes=n > 1, produces="checkpoints")


STAGES: dict[int, Stage] = {n: _ordinary(n) for n in range(1, 15)}
STAGES[15] = Stage(
    15,
    "pre-normalization pass",
    "train",
    resumes=False,
    produces="checkpoints with the input normalization statistics and the LR warmup started",
)
STAGES[16] = Stage(
    16,
    "stabilization phase",
    "train",
    resumes=True,
    produces="checkpoints trained with gradient accumulation under the health guards",
    preflight=True,
    verify_allreduce=True,
)
STAGES[17] = Stage(
    17,
    "final evaluation sweep",
    "eval",
    resumes=True,
    produces="report.json: per-class metrics of stage 16 against stage 15, and the gate",
)
STAGES[18] = Stage(18, "export", "export", resumes=True, produces="consolidated fp32 weights")


def get(number: int) -> Stage:
    return STAGES[number]


def previous_training_stage(number: int) -> int | None:
    """The stage whose checkpoint ``number`` resumes from (17 and 18 read stage 16's)."""
    for n in range(number - 1, 0, -1):
        if STAGES[n].kind == "train":
            return n
    return None
