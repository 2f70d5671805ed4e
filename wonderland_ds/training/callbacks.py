"""The trainer's events, and the callbacks that plug fault injection, liveness, metrics rows
and the progress display into them.

A :class:`Callback` overrides the events it cares about; the trainer calls only the
overridden ones, in the order of its callback list. Events of the step itself (``pre_step``
to ``post_step``) run on every step or micro-batch: they stay cheap and allocate nothing.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.distributed import log
from wonderland_ds.core.files import disk_error
from wonderland_ds.core.findings import Stopped
from wonderland_ds.core.signals import StopRequest
from wonderland_ds.data.blend import Blend
from wonderland_ds.run import manifest
from wonderland_ds.training import faults
from wonderland_ds.training.guards import StepGuards
from wonderland_ds.training.metrics import MetricsSink, guard_figures
from wonderland_ds.training.progress import ProgressDisplay
from wonderland_ds.training.rows import StepRow, write_metrics
from wonderland_ds.training.state import StageRun, TrainedStep


class Callback:
    """Every event of a stage's training, each a no-op here."""

    def on_start(self) -> None:
        """The stage is set up, before its first step (and before its loader starts)."""

    def pre_step(self, step: int) -> None:
        """Step ``step + 1`` starts (``step``: the global step trained so far)."""

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        """A micro-batch's loss, before its backward; returns the loss to backpropagate."""
        return loss

    def pre_backward(self, last: bool) -> None:
        """A micro-batch's backward comes next; ``last``: the step's last micro-batch."""

    def pre_update(self) -> None:
        """The optimizer update (the last micro-batch's ``engine.step``) comes next."""

    def on_update(self) -> None:
        """The step's micro-batches and update are done; it is recorded next."""

    def post_step(self, done: int) -> None:
        """Global step ``done`` is trained and recorded for the next check."""

    def on_judged(self, row: StepRow, step: TrainedStep, summed: list[float]) -> None:
        """A check judged ``step`` fine: its row, and its guard vector summed over ranks."""

    def pre_save(self) -> None:
        """A checkpoint of the current step is saved next."""

    def post_save(self, tag_dir: Path, held_s: float) -> None:
        """The save was handed over (``held_s``: the seconds it blocked training)."""

    def pre_rollback(self) -> None:
        """A check asked for a rollback; the newest complete checkpoint is loaded next."""

    def post_rollback(self, back: int) -> None:
        """Training goes on from global step ``back``."""

    def on_stop(self) -> None:
        """A guard stops the stage (a GuardStop is raised next)."""

    def on_train_end(self) -> None:
        """The step budget is trained; the stage ends."""

    def on_error(self, exc: BaseException) -> None:
        """Training failed (any exception, a guard stop included); it is re-raised."""

    def on_close(self) -> None:
        """Always, after training ended or failed."""

    def on_end(self) -> None:
        """After ``on_close``, when training ended without an error."""


def disk_full(run: StageRun, path: Path, exc: OSError) -> None:
    """A write on this rank failed for want of space: every rank stops at the next step
    (the stop agreement), without a save that could not fit."""
    if run.signals is not None:
        run.signals.request(
            StopRequest(
                "disk-full",
                None,
                time.time(),
                f"the disk is full at {path.parent}: writing {path.name} failed ({exc.strerror})",
            )
        )


class FaultInjection(Callback):
    """The fault plan's points inside the step: a corrupted loss, perturbed parameters, and
    the ``step`` fault point (a crash or hang) once a step is recorded."""

    def __init__(self, plan: faults.FaultPlan, module: torch.nn.Module) -> None:
        self.plan, self.module, self.rank = plan, module, dist.rank()
        self.step = 0  # the step being computed (faults are numbered by it)

    def pre_step(self, step: int) -> None:
        self.step = step + 1

    def on_loss(self, loss: torch.Tensor) -> torch.Tensor:
        return faults.corrupt_loss(self.plan, loss, self.step, self.rank)

    def on_update(self) -> None:
        faults.perturb(self.plan, self.module, self.step, self.rank)

    def post_step(self, done: int) -> None:
        self.plan.step_done(self.step)
        faults.maybe(self.plan, "step", done, self.rank)


class Heartbeat(Callback):
    """The rank's liveness heartbeat carries the last trained step."""

    def __init__(self, heartbeat: Any) -> None:
        self.heartbeat = heartbeat

    def post_step(self, done: int) -> None:
        self.heartbeat.step = done


class SourceTokens(Callback):
    """Weighted sources, rank 0: each judged step's tokens per source (for metrics.csv), and
    a log line when a source runs out and starts a new epoch in a new order."""

    def __init__(self, run: StageRun, blend: Blend, batch: int, stream_start: int) -> None:
        self.stage, self.blend, self.batch = run.stage, blend, batch
        self.stream_start = stream_start
        self.tokens = int(getattr(run.task.train, "tokens_per_sample", 1))
        self.main = dist.is_main()

    def on_judged(self, row: StepRow, step: TrainedStep, summed: list[float]) -> None:
        if not self.main:
            return
        end = step.samples - self.stream_start  # the mix's own stream position after the step
        counts = self.blend.between(end - self.batch, end)
        row.source_tokens = {s.name: n * self.tokens for s, n in zip(self.blend.sources, counts)}
        for name, epoch in self.blend.epoch_starts(end - self.batch, end):
            log(
                f"stage {self.stage} step {step.step}: source {name!r} ran out and starts"
                f" epoch {epoch + 1}"
                " (a new order)"
            )


class MetricsRows(Callback):
    """Rank 0's metrics.csv: rows past the start step dropped at the start and after a
    rollback; the judged steps' rows appended as the stage runs (at most every
    :data:`FLUSH_S`), and before each save, rollback and stop."""

    FLUSH_S = 2.0

    def __init__(self, run: StageRun, first: int, end: int) -> None:
        self.run, self.first, self.end = run, first, end
        self.main = dist.is_main()
        self.sources = [s.name for s in getattr(run.task.train, "sources", None) or []]
        self.rows: list[StepRow] = []
        self.flushed = time.monotonic()

    def on_start(self) -> None:
        if self.main:
            write_metrics(self.run.stage_dir, [], self.first, self.sources)
            manifest.update_stage(self.run.run_dir, self.run.stage, end_step=self.end)

    def on_judged(self, row: StepRow, step: TrainedStep, summed: list[float]) -> None:
        if not self.main:
            return
        self.rows.append(row)
        if time.monotonic() - self.flushed >= self.FLUSH_S:
            self.flush()

    def flush(self) -> None:
        rows, self.rows = self.rows, []
        self.flushed = time.monotonic()
        if self.main:
            try:
                write_metrics(self.run.stage_dir, rows, None, self.sources)
            except OSError as exc:
                if not disk_error(exc):
                    raise
                self.rows = rows + self.rows  # kept for when there is room
                disk_full(self.run, self.run.stage_dir / "metrics.csv", exc)

    pre_save = pre_rollback = on_stop = flush

    def post_rollback(self, back: int) -> None:
        if self.main:
            write_metrics(self.run.stage_dir, [], back, self.sources)

    def on_end(self) -> None:
        if self.rows:
            self.flush()


class ProgressReport(Callback):
    """The progress display (rank 0's lines) and the metrics sink (CSV, TensorBoard)."""

    def __init__(
        self,
        run: StageRun,
        engine: Any,
        guards: StepGuards,
        first: int,
        end: int,
        batch: int,
        tokens: int | None,
    ) -> None:
        self.run, self.engine, self.guards = run, engine, guards
        self.first, self.end, self.batch, self.tokens = first, end, batch, tokens
        self.window = run.settings.guards.spike_window
        self.saved = False
        self.display: ProgressDisplay | None = None
        self.sink: MetricsSink | None = None

    def on_start(self) -> None:
        self.display = ProgressDisplay(
            self.run.stage,
            self.end,
            self.first,
            self.batch,
            tokens_per_sample=self.tokens,
            every=self.run.settings.log_interval,
        )
        self.sink = MetricsSink(
            self.run.ds_dict,
            self.run.stage_dir,
            on_disk_full=lambda path, exc: disk_full(self.run, path, exc),
            engine=self.engine,
            keep_upto=self.first,
            samples_per_step=self.batch,
            tokens_per_sample=self.tokens,
        )

    def on_judged(self, row: StepRow, step: TrainedStep, summed: list[float]) -> None:
        assert self.display is not None and self.sink is not None
        guards = self.guards
        self.display.step(row, loss_scale=step.scale)
        window = guards.watchdog.losses[-self.window :]
        self.sink.write(
            row,
            loss_scale=step.scale,
            extra=guard_figures(
                [float(x) for x in summed[guards.layout.norms]],
                loss_median=statistics.median(window) if window else None,
                skipped_steps=step.skipped,
                events=len(guards.events),
            ),
        )

    def post_save(self, tag_dir: Path, held_s: float) -> None:
        assert self.display is not None and self.sink is not None
        self.saved = True
        self.display.checkpoint(tag_dir, held_s, background=True)
        self.sink.flush()

    def post_rollback(self, back: int) -> None:
        assert self.display is not None and self.sink is not None
        self.display.rewind(back)
        self.sink.rewind(back)

    def on_stop(self) -> None:
        if self.display is not None:
            self.display.close("stopped")

    def on_train_end(self) -> None:
        if self.display is not None and self.saved:
            self.display.note(
                f"checkpoint {ck.tag_for(int(self.engine.global_steps))} complete (sha256"
                " verified, metadata written last)"
            )

    def on_error(self, exc: BaseException) -> None:
        if self.display is None:
            return
        step = int(self.engine.global_steps)
        if isinstance(exc, Stopped):
            saved = (
                f", saved in {Path(exc.checkpoint).name}" if exc.saved and exc.checkpoint else ""
            )
            self.display.close(
                f"stopped at step {step} of {self.end} on {exc.request.describe()}{saved}"
            )
        else:
            # Not "done": a collective timed out, a rank died, or the user interrupted.
            self.display.close(f"failed at step {step} of {self.end}")

    def on_close(self) -> None:
        if self.display is not None and self.sink is not None:
            self.display.close()
            self.sink.close()
