"""Per-step metrics to CSV and TensorBoard through DeepSpeed's own monitor.

DeepSpeed's monitor (``deepspeed.monitor.monitor.MonitorMaster``, configured by the config's
``tensorboard`` / ``csv_monitor`` sections) writes the LR and the loss scale, but not the
training loss for the plain engine. :class:`MetricsSink` writes what an operator
needs per optimizer step (a :class:`~wonderland_ds.training.rows.StepRow`), keyed by the
global step: the loss, LR, gradient norm, step and data-wait times, throughput and the health
guards' figures.

Where: through ``engine.monitor`` when the config enables DeepSpeed's monitor (the user's
writers, wandb and comet included, get our events too); otherwise a ``MonitorMaster`` of its own
with a section the config lacks filled in: CSV under ``STAGE_DIR/monitor/csv/`` and
TensorBoard under ``STAGE_DIR/monitor/tensorboard/`` (a section the config has, enabled or
not, is the user's choice and is kept). TensorBoard needs the ``tensorboard`` package (a
dependency); without it only the CSV is written, and :attr:`MetricsSink.notes` says so.

On a resume or a rollback the CSV files drop rows past the restored step (as metrics.csv does);
TensorBoard's reader discards the orphaned steps itself when a step goes back.
"""

from __future__ import annotations

import csv
import queue
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from wonderland_ds.core.files import disk_error
from wonderland_ds.training.rows import StepRow

#: Event tags (the CSV file of ``Train/Steps/loss`` is ``Train_Steps_loss.csv``).
LOSS, LR, GRAD_NORM = "Train/Steps/loss", "Train/Steps/lr", "Train/Steps/grad_norm"
STEP_S, DATA_WAIT_S = "Train/Steps/step_s", "Train/Steps/data_wait_s"
SAMPLES_PER_S, TOKENS_PER_S = "Train/Steps/samples_per_s", "Train/Steps/tokens_per_s"
LOSS_SCALE = "Train/Steps/loss_scale"
ROW_TAGS = (
    ("loss", LOSS),
    ("lr", LR),
    ("grad_norm", GRAD_NORM),
    ("step_s", STEP_S),
    ("data_wait_s", DATA_WAIT_S),
    ("aux_loss", "Train/Steps/aux_loss"),
)


def tensorboard_available() -> bool:
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        return False
    return True


def monitor_sections(
    ds_config: Mapping[str, Any], stage_dir: Path, tensorboard: bool | None = None
) -> dict[str, dict[str, Any]]:
    """The ``tensorboard`` and ``csv_monitor`` sections to build a MonitorMaster from: the
    config's own where it has one, else ours under ``stage_dir/monitor``."""
    out = stage_dir / "monitor"
    tb = tensorboard_available() if tensorboard is None else tensorboard
    ours = {
        "tensorboard": {"enabled": tb, "output_path": str(out), "job_name": "tensorboard"},
        "csv_monitor": {"enabled": True, "output_path": str(out), "job_name": "csv"},
    }
    return {k: dict(ds_config[k]) if k in ds_config else v for k, v in ours.items()}


def guard_figures(
    local_grad_norms: Sequence[float],
    loss_median: float | None = None,
    skipped_steps: int | None = None,
    events: int | None = None,
) -> dict[str, float]:
    """The guards' per-step numbers as tags. Local gradient norms are measured on each rank
    before the reduction (a rank that dropped its gradients reads 0); they are summarized, so
    the tag count does not grow with the world size: min, median, max, min over median (the
    gradient-drop guard's ratio) and the rank holding the min. Also the loss watchdog's rolling
    median, skipped steps and guard events so far."""
    out: dict[str, float] = {}
    norms = [float(x) for x in local_grad_norms]
    if norms:
        ordered = sorted(norms)
        med = ordered[len(ordered) // 2]
        out["Guards/grad_norm_min"] = ordered[0]
        out["Guards/grad_norm_median"] = med
        out["Guards/grad_norm_max"] = ordered[-1]
        out["Guards/grad_norm_min_over_median"] = ordered[0] / med if med > 0 else 0.0
        out["Guards/grad_norm_min_rank"] = float(norms.index(ordered[0]))
    if loss_median is not None:
        out["Guards/loss_median"] = float(loss_median)
    if skipped_steps is not None:
        out["Guards/skipped_steps"] = float(skipped_steps)
    if events is not None:
        out["Guards/events"] = float(events)
    return out


def write_batch(
    master: Any, events: Sequence[tuple[str, float, int]], files: dict[str, Any] | None = None
) -> None:
    """Write ``events`` (tag, value, step) through a DeepSpeed ``MonitorMaster``, batched.

    The same files and records as ``master.write_events``, at a fraction of the cost:
    DeepSpeed's CSV writer opens and closes a file per event, and its TensorBoard writer makes
    one protobuf event (one queue hand-off to TensorBoard's writer thread) per scalar.
    Here each CSV file is opened
    once per batch, and each step is one TensorBoard event holding all its scalars (a
    ``Summary`` with several ``simple_value`` entries, as ``add_scalar`` writes them one by
    one). wandb and comet get DeepSpeed's own ``write_events``. Anything that is not a
    ``MonitorMaster`` gets its ``write_events`` as it is.

    ``files``: CSV files kept open from one batch to the next (by name; the caller closes
    them, :func:`close_files`), instead of one open per file per batch."""
    if not all(hasattr(master, a) for a in ("csv_monitor", "tb_monitor")):
        master.write_events(list(events))
        return
    tb = master.tb_monitor
    writer = getattr(tb, "summary_writer", None) if tb is not None else None
    if writer is not None and getattr(tb, "enabled", False):
        _tensorboard_batch(writer, events)
    csv_mon = master.csv_monitor
    if csv_mon is not None and getattr(csv_mon, "enabled", False):
        _csv_batch(csv_mon, events, files)
    for name in ("wandb_monitor", "comet_monitor"):
        other = getattr(master, name, None)
        if other is not None:
            other.write_events(list(events))


def _tensorboard_batch(writer: Any, events: Sequence[tuple[str, float, int]]) -> None:
    import time

    from tensorboard.compat.proto.event_pb2 import Event
    from tensorboard.compat.proto.summary_pb2 import Summary

    by_step: dict[int, list[Any]] = {}
    for tag, value, step in events:
        by_step.setdefault(int(step), []).append(Summary.Value(tag=tag, simple_value=value))
    file_writer = writer._get_file_writer()
    now = time.time()
    for step, values in by_step.items():
        file_writer.add_event(Event(summary=Summary(value=values), step=step, wall_time=now))
    writer.flush()


def _csv_batch(
    csv_mon: Any, events: Sequence[tuple[str, float, int]], files: dict[str, Any] | None = None
) -> None:
    # DeepSpeed's csvMonitor format: LOG_DIR/<tag with / and spaces as _>.csv, a
    # "step,<last part of the tag>" header the first time the process writes the file (its
    # ``filenames`` list, which a resume pre-fills), then "step,value" rows.
    by_file: dict[str, tuple[str, list[tuple[int, float]]]] = {}
    for tag, value, step in events:
        name = tag.replace("/", "_").replace(" ", "_")
        by_file.setdefault(name, (tag.split("/")[-1], []))[1].append((step, value))
    for name, (header, rows) in by_file.items():
        fh = None if files is None else files.get(name)
        if fh is None:
            fh = open(f"{csv_mon.log_dir}/{name}.csv", "a+")
            if files is not None:
                files[name] = fh
        try:
            w = csv.writer(fh)
            if name not in csv_mon.filenames:
                csv_mon.filenames.append(name)
                w.writerow(["step", header])
            w.writerows(rows)
        finally:
            if files is None:
                fh.close()
            else:
                fh.flush()  # every batch reaches the file: a crash loses only what is queued


def close_files(files: dict[str, Any]) -> None:
    """Close the CSV files :func:`write_batch` kept open (and forget them)."""
    for fh in files.values():
        fh.close()
    files.clear()


class MetricsSink:
    """Write per-step metrics on rank 0 (other ranks: every call is a no-op).

    ``keep_upto``: the global step the stage starts or resumes from; CSV rows past it (from a
    run that crashed after its last checkpoint) are dropped first. ``flush_every``: events are
    buffered and written every N steps (DeepSpeed's CSV writer opens one file per tag per
    call, its TensorBoard writer flushes each call) and at :meth:`flush` / :meth:`close`.
    """

    def __init__(
        self,
        ds_config: Mapping[str, Any],
        stage_dir: Path,
        engine: Any = None,
        keep_upto: int | None = None,
        samples_per_step: int | None = None,
        tokens_per_sample: int | None = None,
        flush_every: int = 10,
        rank: int | None = None,
        on_disk_full: Callable[[Path, OSError], None] | None = None,
    ) -> None:
        if rank is None:
            from wonderland_ds.core import distributed as dist

            rank = dist.rank()
        self.active = rank == 0
        self.samples_per_step, self.tokens = samples_per_step, tokens_per_sample
        self.flush_every = max(1, flush_every)
        self.pending: list[tuple[str, float, int]] = []
        self.notes: list[str] = []
        self.csv_dir: Path | None = None
        self.tb_dir: Path | None = None
        self.monitor: Any = None
        self.own_monitor = False
        self.error: BaseException | None = None
        self.on_disk_full = on_disk_full  # a full disk stops the stage (the others are reported)
        self._queue: queue.Queue[list[tuple[str, float, int]] | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self._prev: tuple[int, float, float] | None = None  # previous row: step, samples, wall
        self._files: dict[str, Any] = {}  # CSV files kept open (the writer thread's)
        if not self.active:
            return
        own = getattr(engine, "monitor", None)
        if own is not None and getattr(own, "enabled", False):
            self.monitor = own
            self.notes.append("writing through the engine's DeepSpeed monitor (config sections)")
        else:
            from deepspeed.monitor.config import get_monitor_config
            from deepspeed.monitor.monitor import MonitorMaster

            sections = monitor_sections(ds_config, stage_dir)
            if not tensorboard_available() and not sections["tensorboard"].get("enabled"):
                self.notes.append("tensorboard is not installed: CSV only")
            self.monitor = MonitorMaster(get_monitor_config(sections))
            self.own_monitor = True
        csv_mon = getattr(self.monitor, "csv_monitor", None)
        if csv_mon is not None and getattr(csv_mon, "log_dir", None):
            self.csv_dir = Path(csv_mon.log_dir)
            self._prepare_csv(csv_mon, keep_upto)
        writer = self._tb_writer()
        if writer is not None:
            self.tb_dir = Path(writer.log_dir)
            if keep_upto is not None:
                self._tb_restart(keep_upto)
        # A thread writes the events (batched: write_batch), so the step loop only queues.
        self._thread = threading.Thread(target=self._drain, name="wonderland-metrics", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        while True:
            batch = self._queue.get()
            try:
                if batch is None:
                    return
                if self.error is None:
                    write_batch(self.monitor, batch, self._files)
            except Exception as exc:  # noqa: BLE001 - reported by close(), never kills training
                self.error = exc
                if self.on_disk_full is not None and disk_error(exc):
                    assert isinstance(exc, OSError)
                    self.on_disk_full(self.csv_dir or self.tb_dir or Path("."), exc)
            finally:
                self._queue.task_done()

    def _tb_writer(self) -> Any:
        return getattr(getattr(self.monitor, "tb_monitor", None), "summary_writer", None)

    def _tb_restart(self, keep_upto: int) -> None:
        """TensorBoard's restart marker (what ``SummaryWriter(purge_step=...)`` writes, which
        DeepSpeed's writer does not pass): readers drop every event at a later step from
        earlier files, so a resumed or rolled-back run shows one consistent curve."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        writer = self._tb_writer()
        if writer is not None:
            start = SessionLog(status=SessionLog.START)
            writer._get_file_writer().add_event(Event(step=keep_upto + 1, session_log=start))

    # ------------------------------------------------------------ CSV resume

    def _prepare_csv(self, csv_mon: Any, keep_upto: int | None) -> None:
        """Drop rows past ``keep_upto``; tell DeepSpeed's writer which files already have a
        header (it writes one whenever a file is new to the process, even when appending)."""
        assert self.csv_dir is not None
        for path in sorted(self.csv_dir.glob("*.csv")):
            if keep_upto is not None:
                self._truncate(path, keep_upto)
            names = getattr(csv_mon, "filenames", None)
            if isinstance(names, list) and path.stem not in names:
                names.append(path.stem)

    @staticmethod
    def _truncate(path: Path, keep_upto: int) -> None:
        with open(path, newline="") as fh:
            rows = list(csv.reader(fh))
        if not rows:
            return
        head, body = rows[0], rows[1:]
        kept = [r for r in body if r and r[0].lstrip("-").isdigit() and int(r[0]) <= keep_upto]
        if len(kept) != len(body):
            with open(path, "w", newline="") as fh:
                w = csv.writer(fh)
                w.writerow(head)
                w.writerows(kept)

    def rewind(self, step: int) -> None:
        """A rollback reloaded ``step``: drop what was written past it."""
        if not self.active:
            return
        self.pending = [e for e in self.pending if e[2] <= step]
        self.flush()
        self._queue.join()  # everything queued is on disk before the files are cut
        close_files(self._files)  # the writer thread is idle: reopened at the next batch
        if self.csv_dir is not None:
            for path in sorted(self.csv_dir.glob("*.csv")):
                self._truncate(path, step)
        self._tb_restart(step)
        self._prev = None

    # ------------------------------------------------------------ writing

    def events(
        self,
        row: StepRow,
        loss_scale: float | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> list[tuple[str, float, int]]:
        """The (tag, value, step) events for one step's row."""
        step = row.step
        out = []
        for key, tag in ROW_TAGS:
            v = getattr(row, key)
            if v is not None:
                out.append((tag, float(v), step))
        samples, wall, step_s = row.samples, row.wall, row.step_s
        sps = None
        if samples is not None and wall is not None:
            prev = self._prev
            if prev is not None and prev[0] < step and wall > prev[2]:
                sps = (samples - prev[1]) / (wall - prev[2])
            self._prev = (step, float(samples), wall)
        if sps is None and self.samples_per_step and step_s:  # the first row: its own time
            sps = self.samples_per_step / step_s
        if sps is not None:
            out.append((SAMPLES_PER_S, sps, step))
            if self.tokens:
                out.append((TOKENS_PER_S, sps * self.tokens, step))
        if loss_scale is not None:
            out.append((LOSS_SCALE, float(loss_scale), step))
        for tag, v in (extra or {}).items():
            out.append((tag, float(v), step))
        return out

    def write(
        self,
        row: StepRow,
        loss_scale: float | None = None,
        extra: Mapping[str, float] | None = None,
    ) -> None:
        """Queue one step's events (``extra``: e.g. :func:`guard_figures`); written every
        ``flush_every`` steps."""
        if not self.active:
            return
        self.pending += self.events(row, loss_scale, extra)
        if len({e[2] for e in self.pending}) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        """Hand the queued steps to the writer thread."""
        if not self.active or not self.pending:
            return
        events, self.pending = self.pending, []
        self._queue.put(events)

    def close(self) -> None:
        """Write everything, stop the thread, close our own TensorBoard writer. Returns after
        the files are complete; a writer error is printed, not raised (metrics never stop a
        training run)."""
        if not self.active or self._thread is None:
            return
        self.flush()
        self._queue.put(None)
        self._thread.join()
        self._thread = None
        close_files(self._files)
        if self.error is not None:
            import sys

            print(f"[wonderland] metrics writer failed: {self.error!r}", file=sys.stderr)
        writer = self._tb_writer()
        if writer is not None:
            writer.flush()
            if self.own_monitor:  # the engine's writer stays open: the engine owns it
                writer.close()
