"""What a run's record says, checked against what is true: live processes, rank heartbeats,
and the lineage of checkpoints between stages.

* Every rank of a stage writes ``RUN/stageN/heartbeat/rankR.json`` (pid, host, step, time)
  every :data:`INTERVAL_S` from a daemon thread; the front process records its own pid and
  host in the stage's entry (``front``) before it launches.
* A stage recorded ``running`` is ``running`` while one of those processes lives (checked on
  this host) or, for processes on other hosts, while a heartbeat is younger than
  :data:`STALE_AFTER_S`; otherwise it is ``interrupted``: nobody will update it again.
* A stage records the checkpoint it started from (``input_checkpoint``) and the one it ended
  with (``output_checkpoint``). A completed stage whose input is no longer the newest
  complete checkpoint of the stage it came from, or comes from a stage that is stale itself,
  is ``stale``: its result describes a model that is no longer the pipeline's.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import contract as ck

HEARTBEAT = "heartbeat"
INTERVAL_S = 2.0
STALE_AFTER_S = 15.0
"""A heartbeat older than this, from a host whose processes cannot be checked, is dead."""


def host() -> str:
    return socket.gethostname()


class Heartbeat:
    """A rank's heartbeat file, rewritten every ``interval`` seconds by a daemon thread.
    ``step`` is set by the step loop (a plain attribute: no lock, no cost)."""

    def __init__(self, stage_dir: Path, rank: int, interval: float = INTERVAL_S) -> None:
        self.path = stage_dir / HEARTBEAT / f"rank{rank}.json"
        self.rank, self.interval, self.step = rank, interval, None
        self.left: str | None = None
        self.watch: PeerWatch | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wonderland-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> bool:
        body = {"rank": self.rank, "pid": os.getpid(), "host": host(), "step": self.step}
        body["time"] = time.time()
        if self.left is not None:
            body["left"] = self.left
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
        except OSError:
            return False  # a full or gone disk must not kill the rank; status shows the age
        return True

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            wrote = self.beat()
            if self.watch is not None and not self._stop.is_set():
                self.watch.look(wrote)

    def stop(self, how: str = "ok") -> None:
        """This rank leaves (``ok`` or ``failed``): its last beat says so, so the peers that
        watch it do not take its silence for a lost host."""
        self._stop.set()
        self.left = how
        self.beat()


class PeerWatch:
    """The heartbeats of the other ranks of a multi-host stage, read from the shared run folder
    on each beat: a peer whose file stopped changing for ``timeout_s`` (measured on this
    host's monotonic clock, so clocks that differ between hosts do not matter) and did not
    say it left is lost. Only peers seen beating during this launch are judged (a file left by
    an earlier launch is not), and only while this rank's own beats are written (a shared
    folder that stalls for everyone names nobody)."""

    def __init__(
        self,
        folder: Path,
        rank: int,
        world: int,
        timeout_s: float,
        on_lost: Any,
        clock: Any = time.monotonic,
    ) -> None:
        self.folder, self.rank, self.world = folder, rank, world
        self.timeout_s, self.on_lost, self.clock = timeout_s, on_lost, clock
        self.seen: dict[int, tuple[float, float, dict[str, Any]]] = {}
        """peer -> (its beat's time, when this rank saw that value first, the beat)."""
        self.live: set[int] = set()
        self.last_look: float | None = None
        self.fired = False

    def look(self, own_written: bool = True) -> list[dict[str, Any]]:
        """Read the peers once; the lost ones (each with ``silent_s``), handed to ``on_lost``
        the first time any is found."""
        now = self.clock()
        # Not looking for a while (this thread starved, the folder stalled) is not silence.
        gap = self.last_look is not None and now - self.last_look > self.timeout_s / 2
        self.last_look = now
        lost = []
        for peer in range(self.world):
            if peer == self.rank:
                continue
            try:
                beat = json.loads((self.folder / f"rank{peer}.json").read_text())
                value = float(beat["time"])
            except (OSError, ValueError, KeyError, TypeError):
                continue
            before = self.seen.get(peer)
            if before is None or before[0] != value or gap or not own_written:
                if before is not None and before[0] != value:
                    self.live.add(peer)  # it beat while this rank watched: this launch's
                self.seen[peer] = (value, now, beat)
                continue
            if peer in self.live and not beat.get("left") and now - before[1] > self.timeout_s:
                lost.append({**beat, "silent_s": round(now - before[1], 1)})
        if lost and not self.fired:
            self.fired = True
            self.on_lost(lost)
        return lost


def heartbeats(stage_dir: Path) -> list[dict[str, Any]]:
    out = []
    for path in sorted((stage_dir / HEARTBEAT).glob("rank*.json")):
        try:
            out.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return out


def pid_alive(pid: Any, on: Any) -> bool | None:
    """True/False for a process on this host (a zombie is dead); None for another host."""
    if on != host():
        return None
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state not in ("Z", "X")


def live(stage_dir: Path, entry: dict[str, Any], now: float | None = None) -> dict[str, Any]:
    """The true state of a stage recorded ``running``: ``running`` or ``interrupted``, with
    the age of its newest heartbeat."""
    now = time.time() if now is None else now
    beats = heartbeats(stage_dir)
    newest = max((b.get("time", 0.0) for b in beats), default=None)
    age = None if newest is None else round(now - newest, 1)
    front = entry.get("front") or {}
    here = pid_alive(front.get("pid"), front.get("host")) if front.get("pid") else False
    for b in beats:
        if b.get("left"):
            continue  # its last beat said it left
        alive = pid_alive(b.get("pid"), b.get("host"))
        if alive is None:  # another host: its heartbeat's age tells
            alive = now - float(b.get("time", 0.0)) < STALE_AFTER_S
        here = here or alive
    running = bool(here)
    return {"state": "running" if running else "interrupted", "heartbeat_age_s": age}


def checkpoint_id(tag_dir: Path) -> str | None:
    """A complete checkpoint's identity: the sha256 of its metadata file (written last, with
    its completion time and every file's digest)."""
    import hashlib

    try:
        return hashlib.sha256((tag_dir / ck.META).read_bytes()).hexdigest()
    except OSError:
        return None


def _stage_of(tag_dir: str) -> tuple[Path, str] | None:
    """(run dir, stage number) of a checkpoint path ``RUN/stageN/checkpoints/global_stepK``."""
    p = Path(tag_dir)
    if p.parent.name != "checkpoints" or not p.parent.parent.name.startswith("stage"):
        return None
    number = p.parent.parent.name[len("stage") :]
    return (p.parent.parent.parent, number) if number.isdigit() else None


def stale(run_dir: Path, stages: dict[str, dict[str, Any]]) -> dict[str, str]:
    """Completed stages whose input is no longer their source stage's newest output:
    stage number -> why."""
    out: dict[str, str] = {}
    newest: dict[str, tuple[str, str | None] | None] = {}

    def newest_of(n: str) -> tuple[str, str | None] | None:
        if n not in newest:
            found = ck.newest_complete(run_dir / f"stage{n}" / "checkpoints", deep=False)
            newest[n] = (
                (str(found.tag_dir.resolve()), checkpoint_id(found.tag_dir)) if found else None
            )
        return newest[n]

    for key in sorted(stages, key=int):
        entry = stages[key]
        source = entry.get("input_checkpoint")
        if entry.get("status") != "ok" or not source:
            continue
        where = _stage_of(source)
        if where is None or where[0].resolve() != run_dir.resolve():
            continue  # started from outside this run: nothing here can make it stale
        n = where[1]
        now = newest_of(n)
        ident = entry.get("input_checkpoint_id")
        if n in out:
            out[key] = f"it started from stage {n}, which is stale"
        elif now is None or now[0] != str(Path(source).resolve()):
            out[key] = (
                f"it started from {Path(source).name} of stage {n}; stage {n}'s newest"
                f" complete checkpoint is now {Path(now[0]).name if now else 'none'}"
            )
        elif ident is not None and now[1] != ident:
            out[key] = (
                f"it started from {Path(source).name} of stage {n}, which has been saved"
                " again since (another attempt)"
            )
    return out


def true_states(run_dir: Path, data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Per stage: ``state`` (running, interrupted, failed, done, stale, refused, gate-failed,
    guard-stopped) and, where it applies, ``heartbeat_age_s`` or ``stale_because``."""
    stages = data.get("stages") or {}
    why_stale = stale(run_dir, stages)
    out = {}
    for key, entry in stages.items():
        status = entry.get("status")
        if status in ("running", "restarting"):
            got = live(run_dir / f"stage{key}", entry)
        elif status == "ok":
            got = {"state": "stale", "stale_because": why_stale[key]} if key in why_stale else {}
            got.setdefault("state", "done")
        else:
            got = {"state": status}
        out[key] = got
    return out
