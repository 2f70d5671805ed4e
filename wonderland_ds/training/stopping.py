"""Stopping a stage at a step every rank agrees on, when a signal or the time limit asks.

A signal reaches ranks at different moments (or only one of them, or only the front process),
so no rank acts on its own: every step starts one all-reduce of this rank's stop flags, small
and asynchronous, and waits for it when the step is done, by which time it has long arrived
(:class:`StopAgreement`). A request seen before step k starts is known to every rank when step
k ends, and the stage saves there: at most one step is trained after a signal, none is lost.
Rank 0 also watches for what the front process was asked (a request file) and for the job's
end time (:class:`StopWatch`), and raises the flag itself when the time left would not hold a
step, a save and the exit.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.config.settings import Preemption
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.signals import StopRequest, StopSignals
from wonderland_ds.core.slurm import Allocation
from wonderland_ds.training.callbacks import Callback

#: The front process's stop request for the stage's ranks (``RUN/stageN/stop-request.json``).
REQUEST_FILE = "stop-request.json"
#: Slots of the flag vector, reduced with MAX over ranks: who asked (1 or 0), and the place
#: of a bad token the next step would read (1 + file << 40 | offset), or 0.
_SLOTS = ("SIGTERM", "SIGUSR1", "time-limit", "front", "disk-full", "bad-data")
_BAD = _SLOTS.index("bad-data")
#: What the next step's data is checked with: (global step) -> (finding, place) or None.
Lookahead = Callable[[int], "tuple[Any, int] | None"]
#: A bad place turned back into its finding (every rank reads the id itself).
Describe = Callable[[int], Any]
EXIT_ALLOWANCE_S = 15.0
"""The exit after the stop's save: metrics, run.json, the process group's teardown."""
ASSUMED_WRITE_BPS = 100e6
"""Before a stage's first save, its save time assumes this write speed."""


def request_path(stage_dir: Path) -> Path:
    return stage_dir / REQUEST_FILE


def write_request(stage_dir: Path, stop: StopRequest) -> None:
    """The front process asks the stage's ranks to stop (rank 0 reads it within a second)."""
    from wonderland_ds.core.files import atomic_write_text

    stage_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_text(request_path(stage_dir), json.dumps(stop.to_dict()))


class StopWatch:
    """Rank 0's daemon thread: the front's request file (every ``poll_s``) and the job's end
    time (every ``end_poll_s``, from ``squeue``)."""

    def __init__(
        self,
        signals: StopSignals,
        stage_dir: Path,
        alloc: Allocation | None,
        end_poll_s: float,
        poll_s: float = 0.5,
    ) -> None:
        self.signals, self.path = signals, request_path(stage_dir)
        self.alloc, self.end_poll_s, self.poll_s = alloc, end_poll_s, poll_s
        self.end_time: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wonderland-stopwatch", daemon=True)

    def start(self) -> StopWatch:
        if self.alloc is not None:
            self.end_time = self.alloc.end_time()
        self._thread.start()
        return self

    def _run(self) -> None:
        last_end = time.monotonic()
        while not self._stop.wait(self.poll_s):
            if not self.signals.requested and self.path.exists():
                try:
                    body = json.loads(self.path.read_text())
                    got = StopRequest.from_dict(body)
                except (OSError, ValueError):
                    continue
                self.signals.request(
                    StopRequest("front", got.signal, got.at, f"{got.describe()}, sent to the front")
                )
            if self.alloc is not None and time.monotonic() - last_end >= self.end_poll_s:
                last_end = time.monotonic()
                self.end_time = self.alloc.end_time() or self.end_time

    def close(self) -> None:
        self._stop.set()


class StopAgreement(Callback):
    """The stop flag's per-step all-reduce, and the time limit's check on rank 0.

    ``save_s``: the last complete save's duration (rank 0's Saver), for the time-limit margin;
    ``state_bytes``: this rank's model and optimizer state, for the margin before any save."""

    def __init__(
        self,
        signals: StopSignals,
        settings: Preemption,
        stage_dir: Path,
        save_s: Callable[[], float | None],
        state_bytes: int,
        alloc: Allocation | None = None,
    ) -> None:
        self.signals, self.settings, self.stage_dir = signals, settings, stage_dir
        self.save_s, self.state_bytes = save_s, state_bytes
        self.alloc = alloc if settings.time_limit_stop else None
        self.main = dist.is_main()
        self.flags = torch.zeros(len(_SLOTS), dtype=torch.float64)
        self.work: Any = None
        self.watch: StopWatch | None = None
        self.lookahead: Lookahead | None = None  # the trainer's check of a step's data
        self.describe: Describe | None = None
        self.end: int | None = None  # the stage's last step: nothing to look ahead past it
        self.bad: tuple[Any, int] | None = None  # this rank's refused data, once found
        self.t_step: float | None = None
        self.recent: list[float] = []  # the last step times (rank 0: the time-limit margin)

    # ------------------------------------------------------------ callback events

    def on_start(self) -> None:
        if self.main:
            self.watch = StopWatch(
                self.signals, self.stage_dir, self.alloc, self.settings.end_time_poll_s
            ).start()

    def pre_step(self, step: int) -> None:
        now = time.perf_counter()
        if self.t_step is not None:
            self.recent = [*self.recent[-19:], now - self.t_step]
        self.t_step = now
        if self.main:
            self._check_time_limit()
        self._look(step + 2)  # the step after the one starting now
        self.work = dist.all_reduce_max_start(self._local_flags())

    def on_close(self) -> None:
        if self.watch is not None:
            self.watch.close()
        if self.work is not None:
            self.work.wait()  # no collective left in flight behind the loop
            self.work = None

    # ------------------------------------------------------------ agreement

    def at_start(self, first: int) -> StopRequest | None:
        """Before the first step (global step ``first + 1``): a request that came while the
        stage started, or refused data in that step (blocking, once)."""
        self._look(first + 1)
        flags = self._local_flags()
        dist.all_reduce_max(flags)
        return self._agreed(flags)

    def _look(self, step: int) -> None:
        if self.bad is None and self.lookahead is not None and (self.end or step) >= step:
            self.bad = self.lookahead(step)

    def agreed(self) -> StopRequest | None:
        """After a step: the request every rank now knows of (the same on every rank), or
        None. Waits for the all-reduce the step started."""
        if self.work is None:
            return None
        self.work.wait()
        self.work = None
        return self._agreed(self.flags)

    def _local_flags(self) -> torch.Tensor:
        self.flags.zero_()
        first = self.signals.first
        if first is not None:
            slot = first.signal if first.reason == "signal" else first.reason
            self.flags[_SLOTS.index(slot) if slot in _SLOTS else 0] = 1.0
        if self.bad is not None:
            self.flags[_BAD] = float(1 + self.bad[1])
        return self.flags

    def _agreed(self, flags: torch.Tensor) -> StopRequest | None:
        got = flags.tolist()
        if not any(got):
            return None
        if got[_BAD]:
            # Every rank turns the same place into the same finding (it reads the id itself).
            place = int(got[_BAD]) - 1
            finding = self.bad[0] if self.bad is not None and self.bad[1] == place else None
            if finding is None and self.describe is not None:
                finding = self.describe(place)
            detail = finding.message if finding is not None else "refused data"
            return StopRequest("bad-data", None, time.time(), detail, finding)
        mine = self.signals.first
        disk = got[_SLOTS.index("disk-full")]
        if disk and (mine is None or mine.reason != "disk-full"):
            return StopRequest("disk-full", None, time.time(), "the disk is full on another rank")
        if mine is not None:
            return mine
        slot = _SLOTS[next(i for i, c in enumerate(got) if c)]
        if slot in ("SIGTERM", "SIGUSR1"):
            return StopRequest("signal", slot, time.time(), f"{slot} on another rank")
        return StopRequest(slot, None, time.time(), f"{slot}, seen by rank 0")

    # ------------------------------------------------------------ time limit

    def margin_s(self) -> float:
        """How long before the job's end the stage stops: configured, else twice the slowest
        recent step, the last save's full time (or the state at 100 MB/s), and the exit."""
        if self.settings.stop_margin_s is not None:
            return self.settings.stop_margin_s
        step = max(self.recent, default=0.0)
        save = self.save_s()
        if save is None:
            save = self.state_bytes / ASSUMED_WRITE_BPS
        return 2 * step + save + EXIT_ALLOWANCE_S

    def _check_time_limit(self) -> None:
        if self.signals.requested or self.watch is None or self.watch.end_time is None:
            return
        left = self.watch.end_time - time.time()
        margin = self.margin_s()
        if left <= margin:
            self.signals.request(
                StopRequest(
                    "time-limit",
                    None,
                    time.time(),
                    f"the job's time limit ({left:.0f} s left, {margin:.0f} s needed to save and exit)",
                )
            )
