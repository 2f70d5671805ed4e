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

Device tensors are never copied on the device: its memory is the scarce kind (a second copy
of the fp32 master weights and moments would not fit). At the save, :class:`DeviceStager`
queues each device storage's copy into a page-locked host buffer from the pool, on a side
stream behind the work already queued. The training stream waits for the copies of what a
forward may change right away, on the device (the host goes on); for held ones, the fence
makes it wait before the optimizer update. The writer thread waits for the copies before
torch.save; the files hold them as CPU tensors (DeepSpeed loads checkpoints onto the CPU).
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
    """Host buffers reused from one save's snapshot to the next, pageable ones for host
    storages and page-locked ones (``pinned``, allocated by the device stager) for device
    storages, each kind keyed by size. A buffer is handed back (:meth:`give`) only once its
    file is written; :meth:`start`, called when the previous save has completed
    (back-pressure), makes those buffers the ones this save copies into, so a buffer is never
    reused while read. :meth:`trim` drops what this save did not take: the pool holds at most
    one copy of this rank's state."""

    def __init__(self, pinned: Callable[[int], torch.UntypedStorage] | None = None) -> None:
        # (nbytes, page-locked) -> buffers: a device copy must land in page-locked memory.
        self._free: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}  # given back
        self._prev: dict[tuple[int, bool], list[torch.UntypedStorage]] = {}  # previous save's
        self._pinned = pinned
        self._lock = threading.Lock()
        self.reused = 0

    def start(self) -> None:
        with self._lock:
            self._prev, self._free = self._free, {}

    def take(self, nbytes: int, pinned: bool = False) -> torch.UntypedStorage:
        """A host buffer of ``nbytes`` (the previous save's when one fits), not yet filled;
        ``pinned``: page-locked, for a device storage's copy."""
        with self._lock:
            free = self._prev.get((nbytes, pinned))
            buf = free.pop() if free else None
        if buf is not None:
            self.reused += 1
            return buf
        if pinned and self._pinned is not None:
            return self._pinned(nbytes)
        return _new(nbytes)

    def copy(self, storage: torch.UntypedStorage) -> torch.UntypedStorage:
        """A pooled copy of a host storage (device storages go through :class:`DeviceStager`)."""
        n = storage.nbytes()
        if n == 0:
            return storage.clone()
        buf = self.take(n)
        buf.copy_(storage)
        return buf

    def give(self, buffers: list[torch.UntypedStorage], pinned: bool = False) -> None:
        with self._lock:
            for buf in buffers:
                if buf.nbytes():
                    self._free.setdefault((buf.nbytes(), pinned), []).append(buf)

    def trim(self) -> None:
        """Drop the previous save's buffers this save did not take (shapes changed); buffers
        this save's own finished files gave back already stay for the next save."""
        with self._lock:
            self._prev = {}


def _new(nbytes: int) -> torch.UntypedStorage:
    return torch.empty(nbytes, dtype=torch.uint8).untyped_storage()


def _on_device(storage: torch.UntypedStorage) -> bool:
    """Copied through :class:`DeviceStager` (tests stand host storages in for device ones)."""
    return storage.device.type != "cpu"


def _bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over the whole storage: storages are copied as tensors."""
    return torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)


class DeviceStager:
    """Device-to-host copies on a side stream, through DeepSpeed's accelerator API (any
    device; ``accel`` stands in for it in tests). The only code here that touches streams.
    On the CPU accelerator (no streams, no events, no pinning) a copy is done when
    :meth:`copy` returns and its event is None."""

    def __init__(self, accel: Any = None) -> None:
        self._accel = accel
        self._stream: Any = None

    @property
    def accel(self) -> Any:
        if self._accel is None:  # at the first device storage: host-only saves never need it
            from deepspeed.accelerator import get_accelerator

            self._accel = get_accelerator()
        return self._accel

    def pinned(self, nbytes: int) -> torch.UntypedStorage:
        """A page-locked host buffer (pageable where pinning fails: the copy then blocks)."""
        try:
            buf = self.accel.pin_empty(nbytes, dtype=torch.uint8)
        except RuntimeError:  # page-locking refused (a memlock limit): correct, only slower
            buf = torch.empty(nbytes, dtype=torch.uint8)
        return buf.untyped_storage()

    def copy(self, pairs: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> Any:
        """Queue each (host buffer, device storage) copy on the side stream, behind all the
        current stream has queued; returns an event recorded after them (None: done)."""
        accel = self.accel
        if self._stream is None and accel.Stream is not None:
            self._stream = accel.Stream()
        side = self._stream
        if side is not None:
            side.wait_stream(accel.current_stream())
        with accel.stream(side):
            for buf, src in pairs:
                _bytes(buf).copy_(_bytes(src), non_blocking=True)
        if side is None or accel.Event is None:
            if not accel.is_synchronized_device():
                accel.synchronize()  # no stream to record on: wait for the copies here
            return None
        event = accel.Event()
        event.record(side)
        return event

    def hold(self, event: Any) -> None:
        """The current stream waits for ``event`` on the device: nothing queued after this
        changes the storages before they are copied, and the host does not wait."""
        if event is not None:
            self.accel.current_stream().wait_event(event)

    @staticmethod
    def wait(event: Any) -> None:
        """Block this thread (the writer's) until ``event``'s copies are done."""
        if event is not None:
            event.synchronize()


def fill(staged: list[tuple[torch.UntypedStorage, torch.UntypedStorage]]) -> None:
    """Copy each held storage into its buffer (a tensor copy: it releases the GIL, so the
    training loop runs while the writer thread copies)."""
    for buf, src in staged:
        _bytes(buf).copy_(_bytes(src))


def snapshot(
    obj: Any,
    memo: dict[int, Any] | None = None,
    pool: BufferPool | None = None,
    held: frozenset[int] = frozenset(),
    kept: list[torch.Tensor] | None = None,
    staged: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None = None,
    device: list[tuple[torch.UntypedStorage, torch.UntypedStorage, bool]] | None = None,
) -> Any:
    """A copy that later training steps cannot change. Tensor storages are copied once each
    (into ``pool``'s reused buffers when given) and views rebuilt on the copies, so the file is
    the same as DeepSpeed would write. ``memo`` ends up holding every copied storage. Tensors
    whose storage is in ``held`` (by data pointer: only an optimizer step writes them) are
    not copied now (and appended to ``kept``); the caller fences the next step. With
    ``staged`` (a list, and a pool), a held storage gets a pool buffer that is *not filled*:
    the (buffer, live storage) pair goes into ``staged`` for the writer thread to copy
    (:func:`fill`) before the fence lets the optimizer change it. Without, the held tensor
    itself is kept, and the writer serializes it straight from the live storage.
    A device storage, held or not, gets a host buffer (page-locked, from the pool), never a
    device copy: with ``device`` the (buffer, storage, held) triple goes there for the
    :class:`DeviceStager`, else it is copied now. Its tensors are written as host tensors."""
    memo = {} if memo is None else memo
    args = (memo, pool, held, kept, staged, device)
    if isinstance(obj, torch.Tensor):
        t = obj.detach()
        storage = t.untyped_storage()
        n = storage.nbytes()
        key = storage.data_ptr() if n else id(t)
        if _on_device(storage):
            if key not in memo:
                buf = torch.UntypedStorage(0)
                if n:
                    buf = pool.take(n, pinned=True) if pool is not None else _new(n)
                    if device is not None:
                        device.append((buf, storage, key in held))
                    else:
                        _bytes(buf).copy_(_bytes(storage))
                memo[key] = buf
        elif key in held:
            if kept is not None:
                kept.append(obj)
            if staged is None or pool is None:
                return obj
            if key not in memo:
                memo[key] = pool.take(n)
                staged.append((memo[key], storage))
        elif key not in memo:
            memo[key] = pool.copy(storage) if pool is not None else storage.clone()
        out = torch.empty(0, dtype=t.dtype, device=memo[key].device)
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

    def __init__(self, hook: Callable[[str], None] | None = None, accel: Any = None) -> None:
        self.hook = hook or (lambda point: None)
        self.stager = DeviceStager(accel)
        self.pool = BufferPool(self.stager.pinned)
        # (job, release): release runs once the job is done or skipped (held files).
        self._q: queue.Queue[tuple[Callable[[], None], Callable[[], None]] | None] = queue.Queue()
        self._error: BaseException | None = None
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
