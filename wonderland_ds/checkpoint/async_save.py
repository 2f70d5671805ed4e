"""Checkpoint saves that block training only for an in-memory snapshot.

DeepSpeed's ``save_checkpoint`` builds its state dicts and hands each file to a checkpoint
engine. We swap in :class:`SnapshotCheckpointEngine`: ``save()`` copies the state (tensor
storages once each, so views keep sharing) and returns; a per-rank writer thread serializes,
fsyncs and renames each file into place, then drops a ``.done-rankR`` marker. Rank 0's writer
then waits for every rank's marker and only then hashes the files, writes the metadata and
replaces ``latest``: the crash-safety contract of checkpoint.py is unchanged, only the waiting
moved off the training loop. The next save waits for the previous one (back-pressure).

Three things keep the blocked window short:
* most of the state is not copied on the loop's time. Parameters, fp32 master weights and
  optimizer moments change only in an optimizer step, so they are *held*: the writer thread
  reads them from the live tensors while the next step's forward and backward run, and the
  loop calls :meth:`Writer.fence` before that step's optimizer update. By default
  (``async_save_copy``) the writer first copies them into pooled buffers, so the fence waits
  for a memcpy only; without it, the writer serializes the live tensors and the fence waits
  for torch.save (no extra memory). Everything else in a state dict (buffers, which a
  forward may update; DeepSpeed's loss scaler; anything we cannot place) is copied at the
  save, on the loop's time;
* what is copied goes into buffers kept from the previous save (:class:`BufferPool`): fresh
  memory pays a page fault per page;
* each rank's RNG states travel in its ``.done-rankR`` marker (``markers.py``), so no collective
  gathers them on the training loop's time.
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


class BufferPool:
    """Host buffers reused from one save's snapshot to the next. A buffer is handed back
    (:meth:`give`) only once its file is written; :meth:`start`, called when the previous save
    has completed (back-pressure), makes those buffers the ones this save copies into, so a
    buffer is never reused while read. :meth:`trim` drops what this save did not take: the
    pool holds at most one copy of this rank's state."""

    def __init__(self) -> None:
        self._free: dict[int, list[torch.UntypedStorage]] = {}  # given back by this save
        self._prev: dict[int, list[torch.UntypedStorage]] = {}  # the previous save's, to reuse
        self._lock = threading.Lock()
        self.reused = 0

    def start(self) -> None:
        with self._lock:
            self._prev, self._free = self._free, {}

    def take(self, nbytes: int) -> torch.UntypedStorage:
        """A host buffer of ``nbytes`` (the previous save's when one fits), not yet filled."""
        with self._lock:
            free = self._prev.get(nbytes)
            buf = free.pop() if free else None
        if buf is None:
            return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()
        self.reused += 1
        return buf

    def copy(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        n = storage.nbytes()
        if storage.device.type != "cpu" or n == 0:
            return storage.clone()  # device memory is not pooled: it is the scarce kind
        buf = self.take(n)
        buf.copy_(storage)
        return buf

    def give(self, buffers: list[torch.UntypedStorage]) -> None:
        with self._lock:
            for buf in buffers:
                if buf.device.type == "cpu" and buf.nbytes():
                    self._free.setdefault(buf.nbytes(), []).append(buf)

    def trim(self) -> None:
        """Drop the previous save's buffers this save did not take (shapes changed); buffers
        this save's own finished files gave back already stay for the next save."""
        with self._lock:
            self._prev = {}


def fill(staged: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Copy each held storage into its buffer (a tensor copy: it releases the GIL, so the
    training loop runs while the writer thread copies)."""
    for buf, src in staged:
        dst = torch.empty(0, dtype=torch.uint8).set_(buf)
        dst.copy_(torch.empty(0, dtype=torch.uint8).set_(src))


def snapshot(
    obj: Any,
    memo: dict[int, Any] | None = None,
    pool: BufferPool | None = None,
    held: frozenset[int] = frozenset(),
    kept: list[torch.Tensor] | None = None,
    staged: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None = None,
) -> Any:
    """A copy that later training steps cannot change. Tensor storages are copied once each
    (into ``pool``'s reused buffers when given) and views rebuilt on the copies, so the file is
    the same as DeepSpeed would write. ``memo`` ends up holding every copied storage. Tensors
    whose storage is in ``held`` (by data pointer: only an optimizer step writes them) are
    not copied now (and appended to ``kept``); the caller fences the next step. With
    ``staged`` (a list, and a pool), a held storage gets a pool buffer that is *not filled*:
    the (buffer, live storage) pair goes into ``staged`` for the writer thread to copy
    (:func:`fill`) before the fence lets the optimizer change it. Without, the held tensor
    itself is kept, and the writer serializes it straight from the live storage."""
    memo = {} if memo is None else memo
    args = (memo, pool, held, kept, staged)
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        storage = t.untyped_storage()
        key = storage.data_ptr() if storage.nbytes() else id(t)
        if key in held:
            if kept is not None:
                kept.append(obj)
            if staged is None or pool is None:
                return obj
            if key not in memo:
                memo[key] = pool.take(storage.nbytes())
                staged.append((memo[key], storage))
        elif key not in memo:
            memo[key] = pool.copy(storage) if pool is not None else storage.clone()
        out = torch.empty(0, dtype=t.dtype, device=t.device)
        return out.set_(memo[key], t.storage_offset(), t.size(), t.stride())
    # Exact types only: subclasses (torch.Size, defaultdict, named tuples) keep their type
    # through deepcopy below, and DeepSpeed's loaders rely on them (e.g. Size.numel()).
    if type(obj) in (dict, OrderedDict):
        return type(obj)((k, snapshot(v, *args)) for k, v in obj.items())
    if type(obj) is list:
        return [snapshot(v, *args) for v in obj]
    if type(obj) is tuple:
        return tuple(snapshot(v, *args) for v in obj)
    if isinstance(obj, (str, int, float, bool, type(None), torch.Size, torch.dtype)):
        # Immutable. torch.Size (DeepSpeed's param_shapes: one per parameter) through
        # deepcopy was a large share of the blocked save window.
        return obj
    return copy.deepcopy(obj)


class Writer:
    """One background thread per rank, jobs in order; the first error is kept and raised by
    :meth:`wait`, and every later job is skipped (no half-finished checkpoint is completed)."""

    def __init__(self, hook: Callable[[str], None] | None = None) -> None:
        self.hook = hook or (lambda point: None)
        self.pool = BufferPool()
        # (job, release): release runs once the job is done or skipped (held files).
        self._q: queue.Queue[tuple[Callable[[], None], Callable[[], None]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self._pending = 0
        self._held = 0  # queued files that still read live training tensors
        # Serializations of copied held files, queued behind every copy of the same save
        # (at the next submit, wait or close): no copy waits for another file's torch.save.
        self._deferred: list[tuple[Callable[[], None], Callable[[], None]]] = []
        self._lock = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="wonderland-ckpt", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            job, release = item
            try:
                if self._error is None:
                    job()
            except BaseException as exc:  # surfaced by wait(); the process goes on
                self._error = exc
            finally:
                release()  # a skipped or failed held file no longer holds the loop
                with self._lock:
                    self._pending -= 1
                    self._lock.notify_all()

    def submit(self, job: Callable[[], None], release: Callable[[], None] = lambda: None) -> None:
        self._flush_deferred()  # the copied files' serializations go first, in their order
        with self._lock:
            self._pending += 1
        self._q.put((job, release))

    def _flush_deferred(self) -> None:
        with self._lock:
            jobs, self._deferred = self._deferred, []
        for item in jobs:  # already counted in _pending
            self._q.put(item)

    def write(
        self,
        obj: Any,
        path: str,
        zipfile: bool,
        buffers: list[torch.UntypedStorage] | None = None,
        held: bool = False,
        staged: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None = None,
    ) -> None:
        """Queue ``obj`` for ``path``; ``buffers`` (its pooled storages) go back to the pool
        once the file is written. ``held``: ``obj`` reads live tensors, and :meth:`fence`
        waits until they are read: copied, when ``staged`` lists them (:func:`fill`), else
        serialized (into the page cache; fsync and rename come after). A staged file's copy
        is queued at once and its serialization held back until the next :meth:`submit`,
        :meth:`wait` or :meth:`close`, so the copies of one save (DeepSpeed writes the
        model states, then the optimizer states) all run before any of its torch.saves."""
        released = [not held]

        def release() -> None:  # on the writer thread only: after torch.save, or when skipped
            if not released[0]:
                released[0] = True
                with self._lock:
                    self._held -= 1
                    self._lock.notify_all()

        def copy_held() -> None:
            assert staged
            try:
                self.hook("before-file")
                fill(staged)
            finally:
                release()  # copied (or failed: the error skips the serialization)
            self.hook("held-copied")

        def job() -> None:
            tmp = f"{path}.tmp"
            try:
                if not staged:
                    self.hook("before-file")
                try:
                    torch.save(obj, tmp, _use_new_zipfile_serialization=zipfile)
                finally:
                    release()
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                self.hook("mid-file")
                os.replace(tmp, path)
                self.hook("after-file")
                if buffers:
                    self.pool.give(buffers)
            except BaseException as exc:
                Path(tmp).unlink(missing_ok=True)  # never leave a partial file behind
                if isinstance(exc, Exception):  # torch's zip writer hides the errno (EFBIG...)
                    raise OSError(
                        f"could not write {path}: {exc} (disk full, quota or file-size limit?)"
                    ) from exc
                raise

        if held:
            with self._lock:
                self._held += 1
        if not staged:
            self.submit(job, release)
            return
        with self._lock:
            self._pending += 2
            self._deferred.append((job, lambda: None))
        self._q.put((copy_held, release))

    @property
    def pending(self) -> int:
        return self._pending

    @property
    def busy(self) -> bool:
        """Writing, or holding an error not yet raised. A writer that is not busy cannot
        become busy (or fail) until something is submitted again."""
        return self._pending > 0 or self._error is not None

    def fence(self, timeout: float | None = None) -> float:
        """Block until no queued file still reads live tensors: call it before anything
        changes them (the optimizer step after a save). Returns the seconds it waited;
        TimeoutError after ``timeout`` (a stuck disk must not hang the run)."""
        if not self._held:  # the common case, every step: no lock
            return 0.0
        t0 = time.perf_counter()
        deadline = None if timeout is None else time.monotonic() + timeout
        with self._lock:
            while self._held:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    raise TimeoutError(
                        f"the checkpoint writer did not serialize the held tensors in {timeout:.0f} s"
                    )
                self._lock.wait(left)
        return time.perf_counter() - t0

    def wait(self, timeout: float | None = None) -> None:
        self._flush_deferred()
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
        self._flush_deferred()
        self._q.put(None)
        self._thread.join(timeout=60)
