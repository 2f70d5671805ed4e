"""Pre-cached tensor shards: ``wonderland cache SOURCE --out DIR``.

A dataset is written once as fixed-dtype NumPy ``.npy`` shards (memory-mapped when read:
zero-copy, no decoding in the step loop, no extra dependency, readable by anything), plus
``index.json`` with each shard's rows, dtype, shape and sha256 and the dataset fingerprint.

Why these rules:
* ``index.json`` is written last, inside a temporary folder that is renamed into place: a
  half-written cache has no index and is never mistaken for a complete one.
* Writing the same dataset again is a no-op; a different dataset into the same folder is
  refused (exit 2), never overwritten.
* Opening verifies every shard's size and sha256 before training reads a byte: a flipped byte,
  a truncated or a missing shard is refused, naming the shard.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
from pathlib import Path
from typing import Any

import numpy as np

from wonderland_ds.core.files import (
    atomic_write_text,
    fsync_dir,
    sha256_file,
    verified_sha256,
)
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data.tasks import Split, Task, fingerprint

INDEX = "index.json"
FORMAT = "wonderland-cache/1"
SHARD_ROWS = 1 << 16


def _write_split(folder: Path, split: Split) -> list[dict[str, Any]]:
    folder.mkdir(parents=True)
    shards = []
    for i, start in enumerate(range(0, max(len(split), 1), SHARD_ROWS)):
        entry: dict[str, Any] = {"rows": int(min(SHARD_ROWS, len(split) - start))}
        for key in ("x", "y"):
            arr = np.ascontiguousarray(getattr(split, key)[start : start + SHARD_ROWS])
            path = folder / f"{key}_{i:05d}.npy"
            np.save(path, arr)
            with open(path, "rb") as fh:
                os.fsync(fh.fileno())
            entry[key] = {
                "file": f"{folder.name}/{path.name}",
                "dtype": str(arr.dtype),
                "shape": list(arr.shape),
                "bytes": path.stat().st_size,
                "sha256": sha256_file(path),
            }
        shards.append(entry)
    return shards


def read_index(out: Path) -> dict[str, Any] | None:
    try:
        index = json.loads((out / INDEX).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return index if isinstance(index, dict) and index.get("format") == FORMAT else None


def write(task: Task, out: Path) -> tuple[dict[str, Any], list[Finding]]:
    """Cache ``task``'s splits in ``out`` (idempotent; refuses a different dataset)."""
    if not isinstance(task.train, Split) or not isinstance(task.heldout, Split):
        raise Refused(
            f"task {task.name!r} reads its data in place (token files): there is nothing to cache",
            "train on it directly; wonderland cache is for tasks whose make_splits builds arrays",
        )
    fp = fingerprint(task.train, task.name)
    if out.exists():
        index = read_index(out)
        if index is None:
            raise Refused(
                Finding(
                    "cache-exists",
                    "error",
                    f"{out} exists but is not a complete wonderland cache (no valid {INDEX})",
                    "remove it, or choose another --out",
                    str(out),
                )
            )
        if index["fingerprint"] != fp or index["task"] != task.name:
            raise Refused(
                Finding(
                    "cache-exists",
                    "error",
                    f"{out} already holds a different dataset ({index['task']},"
                    f" fingerprint {index['fingerprint'][:12]}...), refusing to overwrite it",
                    "choose another --out, or delete the old cache first",
                    str(out / INDEX),
                )
            )
        return index, [Finding("cache", "ok", f"{out} already holds this dataset: nothing to do")]
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        splits = {
            name: _write_split(tmp / name, split)
            for name, split in (("train", task.train), ("heldout", task.heldout))
        }
        index = {
            "format": FORMAT,
            "task": task.name,
            "fingerprint": fp,
            "source_key": task.source_key_value,  # tasks.py: proves freshness cheaply
            "rows": {"train": len(task.train), "heldout": len(task.heldout)},
            "splits": splits,
            "meta": task.meta,
        }
        for sub in ("train", "heldout"):
            fsync_dir(tmp / sub)
        atomic_write_text(tmp / INDEX, json.dumps(index, indent=2))
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    size = sum(p.stat().st_size for p in out.rglob("*.npy"))
    return index, [
        Finding(
            "cache",
            "ok",
            f"cached {task.name}: {len(task.train)} train +"
            f" {len(task.heldout)} held-out rows, {size / 1e6:.2f} MB in {out}",
        )
    ]


def verify(out: Path) -> tuple[dict[str, Any] | None, list[Finding]]:
    index = read_index(out)
    if index is None:
        what = "does not exist" if not out.exists() else f"has no valid {INDEX} (incomplete)"
        return None, [
            Finding(
                "cache-missing",
                "error",
                f"dataset cache {what}",
                "build it with `wonderland cache TASK --out DIR`",
                str(out),
            )
        ]
    bad = []
    for split in index["splits"].values():
        for shard in split:
            for key in ("x", "y"):
                info, path = shard[key], out / shard[key]["file"]
                if not path.is_file():
                    bad.append(
                        Finding(
                            "cache-shard",
                            "error",
                            f"shard {info['file']} is missing",
                            "rebuild the cache (delete it, run `wonderland cache`)",
                            str(path),
                        )
                    )
                elif path.stat().st_size != info["bytes"]:
                    bad.append(
                        Finding(
                            "cache-shard",
                            "error",
                            f"shard {info['file']} has {path.stat().st_size} bytes,"
                            f" the index says {info['bytes']} (truncated?)",
                            "rebuild the cache",
                            str(path),
                        )
                    )
                elif verified_sha256(path) != info["sha256"]:
                    bad.append(
                        Finding(
                            "cache-shard",
                            "error",
                            f"shard {info['file']} fails its sha256 check",
                            "the shard is corrupt: rebuild the cache",
                            str(path),
                        )
                    )
    return (None, bad) if bad else (index, [])


def _load(out: Path, shards: list[dict[str, Any]]) -> Split:
    xs = [np.load(out / s["x"]["file"], mmap_mode="r") for s in shards]
    ys = [np.load(out / s["y"]["file"], mmap_mode="r") for s in shards]
    # One shard (the common case here) stays memory-mapped; several are joined once at open.
    return Split(
        xs[0] if len(xs) == 1 else np.concatenate(xs), ys[0] if len(ys) == 1 else np.concatenate(ys)
    )


def open_task(task: Task, out: Path) -> Task:
    """``task`` with its splits read from a verified cache (refuses a damaged one)."""
    index, bad = verify(out)
    if index is None:
        raise Refused(bad)
    if index["task"] != task.name:
        raise Refused(
            Finding(
                "cache-task",
                "error",
                f"cache {out} holds task {index['task']!r}, not {task.name!r}",
                "point wonderland.cache at this task's cache",
                str(out / INDEX),
            )
        )
    task = dataclasses.replace(
        task, meta=index.get("meta") or {}, source_key_value=index.get("source_key")
    )
    return task.with_data(
        _load(out, index["splits"]["train"]),
        _load(out, index["splits"]["heldout"]),
        index["fingerprint"],
    )
