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
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="wonderland-heartbeat", daemon=True)

    def start(self) -> Heartbeat:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.beat()
        self._thread.start()
        return self

    def beat(self) -> None:
        body = {"rank": self.rank, "pid": os.getpid(), "host": host(), "step": self.step}
        body["time"] = time.time()
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        try:
            tmp.write_text(json.dumps(body))
            os.replace(tmp, self.path)
        except OSError:
            pass  # a full or gone disk must not kill the rank; status shows the age

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.beat()

    def stop(self) -> None:
        self._stop.set()


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
