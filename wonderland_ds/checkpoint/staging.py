"""What an asynchronous save copies, and into what: the snapshot and its buffers.

:func:`snapshot` copies a state dict so that later training steps cannot change it (each
tensor storage once, views rebuilt on the copies), leaving the storages only an optimizer step
writes to be copied later by the writer thread (:func:`fill`); :class:`BufferPool` keeps the
host buffers it copies into from one save to the next; :class:`DeviceStager` queues the copies
of device storages into page-locked host buffers on a side stream. The writer thread
(``async_save.py``) serializes what they hold.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from collections.abc import Callable
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
