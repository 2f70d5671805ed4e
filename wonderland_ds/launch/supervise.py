"""The front process while a stage's launcher runs: stop signals passed on, the ranks waited
for, the Slurm job requeued after a stop that asks for it.

A stop signal may reach only the front (``kill`` of its pid, Kubernetes' PID 1, Slurm's
``B:USR1`` warning to the batch shell that ``exec``'d it), only the ranks (``srun`` steps'
``--signal``), or every process (``scancel``, a preemption, the time limit: Slurm signals the
whole job). So the front passes on what it gets: a request file rank 0 reads within a second
(whatever the launcher), and SIGUSR1 to ``srun``, which forwards it to every task. It never
sends SIGTERM on: ``srun`` answers one by SIGKILLing its tasks at once, and DeepSpeed's
runner has no handler for it and dies, orphaning the ranks' output. A launcher that returns while ranks still save (DeepSpeed's runner killed
by a job-wide SIGTERM) is not the end: the front waits for the ranks themselves.
"""

from __future__ import annotations

import signal
import subprocess
import time
from pathlib import Path

from wonderland_ds.core.findings import Stopped
from wonderland_ds.core.signals import StopRequest, StopSignals
from wonderland_ds.core.slurm import Allocation
from wonderland_ds.run import liveness

#: How long the front waits for ranks still alive after their launcher returned: beyond
#: Slurm's default KillWait (30 s) and DeepSpeed's own 30 s before it SIGKILLs its children.
RANK_WAIT_S = 90.0


class Supervisor:
    """The front's stop signals for one command (``train`` or ``pipeline``): before a launch a
    signal stops the command (nothing launched); during one it is passed on to the stage."""

    def __init__(self) -> None:
        self.signals = StopSignals(on_first=self._on_first)
        self.proc: subprocess.Popen[bytes] | None = None
        self.stage_dir: Path | None = None
        self.srun = False
        self.armed = True  # a signal now stops the command at once (no launch is running)
        # The job's end as scheduled, read now: once a job is cancelled Slurm reports the
        # moment of the cancel as its end time.
        alloc = Allocation.from_env()
        self.job_end = alloc.end_time() if alloc is not None else None

    def __enter__(self) -> Supervisor:
        self.signals.install()
        return self

    def __exit__(self, *exc: object) -> None:
        self.signals.restore()

    @property
    def stop(self) -> StopRequest | None:
        return self.signals.first

    def arm(self) -> None:
        """Before a launch: a stop that came already, or comes now, stops the command."""
        self.armed = True
        if self.signals.first is not None:
            raise Stopped(self.signals.first)

    def launching(self, stage_dir: Path, srun: bool) -> None:
        """The stage's launcher starts next: a stop from now on is passed on to it."""
        self.armed = False
        self.stage_dir, self.srun = stage_dir, srun

    def attach(self, proc: subprocess.Popen[bytes]) -> None:
        """The launcher runs: a stop that came meanwhile is passed on now."""
        self.proc = proc
        if self.signals.first is not None:
            self._pass_on(self.signals.first)

    def detach(self) -> None:
        """The launcher returned: a stop from now on is only remembered (the command reads
        the stage's record, then looks)."""
        self.proc = None

    def _on_first(self, stop: StopRequest) -> None:
        if self.armed:
            raise Stopped(stop)  # before a launch: nothing runs, nothing to save
        if self.proc is not None:
            self._pass_on(stop)

    def _pass_on(self, stop: StopRequest) -> None:
        from wonderland_ds.training.stopping import write_request

        assert self.stage_dir is not None
        write_request(self.stage_dir, stop)
        if self.srun and self.proc is not None and self.proc.poll() is None:
            if stop.signal == "SIGUSR1":  # srun forwards it to every task
                self.proc.send_signal(signal.SIGUSR1)


def clear_request(stage_dir: Path) -> None:
    """A launch starts without the previous one's stop request."""
    from wonderland_ds.training.stopping import request_path

    request_path(stage_dir).unlink(missing_ok=True)


def wait_for_ranks(stage_dir: Path, since: float, timeout: float = RANK_WAIT_S) -> bool:
    """Wait until no rank of the launch started at ``since`` lives (processes on this host,
    heartbeats younger than liveness' limit elsewhere). True when none is left."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = False
        for beat in liveness.heartbeats(stage_dir):
            if float(beat.get("time", 0.0)) < since:
                continue  # an earlier launch's rank
            here = liveness.pid_alive(beat.get("pid"), beat.get("host"))
            if here is None:
                here = time.time() - float(beat.get("time", 0.0)) < liveness.STALE_AFTER_S
            alive = alive or bool(here)
        if not alive:
            return True
        time.sleep(0.5)
    return False
