"""Signals that ask a stage to stop at a step, saved: SIGTERM (scancel, preemption, a
Slurm time limit, Kubernetes, torchrun) and SIGUSR1 (Slurm's ``--signal`` warning).

A :class:`StopSignals` remembers the first such signal (or a stop asked for otherwise: the
job's time limit, the front process) and nothing more; the step loop decides when to act on
it, with every rank (``training/stopping.py``). Later ones are counted and ignored: DeepSpeed's
launcher and ``srun`` pass on the signal a rank already got. SIGINT keeps Python's meaning (a
KeyboardInterrupt: stop now, unsaved; the newest complete checkpoint stays ``latest``).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

#: The signals that stop a stage at a step, saved.
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

_WHY = {
    signal.SIGTERM: "SIGTERM (scancel, preemption, a time limit or the launcher)",
    signal.SIGUSR1: "SIGUSR1 (Slurm's warning signal)",
}


@dataclass(frozen=True)
class StopRequest:
    """Why a stage was asked to stop, and when (Unix time)."""

    reason: str
    """``signal``, ``time-limit``, ``front`` (the launching process got the signal) or
    ``bad-data`` (the next step's data is refused: exit 2)."""
    signal: str | None
    """``SIGTERM``, ``SIGUSR1``; None for the time limit."""
    at: float
    detail: str = ""
    finding: Any = None
    """``bad-data``: the finding that names the file, offset and id."""

    @property
    def requeue_wanted(self) -> bool:
        """A stop the job should come back from by itself: Slurm's warning signal or the
        time limit (not a scancel, which also sends SIGTERM)."""
        return self.reason == "time-limit" or self.signal == "SIGUSR1"

    def describe(self) -> str:
        return self.detail or self.reason

    def to_dict(self) -> dict[str, Any]:
        return {"reason": self.reason, "signal": self.signal, "at": self.at, "detail": self.detail}

    @classmethod
    def from_dict(cls, body: dict[str, Any]) -> StopRequest:
        return cls(
            str(body.get("reason", "signal")),
            body.get("signal"),
            float(body.get("at", time.time())),
            str(body.get("detail", "")),
        )


def for_signal(signum: int, reason: str = "signal") -> StopRequest:
    name = signal.Signals(signum).name
    return StopRequest(reason, name, time.time(), _WHY.get(signal.Signals(signum), name))


class StopSignals:
    """This process's stop request: set by the first stop signal (or :meth:`request`), read
    by the step loop. ``on_first``: called, in the handler, with the first request (the front
    forwards it; eval stages raise)."""

    def __init__(self, on_first: Callable[[StopRequest], None] | None = None) -> None:
        self.first: StopRequest | None = None
        self.repeats = 0
        self.on_first = on_first
        self._previous: dict[int, Any] = {}

    def install(self) -> StopSignals:
        """Handle the stop signals in this process (main thread only)."""
        for sig in STOP_SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def restore(self) -> None:
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)
        self._previous.clear()

    def __enter__(self) -> StopSignals:
        return self.install()

    def __exit__(self, *exc: object) -> None:
        self.restore()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        self.request(for_signal(signum))

    def request(self, stop: StopRequest) -> None:
        """Ask for a stop (signal handler, time-limit watcher, front request); the first
        one counts."""
        if self.first is not None:
            self.repeats += 1
            return
        self.first = stop
        if self.on_first is not None:
            self.on_first(stop)

    @property
    def requested(self) -> bool:
        return self.first is not None
