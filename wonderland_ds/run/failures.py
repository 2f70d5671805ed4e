"""Which rank failed first, and why: each failing rank records its own error; the front reads
them after the launch and names the first failure, calling the peers' lost connections what
they are, consequences.

A rank that fails writes ``RUN/stageN/failures/rankR.json`` (host, pid, time, the exception's
type and first line, and whether it is a lost connection or timeout: a consequence of another
rank's failure). A rank killed by a signal (SIGKILL, the OOM killer, SIGBUS) writes nothing:
its heartbeat's dead pid tells. Tracebacks stay in each rank's log file.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from wonderland_ds.core.files import atomic_write_text

FOLDER = "failures"
#: Error texts that say a peer went away or went silent: a consequence, not a cause.
CONSEQUENCES = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "timed out",
    "timeout",
    "connection refused",
    "pair closure",
    "aborted",
    "socket closed",
)


class LostPeer(BaseModel):
    """A peer rank whose heartbeat stopped, as the rank that watched it saw it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    host: str
    step: int | None = None
    """The step its last heartbeat gave."""
    last_beat: float
    """Its last heartbeat's time (its own clock)."""
    silent_s: float
    """How long the watcher saw its heartbeat unchanged."""


class FailureRecord(BaseModel):
    """One rank's failure, as it recorded it."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    rank: int
    host: str
    pid: int
    time: float
    error: str
    """``Type: first line of the message``."""
    consequence: bool
    """A lost connection or a timeout: what a rank sees when another one failed."""
    lost: list[LostPeer] = []
    """The peers whose heartbeat this rank saw stop (it left because of them)."""


def consequence(text: str) -> bool:
    low = text.lower()
    return any(c in low for c in CONSEQUENCES)


_recorded = False


def _write(stage_dir: Path, rank: int, error: str, **fields: object) -> None:
    """This rank's record, written atomically (never raises: a full disk must not hide the
    failure itself)."""
    global _recorded
    body = FailureRecord(
        rank=rank,
        host=socket.gethostname(),
        pid=os.getpid(),
        time=time.time(),
        error=error,
        **fields,  # type: ignore[arg-type]
    )
    try:
        folder = stage_dir / FOLDER
        folder.mkdir(parents=True, exist_ok=True)
        atomic_write_text(folder / f"rank{rank}.json", body.model_dump_json())
        _recorded = True
    except OSError:
        pass


def record(stage_dir: Path, rank: int, exc: BaseException, text: str | None = None) -> None:
    """This rank failed with ``exc`` (``text``: a better explanation of it, such as which rank
    a timeout waited for): write its record (never raises)."""
    first = (str(exc).strip().splitlines() or [""])[0][:400]
    error = text or (f"{type(exc).__name__}: {first}" if first else type(exc).__name__)
    _write(stage_dir, rank, error, consequence=consequence(error))


def record_lost(stage_dir: Path, rank: int, beats: list[dict]) -> list[LostPeer]:
    """This rank leaves because the peers of ``beats`` stopped beating: its record names
    them (never raises)."""
    lost = [
        LostPeer(
            rank=int(b.get("rank", -1)),
            host=str(b.get("host")),
            step=b.get("step"),
            last_beat=float(b.get("time", 0.0)),
            silent_s=float(b.get("silent_s", 0.0)),
        )
        for b in beats
    ]
    names = ", ".join(f"rank {p.rank} ({p.host})" for p in lost)
    error = (
        f"no heartbeat from {names} for {max(p.silent_s for p in lost):.0f} s: its host is lost"
        " or the process frozen"
    )
    _write(stage_dir, rank, error, consequence=True, lost=lost)
    return lost


def recorded() -> bool:
    """Whether this process wrote its record (else the rank entry's last resort writes one)."""
    return _recorded


def read(stage_dir: Path, since: float) -> list[FailureRecord]:
    out = []
    for path in sorted((stage_dir / FOLDER).glob("rank*.json")):
        try:
            got = FailureRecord.model_validate_json(path.read_text())
        except (OSError, ValidationError):
            continue
        if got.time >= since:
            out.append(got)
    return sorted(out, key=lambda r: r.time)


def clear(stage_dir: Path) -> None:
    for path in (stage_dir / FOLDER).glob("rank*.json"):
        path.unlink(missing_ok=True)


class FirstFailure(BaseModel):
    model_config = ConfigDict(frozen=True)

    rank: int | None
    host: str | None
    summary: str
    lost: list[LostPeer] = []
    """Peers whose heartbeat stopped (a lost host), as the ranks that left saw them."""


def first_failure(
    stage_dir: Path, since: float, died: list[tuple[int, str]], logs: Path
) -> FirstFailure | None:
    """The failure that came first among the launch's records (``since``: its start), and the
    ranks ``died`` (rank, host) without one: a cause before consequences."""
    records = read(stage_dir, since)
    causes = [r for r in records if not r.consequence]
    recorded = {r.rank for r in records}
    silent = [(rank, host) for rank, host in died if rank not in recorded]
    # A rank a peer's timeout names as not answering hung first; its death came after (the
    # launcher kills a frozen rank 30 s after the others fail): the peer's report is the story.
    hung = [
        r
        for r in records
        if r.consequence
        and any(f" {rk} ({hs})" in r.error for rk, hs in silent)
        and "did not answer" in r.error
    ]
    watched = [r for r in records if r.lost]
    lost_peers: dict[int, LostPeer] = {}
    for r in watched:
        for peer in r.lost:
            lost_peers.setdefault(peer.rank, peer)
    if watched:  # a host lost: every error after it is a consequence
        first = min(lost_peers.values(), key=lambda p: p.last_beat)
        seen_by = sorted({r.rank for r in watched})
        names = ", ".join(f"rank {p.rank} on {p.host}" for p in lost_peers.values())
        head = (
            f"{names} stopped: no heartbeat for {first.silent_s:.0f} s (seen by rank"
            f"{'s' if len(seen_by) > 1 else ''} {', '.join(map(str, seen_by))}, which then"
            " left): its host is lost or the process frozen"
        )
        rank, host = first.rank, first.host
        records = [r for r in records if not r.lost]
    elif causes:
        top = causes[0]
        head = f"rank {top.rank} on {top.host} failed first: {top.error}"
        rank, host = top.rank, top.host
    elif hung:
        top = hung[0]
        head = f"rank {top.rank} reported: {top.error}"
        rank, host = next((rk, hs) for rk, hs in silent if f" {rk} ({hs})" in top.error)
        records = [r for r in records if r is not top]
    elif silent:
        rank, host = silent[0]
        head = (
            f"rank {rank} on {host} died without reporting an error (killed by a signal: the"
            " OOM killer, SIGKILL, or a crash in native code)"
        )
    elif records:
        top = records[0]
        head = f"rank {top.rank} on {top.host} failed first: {top.error}"
        rank, host = top.rank, top.host
    else:
        return None
    lost = [r for r in records if r.consequence and r.rank != rank]
    tail = ""
    if lost:
        seen = "; ".join(f"rank {r.rank}: {r.error[:300]}" for r in lost[:4])
        tail = f"; what the others saw is a consequence ({seen})"
    return FirstFailure(
        rank=rank,
        host=host,
        summary=f"{head}{tail} (each rank's output: {logs}/)",
        lost=sorted(lost_peers.values(), key=lambda p: p.rank),
    )


def launch_failure(stage_dir: Path, since: float, beats: list[dict]) -> FirstFailure | None:
    """``first_failure`` of the launch started at ``since``, with the ranks whose heartbeat
    names a process that is gone."""
    from wonderland_ds.core.console import log_dir
    from wonderland_ds.run.liveness import pid_alive

    died = [
        (int(b.get("rank", -1)), str(b.get("host")))
        for b in beats
        if float(b.get("time", 0.0)) >= since and pid_alive(b.get("pid"), b.get("host")) is False
    ]
    return first_failure(stage_dir, since, sorted(died), log_dir(stage_dir))
