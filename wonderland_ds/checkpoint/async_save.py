"""Checkpoint saves that block training only for an in-memory snapshot.

DeepSpeed's ``save_checkpoint`` builds its state dicts and hands each file to a checkpoint
engine. We swap in :class:`SnapshotCheckpointEngine`: ``save()`` copies the state (tensor
storages once each, so views keep sharing: ``staging.py``) and returns; a per-rank writer
thread (:class:`Writer`, here) serializes, fsyncs and renames each file into place, then drops
a ``.done-rankR`` marker. Rank 0's writer then waits for every rank's marker and only then
hashes the files, writes the metadata and replaces ``latest``: the crash-safety contract of
checkpoint.py is unchanged, only the waiting moved off the training loop. The next save waits
for the previous one (back-pressure).

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
* what is copied goes into buffers kept from the previous save
  (:class:`~wonderland_ds.checkpoint.staging.BufferPool`): fresh memory pays a page fault per
  page;
* each rank's RNG states travel in its ``.done-rankR`` marker (``markers.py``), so no collective
  gathers them on the training loop's time.

Device tensors are never copied on the device: its memory is the scarce kind (a second copy of
the fp32 master weights and moments would not fit). At the save,
:class:`~wonderland_ds.checkpoint.staging.DeviceStager` queues each device storage's copy into
a page-locked host buffer from the pool, on a side stream behind the work already queued. The
training stream waits for the copies of what a forward may change right away, on the device
(the host goes on); for held ones, the fence makes it wait before the optimizer update. The
writer thread waits for the copies before torch.save; the files hold them as CPU tensors
(DeepSpeed loads checkpoints onto the CPU).
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.checkpoint.staging import BufferPool, DeviceStager, fill


class Writer:
    """One background thread per rank, jobs in order; the first error is kept and raised by
    :meth:`wait`, and every later job is skipped (no half-finished checkpoint is completed)."""

    def __init__(self, hook: Callable[[str], None] | None = None, accel: Any = None) -> None:
        self.hook = hook or (lambda point: None)
        self.stager = DeviceStager(accel)
        self.pool = BufferPool(self.stager.pinned)
        # (job, release): release runs once the job is done or skipped (held files).
        self._q: queue.Queue[tuple[Callable[[], None], Callable[[], None]] | None] = queue.Queue()
        self._error: BaseException | None = None
        self.on_error: Callable[[], None] | None = None  # run once, at the first failure
        self._pending = 0
        self._held = 0  # queued files that still read live training tensors
        self._fenced: list[Any] = []  # held device copies' events, for the next fence
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
                if self.on_error is not None:
                    self.on_error()
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
        device: list[tuple[torch.UntypedStorage, torch.UntypedStorage, bool]] | None = None,
    ) -> None:
        """Queue ``obj`` for ``path``; ``buffers`` (its pooled storages) go back to the pool
        once the file is written. ``held``: ``obj`` reads live tensors, and :meth:`fence`
        waits until they are read: copied, when ``staged`` lists them (:func:`fill`), else
        serialized (into the page cache; fsync and rename come after). A staged file's copy
        is queued at once and its serialization held back until the next :meth:`submit`,
        :meth:`wait` or :meth:`close`, so the copies of one save (DeepSpeed writes the
        model states, then the optimizer states) all run before any of its torch.saves.
        ``device`` (from :func:`snapshot`): its copies are queued now, on the caller's thread
        (:meth:`_stage`), and the writer waits for them before torch.save."""
        events = self._stage(device or [])
        # The device copies' buffers go back to the pool as page-locked ones, the rest as not.
        pinned = [buf for buf, _, _ in device or []]
        ids = {id(buf) for buf in pinned}
        buffers = [buf for buf in buffers or [] if id(buf) not in ids]
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
                    for event in events:  # never serialize a buffer still being filled
                        self.stager.wait(event)
                    torch.save(obj, tmp, _use_new_zipfile_serialization=zipfile)
                finally:
                    release()
                with open(tmp, "rb") as fh:
                    os.fsync(fh.fileno())
                self.hook("mid-file")
                os.replace(tmp, path)
                self.hook("after-file")
                self.pool.give(buffers)
                self.pool.give(pinned, pinned=True)
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

    def _stage(
        self, device: list[tuple[torch.UntypedStorage, torch.UntypedStorage, bool]]
    ) -> list[Any]:
        """Queue the copies of a file's device storages into their host buffers. What a
        forward may change goes first, and the current stream waits for it at once; what only
        an optimizer step changes makes the next :meth:`fence` wait. Returns the events."""
        events: list[Any] = []
        for held in (False, True):
            pairs = [(buf, src) for buf, src, h in device if h is held]
            if pairs:
                events.append(self.stager.copy(pairs))
                if held:
                    self._fenced.append(events[-1])
                else:
                    self.stager.hold(events[-1])
        return events

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
        changes them (the optimizer step after a save). Held device storages: the current
        stream waits for their copies, on the device. Returns the seconds the host waited;
        TimeoutError after ``timeout`` (a stuck disk must not hang the run)."""
        if self._fenced:  # called on the loop's thread, as write() is: no lock
            for event in self._fenced:
                self.stager.hold(event)
            self._fenced = []
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
