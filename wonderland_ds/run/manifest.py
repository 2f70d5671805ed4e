"""The run directory's manifest, ``run.json``: which stages ran, how, and with what outcome.

Fields (documented in the README): ``format``, ``run_dir``, ``created``, ``versions`` and
``stages`` keyed by stage number (as a string), each with ``name``, ``status`` (``running``,
``restarting``, ``ok``, ``refused``, ``failed``, ``gate-failed``, ``guard-stopped``), ``config``,
``config_sha256``, ``hostfile``, ``world_size``, ``seed``, ``resumed_from``, ``checkpoint``,
``steps``, ``final_loss``, ``overrides``, ``started``, ``finished``, ``front`` (the launching
process's pid and host), ``input_checkpoint`` and ``output_checkpoint`` (lineage),
``restarts``, ``attempts``, ``exit_code``, ``failed_hosts`` and, for stage 17, ``gate``.
``wonderland status`` adds the true ``state`` (``runstate.py``).
"""

from __future__ import annotations

import functools
import json
import platform
import time
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from wonderland_ds.core.files import atomic_write_text

NAME = "run.json"
FORMAT = "wonderland-run/1"


@functools.lru_cache(maxsize=1)
def _versions() -> tuple[tuple[str, str], ...]:
    from importlib.metadata import PackageNotFoundError, version

    out = {"python": platform.python_version()}
    for pkg in ("torch", "deepspeed", "pydantic", "wonderland_ds"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:
            out[pkg] = "not installed"
    return tuple(out.items())


def versions() -> dict[str, str]:
    """Installed versions; read once per process (package-metadata scanning would otherwise
    sit inside every checkpoint save's blocked window)."""
    return dict(_versions())


def now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S%z")


def read(run_dir: Path) -> dict[str, Any] | None:
    try:
        data = json.loads((run_dir / NAME).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("format") == FORMAT else None


def update_stage(run_dir: Path, stage: int, **fields: Any) -> dict[str, Any]:
    """Merge ``fields`` into the stage's entry; creates the manifest on first use."""
    run_dir.mkdir(parents=True, exist_ok=True)
    data = read(run_dir) or {
        "format": FORMAT,
        "run_dir": str(run_dir.resolve()),
        "created": now(),
        "versions": versions(),
        "stages": {},
    }
    entry = data["stages"].setdefault(str(stage), {})
    entry.update(fields)
    atomic_write_text(run_dir / NAME, json.dumps(data, indent=2, sort_keys=True))
    return data


def replace_stage(run_dir: Path, stage: int, entry: dict[str, Any]) -> None:
    """The stage's entry replaced whole (a new attempt starts from ``entry``)."""
    data = read(run_dir)
    if data is None:
        update_stage(run_dir, stage, **entry)
        return
    data["stages"][str(stage)] = dict(entry)
    atomic_write_text(run_dir / NAME, json.dumps(data, indent=2, sort_keys=True))


class ResumeRecord(BaseModel):
    """How a stage loaded its checkpoint: as saved, resharded at load time, or universal."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    load: Literal["as saved", "resharded", "universal"]
    from_world_size: int | None = None
    """Resharded: the world size that saved the checkpoint."""
    bytes_read: list[int] = []
    """Resharded: per rank, the bytes of the saved partitions it read."""
    io_read_bytes: list[int | None] = []
    """Resharded: per rank, what it read from storage while loading (``/proc/self/io``)."""
    seconds: float | None = None
    """Resharded: the slowest rank's load time."""
    because: str | None = None
    """Universal after a planned reshard: why the engine could not take it."""


class StopRecord(BaseModel):
    """A stage stopped on a signal or the job's time limit (status ``preempted``)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reason: str
    """``signal``, ``time-limit`` or ``front`` (the launching process got the signal)."""
    signal: str | None = None
    detail: str = ""
    step: int | None = None
    """The global step the stage stopped at."""
    checkpoint: str | None = None
    """The complete checkpoint holding every trained step (None: the stage has none)."""
    saved: bool = False
    """The stop wrote that checkpoint (False: nothing was trained since it, or it predates)."""
    seconds: float | None = None
    """From the request (the first signal on rank 0, else its agreement) to the saved checkpoint."""
    requeued: bool | None = None
    """Slurm: the job was requeued after the stop (None: not asked)."""


class AllocationRecord(BaseModel):
    """One Slurm allocation that ran (part of) the stage: the stage's lineage across requeues."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    job_id: str
    restart_count: int = 0
    """``SLURM_RESTART_COUNT``: 0 on the job's first run, N after its N-th requeue."""
    nodes: list[str] = []
    started: str | None = None
    first_step: int | None = None
    """The global step this allocation started training from."""
    ended: str | None = None
    last_step: int | None = None
    """The global step it reached (saved, for a stop)."""
    steps_done: int | None = None
    outcome: str | None = None
    """How this allocation's part ended: ``ok``, ``preempted``, ``failed``..."""
    why: str | None = None
    """Why it stopped, for a stop or a failure."""


class StageRecord(BaseModel):
    """One stage's entry of ``run.json``, as the front and the ranks read it back. The fields
    listed are typed; stage-specific ones (a report's figures, a gate) are kept as written."""

    model_config = ConfigDict(extra="allow", frozen=True)

    name: str | None = None
    status: str | None = None
    config: str | None = None
    argv: list[str] = []
    world_size: int | None = None
    seed: int | None = None
    started: str | None = None
    finished: str | None = None
    end_step: int | None = None
    checkpoint: str | None = None
    report: str | None = None
    input_checkpoint: str | None = None
    input_checkpoint_id: str | None = None
    output_checkpoint: str | None = None
    front: dict[str, Any] | None = None
    restarts: list[dict[str, Any]] = []
    attempts: list[dict[str, Any]] = []
    exit_code: int | None = None
    error: str | None = None
    failed_hosts: list[str] = []
    failed_rank: int | None = None
    lost: list[dict[str, Any]] = []
    """The last launch's ranks whose heartbeat stopped (``failures.LostPeer``)."""
    elastic: list[dict[str, Any]] = []
    """Each shrink and grow of the stage's nodes (``launch/elastic.ElasticEvent``)."""
    resume: ResumeRecord | None = None
    stop: StopRecord | None = None
    allocations: list[AllocationRecord] = []


def stage_record(run_dir: Path, stage: int) -> StageRecord:
    """The stage's entry (empty when the run or the stage has none). An entry whose typed
    fields do not validate reads as empty: ``run.json`` is rewritten whole by every update,
    so such an entry was not written by this code."""
    entry = ((read(run_dir) or {}).get("stages") or {}).get(str(stage)) or {}
    try:
        return StageRecord.model_validate(entry)
    except ValidationError:
        return StageRecord()
