"""Fault injection: a documented switch (``--fault`` or ``WONDERLAND_FAULT``), not a monkeypatch.

Grammar: comma-separated ``KIND@POINT[:step=N][:until=M][:rank=R][:factor=F]``. Rank defaults
to 0. One-shot kinds act at ``step`` only; persistent kinds act from ``step`` (default: the
first) to ``until`` (default: forever).

==========================  ======================================================================
``kill@step:step=25:rank=1``  SIGKILL rank 1 right after optimizer step 25
``kill@save-before-meta``     SIGKILL rank 0 inside a save, after the shards, before the metadata
                              (also ``save-after-shards``, ``save-before-latest``)
``nan@step:step=30``          rank 0's loss is NaN at step 30
``spike@step:step=40:factor=4``  every rank's loss (and so its gradient) x4 at step 40
``drop@grad:rank=1:step=10:until=12``  rank 1's gradients are zeroed before the reduction
``slow@comm:rank=1:factor=2``  rank 1's communication takes 2x: the start check's transfers and,
                              during training, a sleep before its gradient reduction
``slow@save-before-meta:factor=8``  rank 0's saves wait 8 s after the shards, before the
                              metadata (a slow filesystem: a window to signal or kill a save)
``perturb@step:rank=1:step=30``  rank 1's weights get noise after every step from 30 on
                              (a persistently faulty replica)
``diskfull@save:step=20``     from the save of step 20 on, rank 0 cannot write more than 64 KiB
                              per file (RLIMIT_FSIZE, a real EFBIG from the kernel: a full disk)
``hang@step:step=25:rank=1``  rank 1 SIGSTOPs itself right after optimizer step 25 (a frozen
                              process: the others block in their next collective)
``skew@load:rank=1``          after a resume that changed the layout, rank 1's first optimizer
                              moment is shifted by one element (a misplaced range), before the
                              check of the loaded state
==========================  ======================================================================

Every injected fault prints ``FAULT INJECTED: ...`` to stderr when it first acts, so a test can
show that the fault really happened.

A one-shot fault acts once per stage, also across the restarts of ``--max-restarts``: when it
acts it leaves a marker in ``RUN/stageN/faults/``, and a restarted stage skips it. ``:repeat=1``
makes it act on every attempt (a fault that no restart can get past).
"""

from __future__ import annotations

import os
import signal
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is not imported by `wonderland check` (it must stay fast)
    import torch

KINDS = ("kill", "nan", "spike", "drop", "slow", "perturb", "hang", "diskfull", "skew")
POINTS = (
    "step",
    "grad",
    "comm",
    "save",
    "save-after-shards",
    "save-after-latest",
    "save-retain-renamed",
    "save-before-meta",
    "save-before-latest",
    "load",
)
ONE_SHOT = ("kill", "nan", "spike", "hang")
_VALID = {
    "kill": POINTS,
    "nan": ("step",),
    "spike": ("step",),
    "drop": ("grad",),
    "slow": ("comm", "save-after-shards", "save-before-meta"),
    "perturb": ("step",),
    "hang": ("step",),
    "diskfull": ("save",),
    "skew": ("load",),
}


@dataclass(frozen=True)
class Fault:
    kind: str
    point: str
    step: int | None = None
    rank: int = 0
    until: int | None = None
    factor: float = 1.0
    repeat: bool = False
    """One-shot kinds: act on every attempt of the stage, not once across its restarts."""

    @property
    def marker(self) -> str:
        return f"{self.kind}@{self.point}-step{self.step}-rank{self.rank}.fired"

    def active(self, step: int) -> bool:
        if self.kind in ONE_SHOT:
            return self.step is None or step == self.step
        return (self.step is None or step >= self.step) and (
            self.until is None or step <= self.until
        )


@dataclass
class FaultPlan:
    faults: tuple[Fault, ...] = field(default_factory=tuple)
    _announced: set[tuple[Fault, int, int]] = field(default_factory=set)
    base_transfer_s: float = 2e-3
    """The last healthy transfer time this rank measured: the slow fault sleeps a multiple."""

    _consumed: set[Fault] = field(default_factory=set)
    _record: Path | None = None

    def remember(self, folder: Path) -> None:
        """Record one-shot faults in ``folder`` when they act; skip those an earlier attempt
        of the stage recorded."""
        self._record = folder
        for f in self.faults:
            if f.kind in ONE_SHOT and not f.repeat and (folder / f.marker).exists():
                self._consumed.add(f)

    def at(self, point: str, step: int, rank: int, kind: str | None = None) -> list[Fault]:
        return [
            f
            for f in self.faults
            if f.point == point
            and f.rank == rank
            and (kind is None or f.kind == kind)
            and f.active(step)
            and f not in self._consumed
        ]

    def step_done(self, step: int) -> None:
        """One-shot faults act on one pass through their step: a bad batch, not a bad step
        number. After a rollback the same step number runs on other data, without them."""
        self._consumed |= {f for f in self.faults if f.kind in ("nan", "spike") and f.active(step)}

    def announce(self, f: Fault, step: int, rank: int) -> None:
        key = (f, rank, step if f.kind in ONE_SHOT else -1)
        if key not in self._announced:
            self._announced.add(key)
            if self._record is not None and f.kind in ONE_SHOT and not f.repeat:
                try:  # before the fault acts: a killed rank has left its marker
                    self._record.mkdir(parents=True, exist_ok=True)
                    (self._record / f.marker).write_text(f"step {step} rank {rank}\n")
                except OSError:
                    pass
            print(
                f"FAULT INJECTED: {f.kind} at {f.point} step {step} rank {rank}"
                f"{'' if f.factor == 1.0 else f' factor {f.factor:g}'} (pid {os.getpid()})",
                file=sys.stderr,
                flush=True,
            )


def parse(spec: str | None) -> FaultPlan:
    """Parse a fault spec; raises ValueError naming the bad item."""
    if not spec:
        return FaultPlan()
    out = []
    for item in spec.split(","):
        item = item.strip()
        head, *opts = item.split(":")
        kind, _, point = head.partition("@")
        if kind not in KINDS or point not in _VALID[kind]:
            raise ValueError(
                f"bad fault {item!r}: use KIND@POINT, KIND in {KINDS}, POINT"
                f" {'/'.join(_VALID.get(kind, POINTS))}"
            )
        kw: dict[str, float] = {}
        for opt in opts:
            key, _, value = opt.partition("=")
            try:
                number = float(value) if key == "factor" else int(value)
            except ValueError:
                number = -1
            if key not in ("step", "rank", "until", "factor", "repeat") or number < 0:
                raise ValueError(
                    f"bad fault option {opt!r} in {item!r}: use step=N, until=N, rank=R,"
                    " factor=F or repeat=1"
                )
            kw[key] = number
        out.append(
            Fault(
                kind,
                point,
                None if "step" not in kw else int(kw["step"]),
                int(kw.get("rank", 0)),
                None if "until" not in kw else int(kw["until"]),
                float(kw.get("factor", 4.0 if kind == "spike" else 2.0 if kind == "slow" else 1.0)),
                bool(kw.get("repeat", 0)),
            )
        )
    return FaultPlan(tuple(out))


def maybe(plan: FaultPlan, point: str, step: int, rank: int | None = None) -> None:
    """Run the kill and hang faults planned at this point (``rank`` defaults to this process's)."""
    if not plan.faults:
        return
    from wonderland_ds.core import distributed as dist

    r = dist.rank() if rank is None else rank
    for f in plan.at(point, step, r, "kill"):
        plan.announce(f, step, r)
        os.kill(os.getpid(), signal.SIGKILL)
    for f in plan.at(point, step, r, "hang"):
        plan.announce(f, step, r)
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen, not dead: only SIGKILL/SIGCONT end it
    if point.startswith("save"):
        for f in plan.at(point, step, r, "slow"):
            import time

            plan.announce(f, step, r)
            time.sleep(f.factor)


def corrupt_loss(plan: FaultPlan, loss: torch.Tensor, step: int, rank: int) -> torch.Tensor:
    for f in plan.at("step", step, rank, "nan"):
        plan.announce(f, step, rank)
        loss = loss * float("nan")
    for f in plan.faults:
        if f.kind == "spike" and f.active(step) and f not in plan._consumed:  # every rank
            plan.announce(f, step, rank)
            loss = loss * f.factor
    return loss


def slow_factor(plan: FaultPlan, step: int, rank: int) -> float:
    found = plan.at("comm", step, rank, "slow")
    return found[0].factor if found else 1.0


def drops_grads(plan: FaultPlan, step: int, rank: int) -> bool:
    found = plan.at("grad", step, rank, "drop")
    if found:
        plan.announce(found[0], step, rank)
    return bool(found)


def perturb(plan: FaultPlan, module: torch.nn.Module, step: int, rank: int) -> None:
    import torch

    for f in plan.at("step", step, rank, "perturb"):
        plan.announce(f, step, rank)
        with torch.no_grad():
            for p in module.parameters():
                if p.requires_grad and p.numel() > 0:
                    p.add_(torch.randn_like(p) * 1e-3)
                    break


def limit_file_size(plan: FaultPlan, step: int, rank: int) -> None:
    """diskfull: RLIMIT_FSIZE makes the kernel refuse writes past 64 KiB per file (EFBIG)."""
    for f in plan.at("save", step, rank, "diskfull"):
        import resource

        plan.announce(f, step, rank)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # an OSError instead of a dead process
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))


def skew_loaded(plan: FaultPlan, optimizer: torch.optim.Optimizer, step: int, rank: int) -> None:
    """skew: shift this rank's first partitioned optimizer state by one element."""
    for f in plan.at("load", step, rank, "skew"):
        for state in optimizer.state.values():
            key = next((k for k in sorted(state) if state[k].dim() > 0), None)
            if key is not None:
                plan.announce(f, step, rank)
                state[key].copy_(state[key].roll(1))
                return
