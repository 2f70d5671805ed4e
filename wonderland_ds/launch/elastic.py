"""A node lost mid-stage: the stage goes on on the nodes left, with the same global batch, and
grows back when it is next started on more (``--min-nodes``, ``wonderland.elastic``).

The ranks find the loss (``run/liveness.PeerWatch``: a peer's heartbeat stops changing) and
leave at once; the front then asks the lost hosts whether they still answer, leaves out the
ones that do not, and relaunches from the newest complete checkpoint, resharded at load time.
Gradient accumulation is derived so that micro batch x accumulation x ranks is the
checkpoint's global batch again; a world that cannot keep it ends the stage.
"""

from __future__ import annotations

import csv
import socket
import subprocess
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.run import failures

#: How long a launcher may take to return after its ranks left for a lost peer before the front
#: ends it (pdsh waits for the lost host's ssh session, srun for its step daemon).
LAUNCHER_GRACE_S = 10.0
#: How long a lost host gets to answer before it is left out of the relaunch.
PROBE_TIMEOUT_S = 5


class ElasticEvent(BaseModel):
    """One change of a stage's nodes, as ``run.json``'s ``elastic`` list records it."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    """``shrink`` (a node lost, the stage relaunched on the others) or ``grow`` (started again
    on more nodes than its checkpoint was saved on)."""
    at: str
    hosts: list[str]
    """The hosts the stage runs on from here."""
    lost_hosts: list[str] = []
    """Shrink: the hosts left out (they stopped beating and did not answer)."""
    last_heartbeat: str | None = None
    """Shrink: the lost ranks' last heartbeat."""
    last_heartbeat_step: int | None = None
    from_world: int
    to_world: int
    global_batch: int
    grad_acc: list[int]
    """Gradient accumulation before and after (the micro batch is kept)."""
    resumed_from_step: int | None = None
    steps_lost: int | None = None
    """Shrink: steps trained after the newest complete checkpoint, trained again."""
    detect_s: float | None = None
    """Shrink: from the last heartbeat to the first rank leaving for it."""
    relaunch_s: float | None = None
    """Shrink: from the last heartbeat to the relaunch (the ranks gone, the hosts asked)."""
    load_s: float | None = None
    """The relaunched stage's checkpoint load, resharded (the slowest rank)."""
    training_again_s: float | None = None
    """From the last heartbeat (shrink) or the launch (grow) to the first step trained."""


def min_nodes(args: Any, settings: Any) -> int | None:
    flag = getattr(args, "min_nodes", None)
    return flag if flag is not None else settings.elastic.min_nodes


def answers(host: str, slurm: bool, timeout: int = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host`` still runs a command: ssh for a hostfile's host, a one-task step for a
    Slurm node (``--overlap``: it needs no free resources)."""
    if host in (socket.gethostname(), "localhost", "127.0.0.1"):
        return True
    if slurm:
        cmd = ["srun", "--overlap", "-N1", "-n1", f"--nodelist={host}", "true"]
    else:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", host, "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout + 2).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def grad_acc_for(meta: Any, world: int, config: str) -> int:
    """The accumulation that keeps the checkpoint's global batch on ``world`` ranks (its
    micro batch kept); Refused when none does."""
    tb, micro = meta.train_batch, meta.micro_batch
    if not tb or not micro:
        raise Refused(
            Finding(
                "elastic-batch",
                "error",
                "the checkpoint does not record its global and micro batch: the world size"
                " cannot change with the same recipe",
                "resume it on its own world size",
                config,
            )
        )
    if tb % (micro * world):
        keep = [w for w in range(1, tb // micro + 1) if tb % (micro * w) == 0]
        raise Refused(
            Finding(
                "elastic-batch",
                "error",
                f"the global batch {tb} (micro batch {micro}) cannot be kept on {world} ranks:"
                f" {tb} is not a multiple of {micro} x {world}; continuing would train another"
                " recipe",
                f"run on a world size that keeps it ({', '.join(map(str, keep))} ranks), or"
                " resume by hand with the batch you mean",
                config,
                "train_batch_size",
            )
        )
    return tb // (micro * world)


def newest_meta(run_dir: Path, stage: int) -> tuple[Any, Any] | None:
    """(verdict, metadata) of the stage's newest complete checkpoint, or None."""
    newest = ck.newest_complete(run_dir / f"stage{stage}" / "checkpoints", deep=False)
    if newest is None:
        return None
    meta = ck.read_meta(newest.tag_dir)
    return (newest, meta) if meta is not None else None


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def first_step_wall(stage_dir: Path, after_step: int) -> float | None:
    """The wall time of the first step after ``after_step`` in the stage's metrics.csv."""
    try:
        with (stage_dir / "metrics.csv").open() as fh:
            for row in csv.DictReader(fh):
                try:
                    if int(row["step"]) > after_step and row.get("wall"):
                        return float(row["wall"])
                except (KeyError, ValueError):
                    continue
    except OSError:
        return None
    return None


class LaunchWatch:
    """While a launcher runs: once a rank left for a lost peer, the launcher gets
    :data:`LAUNCHER_GRACE_S` to return, then the front ends it (its ranks are gone; only the
    wait for the lost host's session is left)."""

    def __init__(self, stage_dir: Path, since: float, sup: Any) -> None:
        self.stage_dir, self.since, self.sup = stage_dir, since, sup
        self.left_at: float | None = None
        self.ended = False
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="wonderland-launch-watch", daemon=True
        )

    def __enter__(self) -> LaunchWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._done.wait(0.5):
            if self.left_at is None:
                got = [r for r in failures.read(self.stage_dir, self.since) if r.lost]
                if got:
                    self.left_at = min(r.time for r in got)
                continue
            proc = self.sup.proc
            if proc is None or proc.poll() is not None:
                continue
            if time.time() - self.left_at > LAUNCHER_GRACE_S:
                self.ended = True
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                return
