"""The guards' checks while a stage trains, overlapped with the next step where they can be.

Each check starts one all-reduce of the guard vectors of the steps since the last check, and
is settled (waited for, then every step judged in order) either at once or after the next step
trained (``guards.overlap_check``): the all-reduce is a few hundred bytes, but a blocking gloo
collective costs a hand-off to gloo's thread and a wake-up on every rank, and started before
the next step and waited for after it, most of that latency hides behind the step. A save
always waits for its check: no checkpoint holds an unjudged step.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, GuardStop
from wonderland_ds.training import health
from wonderland_ds.training.callbacks import Callback
from wonderland_ds.training.guards import StepGuards
from wonderland_ds.training.health import Event
from wonderland_ds.training.layout import VectorLayout
from wonderland_ds.training.rows import StepRow
from wonderland_ds.training.state import DTYPES, StageRun, TrainedStep, dump_json, loss_scale

#: A judged step's listeners (the callbacks' ``on_judged``).
Judged = Callable[[StepRow, TrainedStep, list[float]], None]


def check_matrix(
    pending: list[TrainedStep], lay: VectorLayout, rank: int
) -> tuple[torch.Tensor, list[float | None]]:
    """The rows of the steps since the last check, each with its loss sum and this rank's
    gradient norm filled in, and DeepSpeed's global gradient norm of each step as a float. A
    handful of tensor operations and host transfers per check, whatever its length: nothing
    of this synchronizes per step or per micro-batch."""
    mat = torch.tensor([p.vec for p in pending], dtype=torch.float64)
    losses = torch.stack([x for p in pending for x in p.losses]).double()
    mat[:, lay.LOSS] = losses.view(len(pending), -1).sum(1).cpu()
    if pending[0].aux:  # a MoE model: every step has its micro-batches' router losses
        aux = torch.stack([x.float() for p in pending for x in p.aux]).double()
        mat[:, lay.extra(1)] = aux.view(len(pending), -1).sum(1).cpu()
    have = [(i, p.sq) for i, p in enumerate(pending) if p.sq is not None]
    if have:
        sq = torch.stack([t for _, t in have]).to("cpu", torch.float64)
        mat[[i for i, _ in have], lay.norm(rank)] = sq.sqrt()
    tensors = [
        (i, p.grad_norm) for i, p in enumerate(pending) if isinstance(p.grad_norm, torch.Tensor)
    ]
    read = (
        dict(zip([i for i, _ in tensors], torch.stack([t.float() for _, t in tensors]).tolist()))
        if tensors
        else {}
    )
    norms = [read.get(i, p.grad_norm) for i, p in enumerate(pending)]
    return mat, [None if g is None else float(g) for g in norms]


@dataclass
class Check:
    """One check under way: its steps, their matrix (summed in place by the all-reduce), the
    all-reduce's handle and the seconds the loop spent starting it."""

    pending: list[TrainedStep]
    mat: torch.Tensor
    grad_norms: list[float | None]
    work: Any
    held_s: float


@dataclass
class Verdict:
    """A settled check: ``kind`` "ok" (or "warn": logged, training goes on), "stop" or
    "rollback", the events of the step that decided it, and whether every rank's
    checkpoint writer was idle at the check's last step."""

    kind: str
    events: list[Event]
    settled: bool


class Checks(Callback):
    """The guards of one stage's training and their checks: the guards' hooks and per-step
    bookkeeping (callback events), each trained step recorded (:meth:`record`), and the
    checks scheduled after each step (:meth:`after_step`)."""

    def __init__(self, run: StageRun, engine: Any, verify: bool) -> None:
        self.run, self.engine, self.verify = run, engine, verify
        self.module: torch.nn.Module = engine.module
        fp16 = run.cfg.fp16
        self.guards = StepGuards(
            run.settings.guards,
            run.fault,
            run.stage_dir,
            int(engine.zero_optimization_stage()),
            fp16.enabled,
            float(fp16.min_loss_scale),
        )
        self.rank, self.world = dist.rank(), dist.world_size()
        self.gas = int(engine.gradient_accumulation_steps())
        self.layout = VectorLayout(self.world, extra=2)
        self.busy_slot = self.layout.extra(0)  # summed: 0 when every rank's writer is idle
        self.aux_slot = self.layout.extra(1)  # summed: the MoE router losses
        self.fp16 = fp16.enabled
        g = run.settings.guards
        self.interval, self.overlap = g.check_interval, g.overlap_check
        self.listeners: list[Judged] = []
        self.pending: list[TrainedStep] = []  # steps trained since the last check
        self.overlapped: Check | None = None  # a check whose all-reduce runs during this step
        self.last_loss: float | None = None
        self.step_total = self.wait_total = 0.0

    # ------------------------------------------------------------ callback events

    def on_start(self) -> None:
        guards = self.guards
        guards.skipped = int(self.engine.skipped_steps)  # DeepSpeed restores it on a resume
        guards.start(int(self.engine.global_steps))
        start_check(self.run, guards, self.verify)
        guards.attach(self.module)

    def pre_step(self, step: int) -> None:
        self.guards.begin(step)

    def pre_backward(self, last: bool) -> None:
        self.guards.micro(last)

    def pre_rollback(self) -> None:
        # The steps after the offending one (up to this check, and the step the check
        # overlapped) are not judged: they are rolled back with it.
        self.pending = []

    def on_close(self) -> None:
        self.guards.close()

    # ------------------------------------------------------------ steps and checks

    def record(
        self,
        losses: list[torch.Tensor],
        digest: float,
        busy: bool,
        samples: int,
        t0: float,
        wait_s: float,
        aux: list[torch.Tensor],
    ) -> int:
        """The step just trained, kept for the next check; returns the global step."""
        engine = self.engine
        # One small all-reduce per check carries every number the guards and the log need.
        vec, sq = self.guards.vector(self.module, extra=2)
        vec[self.layout.DIGEST] = digest
        vec[self.busy_slot] = float(busy)
        done = int(engine.global_steps)
        self.pending.append(
            TrainedStep(
                done,
                vec,
                losses,
                sq,
                float(engine.get_lr()[0]),
                engine.get_global_grad_norm(),
                int(engine.skipped_steps),
                loss_scale(engine) if self.fp16 else None,
                samples,
                time.perf_counter() - t0,
                wait_s,
                time.time(),
                aux,
            )
        )
        return done

    def after_step(self, done: int, save_due: bool) -> Verdict | None:
        """Start and settle the checks due after step ``done``: the verdict to act on now, or
        None (no check due, or one started to overlap the next step)."""
        check_due = save_due or done % self.interval == 0
        if self.overlapped is None and not check_due:
            return None
        verdict = Verdict("ok", [], False)
        if self.overlapped is not None:
            # The last check's all-reduce ran while this step trained: its verdict now,
            # before anything of this step is judged, saved or checked.
            verdict, self.overlapped = self.settle(self.overlapped), None
        if check_due and verdict.kind not in ("stop", "rollback"):
            check, self.pending = self.start(self.pending), []
            if self.overlap and not save_due:
                self.overlapped = check
                return None
            verdict = self.settle(check)
        return verdict

    def start(self, pending: list[TrainedStep]) -> Check:
        t0 = time.perf_counter()
        mat, grad_norms = check_matrix(pending, self.layout, self.rank)
        work = dist.all_reduce_sum_start(mat)
        return Check(pending, mat, grad_norms, work, time.perf_counter() - t0)

    def settle(self, check: Check) -> Verdict:
        """Wait for the check's all-reduce and judge its steps in order, up to the first that
        stops or rolls back; each step judged fine goes to the listeners."""
        t0 = time.perf_counter()
        check.work.wait()
        summed = check.mat.tolist()
        guards, last = self.guards, len(check.pending) - 1
        kind, events = "ok", []
        for i, (p, v, gn) in enumerate(zip(check.pending, summed, check.grad_norms)):
            guards.step = p.step
            self.last_loss = float(v[self.layout.LOSS]) / (self.gas * self.world)
            events = guards.judge(v, self.last_loss, p.lr, self.module, p.skipped, p.scale)
            kind = guards.decision(events)
            if kind in ("stop", "rollback"):
                break
            # The check's own time is charged to its last step, whenever it was paid.
            step_s = p.step_s + (check.held_s + time.perf_counter() - t0 if i == last else 0)
            self.step_total += step_s
            self.wait_total += p.wait_s
            row = StepRow.measured(
                p.step,
                self.last_loss,
                p.lr,
                gn,
                p.samples,
                int(v[self.layout.DIGEST]),
                step_s,
                p.wait_s,
                p.wall,
                v[self.aux_slot] / (self.gas * self.world) if p.aux else None,
            )
            for listen in self.listeners:
                listen(row, p, v)
        return Verdict(kind, events, summed[-1][self.busy_slot] == 0.0)


def start_check(run: StageRun, guards: StepGuards, verify: bool) -> None:
    """All-reduce verification and per-rank transfer timings before the first step."""
    g = run.settings.guards
    if not (g.enabled and verify):
        return
    missing = dist.monitored_barrier(min(run.settings.process_group_timeout_s, 120))
    if missing:
        raise GuardStop(
            [
                Finding(
                    "allreduce-check",
                    "error",
                    missing,
                    "check that host's network and process, then resume",
                )
            ]
        )
    report, events = health.verify_allreduce(DTYPES[run.cfg.precision], run.fault, guards.hosts, g)
    if dist.is_main():
        dump_json(run.stage_dir / "allreduce_check.json", report)
        print(
            "[wonderland] all-reduce verification at stage start:\n" + health.report_table(report),
            flush=True,
        )
    guards.record(events)
    guards.probe_hint_s = float(report["probe_s"])
    stop = [e for e in events if e.policy == "stop"]
    if stop:
        raise GuardStop(
            [
                Finding(
                    e.guard,
                    "error",
                    f"rank {e.rank} ({e.host}): {e.message}",
                    "check that host's network/GPU, exclude it from the hostfile,"
                    " then resume with --resume auto",
                )
                for e in stop
            ]
        )
