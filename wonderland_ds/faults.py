"""Fault injection: a documented switch (``--fault`` or ``WONDERLAND_FAULT``), not a monkeypatch.

Grammar: comma-separated ``KIND@POINT[:step=N][:rank=R]``.

* ``kill@step:step=25:rank=1``: SIGKILL rank 1 right after optimizer step 25.
* ``kill@save-before-meta:step=20``: SIGKILL rank 0 inside the save of step 20, after every
  shard is written but before the metadata (also ``save-after-shards``, ``save-before-latest``).
* ``nan@step:step=30:rank=0``: rank 0's loss is NaN at optimizer step 30.

Every injected fault prints ``FAULT INJECTED: ...`` to stderr first, so a test can show the
fault really happened. Rank defaults to 0, step to any step.
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported by `wonderland check` (it must stay fast)
    import torch

KINDS = ("kill", "nan")
POINTS = ("step", "save-after-shards", "save-before-meta", "save-before-latest")


@dataclass(frozen=True)
class Fault:
    kind: str
    point: str
    step: int | None = None
    rank: int = 0


@dataclass(frozen=True)
class FaultPlan:
    faults: tuple[Fault, ...] = field(default_factory=tuple)

    def at(self, point: str, step: int, rank: int) -> list[Fault]:
        return [
            f
            for f in self.faults
            if f.point == point and f.rank == rank and (f.step is None or f.step == step)
        ]


def parse(spec: str | None) -> FaultPlan:
    """Parse a fault spec; raises ValueError with the bad item named."""
    if not spec:
        return FaultPlan()
    out = []
    for item in spec.split(","):
        item = item.strip()
        head, *opts = item.split(":")
        kind, _, point = head.partition("@")
        if kind not in KINDS or point not in POINTS:
            raise ValueError(
                f"bad fault {item!r}: use KIND@POINT with KIND in {KINDS} and POINT in {POINTS}"
            )
        kw: dict[str, int] = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            if key not in ("step", "rank") or not value.isdigit():
                raise ValueError(f"bad fault option {opt!r} in {item!r}: use step=N or rank=R")
            kw[key] = int(value)
        out.append(Fault(kind, point, kw.get("step"), kw.get("rank", 0)))
    return FaultPlan(tuple(out))


def _announce(f: Fault, step: int, rank: int) -> None:
    print(
        f"FAULT INJECTED: {f.kind} at {f.point} step {step} rank {rank} (pid {os.getpid()})",
        file=sys.stderr,
        flush=True,
    )


def maybe(plan: FaultPlan, point: str, step: int, rank: int | None = None) -> None:
    """Run the kill faults planned at this point (``rank`` defaults to this process's)."""
    if not plan.faults:
        return
    from . import distributed as dist

    r = dist.rank() if rank is None else rank
    for f in plan.at(point, step, r):
        if f.kind == "kill":
            _announce(f, step, r)
            os.kill(os.getpid(), signal.SIGKILL)


def corrupt_loss(plan: FaultPlan, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    for f in plan.at("step", step, rank):
        if f.kind == "nan":
            _announce(f, step, rank)
            return loss * float("nan")
    return loss
