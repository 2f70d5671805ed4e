"""Checkpoint saves that block training only for an in-memory snapshot.

DeepSpeed's ``save_checkpoint`` builds its state dicts and hands each file to a checkpoint
engine. We swap in :class:`SnapshotCheckpointEngine`: ``save()`` copies the state (tensor
storages once each, so views keep sharing) and returns; a per-rank writer thread serializes,
fsyncs and renames each file into place, then drops a ``.done-rankR`` marker. Rank 0's writer
then waits for every rank's marker and only then hashes the files, writes the metadata and
replaces ``latest``: the crash-safety contract of checkpoint.py is unchanged, only the waiting
moved off the training loop. The next save waits for the previous one (back-pressure).
"""

from __future__ import annotations

import copy
import os
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def snapshot(obj: Any, memo: dict[int, Any] | None = None) -> Any:
    """A copy that later training steps cannot change. Tensor storages are cloned once each
    and views rebuilt on the clones, so the file is the same as DeepSpeed would write."""
    memo = {} if memo is None else memo
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(t)
        if key not in memo:
            memo[key] = storage.clone()
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(memo[key], t.storage_offset(), t.size(), t.stride())
    # Exact types only: subclasses (torch.Size, defaultdict, named tuples) keep their type
    # through deepcopy below, and DeepSpeed's loaders rely on them (e.g. Size.numel()).
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, snapshot(v, memo)) for k, v in obj.items())
    if type(obj) is list:
        return [snapshot(v, memo) for v in obj]
    if type(obj) is tuple:
        return tuple(snapshot(v, memo) for v in obj)
    if isinstance(obj, (str, int, float, bool, type(None))):
        return obj
    return copy.deepcopy(obj)


class Writer:
    """One background thread per rank, jobs in order; the first error is kept and raised by
    :meth:`wait`, and every later job is skipped (no half-finished checkpoint is completed)."""

    def __init__(self, hook: Callable[[str], None] | None = None) -> None:
        self.hook = hook or (lambda point: None)
        self._q: queue.Queue[Callable[[], None] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._pending = 0
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="wonderland-ckpt", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            job = self._q.get()
            if job is None:
                return
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # surfaced by wait(); the process goes on
                self._error = exc
            finally:
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def submit(self, job: Callable[[], None]) -> None:
        with self._lock:
            self._pending += 1
        self._q.put(job)

    def write(self, obj: Any, path: str, zipfile: bool) -> None:
        def job() -> None:
            tmp = f"{path}.tmp"
            try:
                torch.save(obj, tmp, _use_new_zipfile_serialization=zipfile)
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                self.hook("mid-file")
                os.replace(tmp, path)
                self.hook("after-file")
            except BaseException as exc:
                Path(tmp).unlink(missing_ok=True)  # never leave a partial file behind
                if isinstance(exc, Exception):  # torch's zip writer hides the errno (EFBIG...)
                    raise OSError(
                        f"could not write {path}: {exc} (disk full, quota or file-size limit?)"
                    ) from exc
                raise

        self.submit(job)

    @property
    def pending(self) -> int:
        return self._pending

    def wait(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._pending:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError("checkpoint writer did not finish in time")
                self._lock.wait(left)
        if self._error is not None:
            err, self._error = self._error, None
            raise err

    def close(self) -> None:
        self._q.put(None)
        self._thread.join(timeout=60)


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed checkpoint engine: ``save`` snapshots in memory and queues the write."""

    def __init__(self, base: Any, writer: Writer) -> None:
        self.name = "WonderlandSnapshotCheckpointEngine"
        self.zipfile_serialization = getattr(base, "zipfile_serialization", True)
        self.writer = writer

    def save(self, state_dict: Any, path: str) -> None:
        self.writer.write(snapshot(state_dict), path, self.zipfile_serialization)


def install(engine: Any, hook: Callable[[str], None] | None = None) -> Writer:
    writer = Writer(hook)
    engine.checkpoint_engine = SnapshotCheckpointEngine(engine.checkpoint_engine, writer)
    return writer


def wait_for_markers(tag_dir: Path, world: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [r for r in range(world) if (tag_dir / f".done-rank{r}").exists()]
        if len(done) == world:
            return
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(done))
            raise TimeoutError(
                f"ranks {missing} did not finish writing {tag_dir.name} within {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def mark_done(tag_dir: Path, rank: int) -> None:
    marker = tag_dir / f".done-rank{rank}"
    with open(marker, "w") as fh:
        fh.flush()
        os.fsync(fh.fileno())
