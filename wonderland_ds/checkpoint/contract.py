"""The checkpoint contract: complete only when verified metadata is written last.

Layout of a stage's checkpoint root (``RUN/stageNN/checkpoints``)::

    global_step600/                      DeepSpeed's own files (save_latest=False) plus
        mp_rank_00_model_states.pt       module, lr_scheduler, global_steps, client_state
        zero_pp_rank_R_mp_rank_00_optim_states.pt   one per data-parallel rank
        wonderland_rng.pt                every rank's RNG states (loads with weights_only=True)
        wonderland_meta.json             written LAST: contents, versions, sha256 of each file
    latest                               names the newest COMPLETE tag; replaced atomically

Why this order: DeepSpeed writes ``latest`` before its final barrier with a plain
``open('w')``, so a crash can leave ``latest`` naming a half-written folder. Here
every rank finishes, a barrier passes, rank 0 fsyncs and hashes every file, writes the metadata
through a temporary file and ``rename``, and only then replaces ``latest`` the same way.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import metadata
from wonderland_ds.checkpoint.metadata import FORMAT, CheckpointMeta
from wonderland_ds.core.files import (  # noqa: F401  (the contract's file primitives)
    atomic_write_text,
    export_hashes,
    fsync_dir,
    import_hashes,
    sha256_file,
    stat_key,
    verified_sha256,
)
from wonderland_ds.core.findings import Finding

META = "wonderland_meta.json"
RNG_FILE = "wonderland_rng.pt"
LATEST = "latest"
_TAG = re.compile(r"^global_step(\d+)$")


def step_of(tag: str) -> int | None:
    m = _TAG.match(tag)
    return int(m.group(1)) if m else None


def tag_for(step: int) -> str:
    return f"global_step{step}"


def _in_threads(fn: Callable[[Any], Any], items: list[Any]) -> list[Any]:
    """``fn`` over ``items`` in 4 threads, results in order: fsync and sha256 release the GIL."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(fn, items))


def _fsync_and_hash(f: Path) -> dict[str, Any]:
    with open(f, "rb") as fh:
        os.fsync(fh.fileno())
    return {"bytes": f.stat().st_size, "sha256": sha256_file(f)}


def hash_files(tag_dir: Path) -> dict[str, dict[str, Any]]:
    """fsync and hash every file a save wrote (everything but our metadata), and fsync every
    sub-folder (a universal checkpoint has one per parameter). Four threads: fsync and sha256
    release the GIL, and a universal checkpoint has ~400 small files whose fsyncs were 0.4-0.7 s
    one after the other."""
    entries = sorted(tag_dir.rglob("*"))
    names = [f for f in entries if f.is_file() and f.name != META and not f.name.startswith(".")]
    done = _in_threads(_fsync_and_hash, names)
    _in_threads(fsync_dir, [d for d in entries if d.is_dir()])
    return {f.relative_to(tag_dir).as_posix(): d for f, d in zip(names, done)}


def write_meta(tag_dir: Path, fields: dict[str, Any]) -> CheckpointMeta:
    """The checkpoint's metadata, written last: ``fields`` plus the format, the tag and the
    size and sha256 of every file (fsynced first)."""
    meta = metadata.build(
        {
            **fields,
            "format": FORMAT,
            "tag": tag_dir.name,
            "files": hash_files(tag_dir),
            "completed_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        }
    )
    fsync_dir(tag_dir)
    atomic_write_text(tag_dir / META, json.dumps(meta.fields(), indent=2, sort_keys=True))
    return meta


def set_latest(root: Path, tag: str) -> None:
    atomic_write_text(root / LATEST, tag)


def read_meta(tag_dir: Path) -> CheckpointMeta | None:
    """The metadata, or None when it is missing, unreadable or of another format."""
    try:
        text = (tag_dir / META).read_text(encoding="utf-8")
    except OSError:
        return None
    return metadata.parse(text)


@dataclass(frozen=True)
class Verdict:
    tag_dir: Path
    complete: bool
    findings: list[Finding]
    meta: CheckpointMeta | None


def verify(tag_dir: Path, deep: bool = True) -> Verdict:
    """Is ``tag_dir`` a complete checkpoint? ``deep`` re-hashes every file (sha256)."""
    f = str(tag_dir)
    if not tag_dir.is_dir():
        return Verdict(
            tag_dir,
            False,
            [
                Finding(
                    "ckpt-missing",
                    "error",
                    "checkpoint folder does not exist",
                    "pass an existing checkpoint folder, or --resume auto",
                    f,
                )
            ],
            None,
        )
    if not (tag_dir / META).exists():
        return Verdict(
            tag_dir,
            False,
            [
                Finding(
                    "ckpt-incomplete",
                    "error",
                    f"no {META}: the save never finished, or the checkpoint was not written by"
                    " wonderland (no checksums to verify)",
                    "resume from a complete checkpoint (--resume auto picks the newest one)",
                    f,
                    META,
                )
            ],
            None,
        )
    meta = read_meta(tag_dir)
    if meta is None:
        return Verdict(
            tag_dir,
            False,
            [
                Finding(
                    "ckpt-incomplete",
                    "error",
                    f"{META} is unreadable or of an unknown format",
                    "resume from another checkpoint",
                    f,
                    META,
                )
            ],
            None,
        )
    out: list[Finding] = []
    if deep:  # hash in parallel first; the checks below read verified_sha256's cache
        _in_threads(
            verified_sha256,
            [
                tag_dir / rel
                for rel, info in meta.files.items()
                if (tag_dir / rel).is_file() and (tag_dir / rel).stat().st_size == info.bytes
            ],
        )
    for rel, info in sorted(meta.files.items()):
        p = tag_dir / rel
        if not p.is_file():
            out.append(
                Finding(
                    "ckpt-checksum",
                    "error",
                    f"shard {rel} is missing",
                    "restore the file or resume from another checkpoint",
                    f,
                    rel,
                )
            )
        elif p.stat().st_size != info.bytes:
            out.append(
                Finding(
                    "ckpt-checksum",
                    "error",
                    f"shard {rel} has {p.stat().st_size} bytes, the metadata says {info.bytes}"
                    " (truncated or overwritten)",
                    "restore the file or resume from another checkpoint",
                    f,
                    rel,
                )
            )
        elif deep and verified_sha256(p) != info.sha256:
            out.append(
                Finding(
                    "ckpt-checksum",
                    "error",
                    f"shard {rel} fails its sha256 check (expected {info.sha256[:16]}...)",
                    "the file is corrupt: resume from another checkpoint",
                    f,
                    rel,
                )
            )
    if not meta.files:
        out.append(
            Finding(
                "ckpt-checksum",
                "error",
                "metadata lists no files",
                "resume from another checkpoint",
                f,
                META,
            )
        )
    return Verdict(tag_dir, not out, out, meta)


def tags(root: Path) -> list[tuple[int, Path]]:
    """Checkpoint folders under ``root``, oldest first."""
    if not root.is_dir():
        return []
    found = [(step_of(p.name), p) for p in root.iterdir() if p.is_dir()]
    return sorted((s, p) for s, p in found if s is not None)


def read_latest(root: Path) -> str | None:
    try:
        return (root / LATEST).read_text(encoding="utf-8").strip() or None
    except OSError:
        return None


def newest_complete(root: Path, deep: bool = True, skip: set[Path] | None = None) -> Verdict | None:
    for _, path in reversed(tags(root)):
        if skip and path in skip:
            continue
        v = verify(path, deep=deep)
        if v.complete:
            return v
    return None


Hook = Callable[[str], None]


def _noop(point: str) -> None:
    return None


def finalize(
    root: Path,
    tag_dir: Path,
    world: int,
    meta: dict[str, Any],
    keep_last: int,
    timeout_s: float,
    hook: Hook = _noop,
) -> None:
    """Complete a save once every rank's shards are durable (their ``.done-rankR`` markers):
    the RNG states every rank's marker carries, then the metadata (the checkpoint is now
    complete), then ``latest``, then retention. ``hook(point)`` runs at each named point
    (fault injection, crash tests)."""
    import torch

    from wonderland_ds.checkpoint.markers import read_markers, wait_for_markers

    wait_for_markers(tag_dir, world, timeout_s)
    hook("after-shards")
    rngs = read_markers(tag_dir, world)
    tmp = tag_dir / f".{RNG_FILE}.tmp"
    torch.save({"ranks": rngs}, tmp)
    os.replace(tmp, tag_dir / RNG_FILE)
    hook("before-meta")
    write_meta(tag_dir, meta)
    hook("before-latest")
    set_latest(root, tag_dir.name)
    hook("after-latest")
    for marker in tag_dir.glob(".done-rank*"):
        marker.unlink()
    retain(root, keep_last, hook)


def retain(root: Path, keep_last: int, hook: Hook = _noop) -> list[Path]:
    """Delete all but the newest ``keep_last`` complete checkpoints, and incomplete folders
    older than the newest complete one. The newest complete checkpoint is never deleted, even
    if ``latest`` is damaged: deletion renames first, so a crash leaves a ``.deleting-`` folder
    that is never mistaken for a checkpoint."""
    complete = [p for _, p in tags(root) if read_meta(p) is not None]
    if not complete:
        return []
    newest = complete[-1]
    newest_step = step_of(newest.name) or 0
    doomed = complete[: max(0, len(complete) - keep_last)]
    doomed += [p for s, p in tags(root) if s < newest_step and read_meta(p) is None]
    removed = []
    for p in doomed:
        if p == newest:
            continue
        trash = p.with_name(f".deleting-{p.name}")
        os.replace(p, trash)
        hook("retain-renamed")
        shutil.rmtree(trash, ignore_errors=True)
        removed.append(p)
    for stale in root.glob(".deleting-*"):
        shutil.rmtree(stale, ignore_errors=True)
    return removed


def sha256_text(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()
