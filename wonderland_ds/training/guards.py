"""The guards while a stage trains: hooks, one all-reduce every few steps, policies.

Per step every rank writes into one small float64 vector (its slots: ``layout.VectorLayout``):
the loss sum, the sample digest, its own local gradient norm (measured by a tensor hook
*before* DeepSpeed's reduction) and, every ``fingerprint_interval`` steps, a checksum of its
parameters. Every ``check_interval``
steps (and before every save) one all-reduce of the vectors since the last check gives every
rank the same numbers, and every rank judges those steps in order, so every rank takes the
same decision at the same step.
"""

from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.config.settings import Guards
from wonderland_ds.core import distributed as dist
from wonderland_ds.training import faults, health
from wonderland_ds.training.health import Event
from wonderland_ds.training.layout import VectorLayout

SEVERITY = {"warn": 0, "rollback": 1, "stop": 2}
FIRST_PROBE = 10  # adaptive probing without the start check: the first probe, steps after start
PROBE_INTERVAL_BOUNDS = (10, 1000)


class StepGuards:
    def __init__(
        self,
        g: Guards,
        plan: faults.FaultPlan,
        stage_dir: Path,
        zero_stage: int,
        fp16: bool,
        min_loss_scale: float,
    ) -> None:
        self.g, self.plan, self.stage_dir = g, plan, stage_dir
        self.rank, self.world = dist.rank(), dist.world_size()
        self.layout = VectorLayout(self.world)
        self.hosts: list[str] = dist.gather_all(dist.hostname())
        self.replicas = zero_stage < 3  # ZeRO-3 partitions parameters: no replicas to compare
        self.fp16, self.min_loss_scale = fp16, min_loss_scale
        self.watchdog = health.LossWatchdog(g)
        self.norms: list[torch.Tensor] = []  # this step's per-gradient norms (hooks)
        # Per-parameter sums taken at each fingerprint step, kept until that step is judged:
        # the replicas may agree again by the check (ZeRO-1/2 re-gather the parameters every
        # step), so the odd parameter is named from the step that differed.
        self.param_sums: dict[int, tuple[list[str], list[float]]] = {}
        self.step = 0
        self.handles: list[Any] = []
        self.dropping = False  # this step's gradients are dropped (fault injection)
        self.measuring = True  # the hooks measure this micro-batch's gradients (micro)
        self._norm_dtype = {torch.float16: torch.float32}
        self.events: list[Event] = []
        self.rollbacks = 0
        self.scale_at_min = 0
        self.skipped = 0
        self.slow_streak: dict[int | None, int] = {}
        self.low_streak: dict[int | None, int] = {}
        # The in-training transfer probe: fixed interval, or (None) adaptive within a budget.
        self.t_begin = 0.0
        self.probe_s = 0.0  # this rank's last probe wall time, reported in the next vector
        self.last_probe = 0
        self.next_probe = FIRST_PROBE
        self.step_ema: float | None = None
        self.probe_intervals: list[int] = []
        # The start check's probe time (the same on every rank): the start check counts as a
        # probe at the stage's first step, so the first probe in training keeps to the budget.
        self.probe_hint_s: float | None = None

    def start(self, first: int) -> None:
        """The stage (re)starts after global step ``first``: the first adaptive probe comes
        FIRST_PROBE steps later, or where the start check's probe time places it."""
        self.last_probe, self.next_probe = first, first + FIRST_PROBE

    # ------------------------------------------------------------ hooks

    def attach(self, module: torch.nn.Module) -> None:
        if not self.g.enabled:
            return
        for p in module.parameters():
            if p.requires_grad:
                self.handles.append(p.register_hook(self._hook))

    def _hook(self, grad: torch.Tensor) -> torch.Tensor:
        # The fault runs first and its zeros are what the reduction receives and what is
        # measured: the injected drop really reaches DeepSpeed. Whether this step drops is
        # decided once a step (begin), not once a gradient.
        if self.dropping:
            grad = torch.zeros_like(grad)
        if not self.measuring:
            return grad
        # One fused reduction and nothing else: the norms are combined once a step (vector)
        # and read on the host once per check. The reduction accumulates in fp32 whatever the
        # gradient's dtype; a bf16 gradient's norm is returned in bf16 (8 significant bits,
        # 0.4% at most, far inside grad_drop_ratio), which costs a third of asking for an fp32
        # result. fp16 asks for fp32: a loss-scaled norm can pass fp16's 65504.
        self.norms.append(torch.linalg.vector_norm(grad, dtype=self._norm_dtype.get(grad.dtype)))
        return grad

    def close(self) -> None:
        for h in self.handles:
            h.remove()

    # ------------------------------------------------------------ per step

    def begin(self, step: int) -> None:
        self.step = step + 1  # faults and events are numbered by the step being computed
        self.norms = []
        self.measuring = True
        self.dropping = bool(self.handles) and faults.drops_grads(self.plan, self.step, self.rank)
        self.t_begin = time.perf_counter()

    def micro(self, last: bool) -> None:
        """A micro-batch's backward comes next. Only the step's last one is measured: a norm
        per gradient is most of what the guards cost a step (16 of them on digits, 4
        micro-batches of 4 gradients), and one micro-batch a step tells a rank that drops or
        corrupts its gradients from its peers as well as four. A drop fault still zeroes every
        micro-batch's gradients."""
        self.measuring = last

    def vector(
        self, module: torch.nn.Module, extra: int = 0
    ) -> tuple[list[float], torch.Tensor | None]:
        """This rank's row for the step (:class:`VectorLayout`, then ``extra`` slots for the
        caller), summed over ranks by the check, so step s and probe s become sums and every
        rank reads the same means (probe decisions are collective and must agree). Plain
        floats, and this step's squared gradient norm as a tensor where the gradients live
        (None without hooks): the check fills the loss and this rank's norm for all its steps
        at once, one host transfer per check."""
        lay = self.layout
        v = [0.0] * (lay.size + extra)
        if self._fingerprint_due():
            names, sums = _per_param(module)
            self.param_sums[self.step] = (names, sums)
            v[lay.fingerprint(self.rank)] = math.fsum(x * (i + 1) for i, x in enumerate(sums))
        v[lay.step_s] = time.perf_counter() - self.t_begin
        v[lay.probe_s], self.probe_s = self.probe_s, 0.0
        sq = torch.stack(self.norms).double().square().sum() if self.norms else None
        return v, sq

    def _probe_due(self, v: list[float]) -> bool:
        """Fixed ``comm_probe_interval``, or adaptive: after each probe the next one is placed
        so that probing costs at most ``comm_probe_budget`` of the training time (from the
        mean step time and the mean probe time of all ranks: the same numbers everywhere)."""
        w, step = self.world, self.step
        n = self.g.comm_probe_interval
        if w == 1 or n == 0:
            return False
        if n is not None:
            return step % n == 0
        mean_step = float(v[self.layout.step_s]) / w
        self.step_ema = (
            mean_step if self.step_ema is None else 0.9 * self.step_ema + 0.1 * mean_step
        )
        probe = float(v[self.layout.probe_s]) / w
        if (
            probe == 0
            and not self.probe_intervals
            and self.probe_hint_s
            and step >= self.next_probe
        ):
            probe = self.probe_hint_s  # the start check's probe, at the stage's first step
        if probe > 0:  # the probe of step last_probe, reported now: place the next one
            lo, hi = PROBE_INTERVAL_BOUNDS
            want = probe / (self.g.comm_probe_budget * max(self.step_ema, 1e-6))
            interval = int(min(hi, max(lo, math.ceil(want))))
            self.probe_intervals.append(interval)
            self.next_probe = self.last_probe + interval
        return step >= self.next_probe

    def _fingerprint_due(self) -> bool:
        n = self.g.fingerprint_interval
        return self.g.enabled and self.replicas and n > 0 and self.step % n == 0

    def judge(
        self,
        v: list[float],
        loss: float,
        lr: float,
        module: torch.nn.Module,
        skipped: int,
        scale: float | None,
    ) -> list[Event]:
        """Events for step ``self.step`` (identical on every rank): ``v`` is its summed vector;
        ``lr``, ``skipped`` (DeepSpeed's skipped-step count) and ``scale`` (the loss scale)
        as they were right after that step."""
        if not self.g.enabled:
            return []
        step, w = self.step, self.world
        out = self.watchdog.update(step, loss, lr)
        norms = [float(x) for x in v[self.layout.norms]]
        drops = health.grad_drops(step, norms, self.hosts, self.g)
        # Zero or non-finite counts at once; "far below its peers" only when it persists
        # (one small micro-batch can have a small gradient; a dropping rank stays low).
        low = {e.rank for e in drops if "peers" in e.message}
        self.low_streak = {r: self.low_streak.get(r, 0) + 1 for r in low}
        out += [
            e
            for e in drops
            if e.rank not in low or self.low_streak[e.rank] >= self.g.grad_drop_patience
        ]
        if self._fingerprint_due():
            kept = self.param_sums.pop(step, None)
            names, sums = kept if kept is not None else _per_param(module)
            self.param_sums = {k: x for k, x in self.param_sums.items() if k > step}
            prints = [float(x) for x in v[self.layout.prints]]
            if len(set(prints)) > 1:  # find the first parameter that differs, by name
                found = health.divergence(step, dist.gather_all(sums), names, self.hosts, self.g)
                if not found:  # the sums agree one by one but not weighted: name the ranks
                    majority = statistics.mode(prints)
                    no_majority = 2 * prints.count(majority) <= w  # then every rank is named
                    found = [
                        Event(
                            "replica-divergence",
                            step,
                            self.g.divergence_policy,
                            f"parameter checksum {prints[r]!r} differs from the other"
                            f" replicas' {majority!r}"
                            if not no_majority
                            else f"parameter checksums differ and no majority agrees"
                            f" (rank {r}: {prints[r]!r})",
                            r,
                            self.hosts[r],
                        )
                        for r in range(w)
                        if no_majority or prints[r] != majority
                    ]
                out += found
        if self._probe_due(v):
            t0 = time.perf_counter()
            times = health.send_times(self.plan, step, health.PROBE_SIZES)
            self.probe_s, self.last_probe = time.perf_counter() - t0, step
            self.next_probe = step + PROBE_INTERVAL_BOUNDS[1]  # until its cost is known
            slow = health.slow_ranks(step, times, self.hosts, self.g, "slow-comm")
            # One or two slow probes on a busy host are noise; three in a row is a slow link.
            flagged = {e.rank for e in slow}
            self.slow_streak = {r: self.slow_streak.get(r, 0) + 1 for r in flagged}
            out += [e for e in slow if self.slow_streak[e.rank] >= 3]
        out += self._loss_scale(skipped, scale)
        self.record(out)
        return out

    def _loss_scale(self, skipped: int, scale: float | None) -> list[Event]:
        out = []
        if skipped > self.skipped:  # DeepSpeed logs overflows at INFO only: surface them
            out.append(
                Event(
                    "skipped-step",
                    self.step,
                    "warn",
                    f"optimizer step skipped (overflow); {skipped} so far, loss scale now {scale}",
                )
            )
            self.skipped = skipped
        if self.fp16 and scale is not None:
            self.scale_at_min = self.scale_at_min + 1 if scale <= self.min_loss_scale else 0
            if self.scale_at_min >= self.g.loss_scale_stuck_steps:
                out.append(
                    Event(
                        "loss-scale-stuck",
                        self.step,
                        "stop",
                        f"fp16 loss scale at its minimum {scale:g} for"
                        f" {self.scale_at_min} steps: gradients overflow every step",
                    )
                )
        return out

    def record(self, events: list[Event]) -> None:
        self.events += events
        if dist.is_main() and events:
            with open(self.stage_dir / "guards.jsonl", "a") as fh:
                for e in events:
                    fh.write(json.dumps(e.to_dict()) + "\n")
            for e in events:
                print(f"[wonderland] {e.line()}", flush=True)

    def decision(self, events: list[Event]) -> str:
        if not events:
            return "ok"
        worst = max(events, key=lambda e: SEVERITY[e.policy]).policy
        if worst == "rollback" and self.rollbacks >= self.g.max_rollbacks:
            return "stop"
        return worst

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for e in self.events:
            out[e.guard] = out.get(e.guard, 0) + 1
        return out


def _per_param(module: torch.nn.Module) -> tuple[list[str], list[float]]:
    with torch.no_grad():
        pairs = [(n, float(p.detach().double().sum())) for n, p in module.named_parameters()]
    return [n for n, _ in pairs], [s for _, s in pairs]
