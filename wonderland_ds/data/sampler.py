"""A deterministic, resumable sampler: the global order depends on (seed, epoch) only.

Position ``p`` in the stream is sample ``perm(seed, p // N)[p % N]``, where ``perm`` is a seeded
bijection of ``[0, N)`` computed per position (a Feistel network with cycle walking): no
permutation is ever materialized, so memory is O(1) in the number of samples. Step ``s`` consumes the
global batch ``[p, p + B)`` with ``B = micro x grad_acc x world``, split across micro-steps and
ranks by position, so the samples of a step are the same for any world size and any micro /
grad-acc split with the same global batch. The state is the number of samples consumed: a
resume continues at the exact next sample in O(1). If the global batch changes between stages,
the stream continues at the same position; only the grouping into steps changes.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Protocol

import numpy as np

ORDER = "feistel-1"
"""The name of the stream's order, recorded with the loader state: a checkpoint whose data
order was computed another way is not resumed as if it were the same stream."""


@dataclass(frozen=True)
class LoaderState:
    seed: int
    samples_consumed: int
    fingerprint: str
    dataset_size: int
    order: str = ORDER
    mix: str = "train"
    stream_start: int = 0
    """Samples consumed before this mix's stream began."""
    blend: str | None = None
    sources: dict[str, dict[str, float | int]] | None = None

    @property
    def epoch(self) -> int:
        return (self.samples_consumed - self.stream_start) // self.dataset_size

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "epoch": self.epoch}


_ROUNDS = 6


def _mix(z: np.ndarray) -> np.ndarray:
    # splitmix64's finalizer: a well-mixed 64-bit hash of each element (uint64 arithmetic
    # wraps, which is the point).
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


class Order(Protocol):
    """A stream order: the dataset indices of stream positions ``[start, start + count)``
    (:class:`GlobalSampler`, or weighted sources' ``data.blend.Blend``)."""

    def indices(self, start: int, count: int) -> np.ndarray: ...


class GlobalSampler:
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        bits = max(2, (n - 1).bit_length())
        self._half = (bits + 1) // 2  # a balanced network on 2 * half bits >= n
        self._keys: dict[int, np.ndarray] = {}

    def _round_keys(self, epoch: int) -> np.ndarray:
        if epoch not in self._keys:
            if len(self._keys) > 2:
                self._keys.pop(min(self._keys))
            self._keys[epoch] = np.random.default_rng([self.seed, epoch]).integers(
                0, 2**63, size=_ROUNDS, dtype=np.uint64
            )
        return self._keys[epoch]

    def permute(self, epoch: int, at: np.ndarray) -> np.ndarray:
        """``perm(seed, epoch)[at]``: a bijection of ``[0, n)``, one position at a time."""
        keys, half = self._round_keys(epoch), np.uint64(self._half)
        low = np.uint64((1 << self._half) - 1)
        out = np.asarray(at, dtype=np.uint64).copy()
        todo = np.arange(len(out))
        while len(todo):  # cycle walking: re-encrypt what lands outside [0, n)
            v = out[todo]
            left, right = v >> half, v & low
            for k in keys:
                left, right = right, left ^ (_mix(right + k) & low)
            v = (left << half) | right
            out[todo] = v
            todo = todo[v >= np.uint64(self.n)]
        return out.astype(np.int64)

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of stream positions ``[start, start + count)``."""
        pos = np.arange(start, start + count, dtype=np.int64)
        epoch = start // self.n
        if (start + count - 1) // self.n == epoch:  # within one epoch (most reads)
            return self.permute(epoch, pos - epoch * self.n)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(pos // self.n):
            sel = pos // self.n == epoch
            out[sel] = self.permute(int(epoch), pos[sel] % self.n)
        return out

    def micro_batch(
        self, step_start: int, micro: int, micro_size: int, world: int, rank: int
    ) -> np.ndarray:
        """Indices for one rank's micro-batch ``micro`` of the step starting at ``step_start``."""
        offset = step_start + (micro * world + rank) * micro_size
        return self.indices(offset, micro_size)


def sample_digest(indices: np.ndarray) -> float:
    """An order-independent digest of a set of sample indices (exact in float64): summed over
    micro-batches and ranks it identifies the samples a step consumed, whatever the split."""
    return sample_digests(np.asarray(indices).reshape(1, -1))[0]


def sample_digests(rows: np.ndarray) -> list[float]:
    """:func:`sample_digest` of each row, in one pass."""
    return [float(d) for d in (((rows.astype(np.int64) + 1) * 2654435761) % 2147483647).sum(1)]


#: Steps a loader reads at once in the step loop (Prefetcher's ``chunk_steps`` default).
CHUNK_STEPS = 16


@dataclass
class MicroBatch:
    x: Any
    y: Any
    position: int
    """Stream position of the micro-batch's first sample (seeds its dropout noise)."""
    digest: float


class Prefetcher:
    """This rank's next micro-batches from the memory-mapped cache. ``wait_s`` accumulates the
    time the step loop waited for data (the data stall).

    A step's micro-batches are read together: one index computation, one sorted gather from
    the cache and one dtype conversion for all ``gas`` of them (the loop then takes views).
    The first steps are read in the loop and timed; only if the median read costs more than
    ``thread_above_s`` per micro-batch does a background thread take over and read ahead. For
    small in-memory batches a thread only competes with the step loop for the GIL (and for the
    cores: on this 2-core machine two ranks plus two readers measurably slowed every step).
    Read in the loop, up to ``chunk_steps`` steps are read at once, as long as they hold at
    most ``chunk_bytes``: between two reads the forward and backward evict the reader's code
    and data from the CPU caches, and each numpy call then costs ~10 times what it costs in a
    warm loop (digits ZeRO-2: a step's read 160 us inside the stage against 20 us alone), so
    fewer, larger reads cost less. The batches, their order and their digests are the same."""

    def __init__(
        self,
        x: Any,
        y: np.ndarray | None,
        sampler: Order,
        start: int,
        micro: int,
        gas: int,
        world: int,
        rank: int,
        steps: int,
        x_dtype: Any = None,
        depth: int = 16,
        thread_above_s: float = 2e-4,
        probe: int = 8,
        chunk_steps: int | None = None,
        chunk_bytes: int = 1 << 20,
    ) -> None:
        import queue
        import threading

        self.wait_s = 0.0
        # Plain ndarray views of the memory maps: fancy indexing an np.memmap builds memmap
        # subclass objects on every read.
        if y is None:  # x is a dataset with take(indices) -> (x, y): token files
            self._take = x.take
            row = x.row_bytes
        else:
            x, y = (np.asarray(a) if isinstance(a, np.memmap) else a for a in (x, y))
            self._take = None
            row = sum(np.dtype(a.dtype).itemsize * math.prod(a.shape[1:]) for a in (x, y))
        self._x, self._y, self._sampler, self._x_dtype = x, y, sampler, x_dtype
        self._start, self._micro, self._gas = start, micro, gas
        self._world, self._rank, self._steps = world, rank, steps
        # Where this rank's micro-batches sit in a step's global batch: micro-batch m of rank r
        # is [(m * world + r) * micro, ... + micro).
        self._offsets = [(m * world + rank) * micro for m in range(gas)]
        self._sel = np.concatenate([np.arange(o, o + micro) for o in self._offsets])
        steps_at_once = CHUNK_STEPS if chunk_steps is None else chunk_steps
        self._chunk = max(1, min(steps_at_once, chunk_bytes // max(1, row * micro * gas)))
        self._next_step = 0
        self._ready: list[MicroBatch] = []  # the rest of the step read inline, in order
        self._probe, self._threshold = probe, thread_above_s
        self._probe_s: list[float] = []
        self._q: queue.Queue[MicroBatch | BaseException | None] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._threading = threading

    def step_indices(self, step: int) -> np.ndarray:
        """This rank's sample indices of step ``step`` (counted from the loader's start), as
        :meth:`_read` reads them: what the stop agreement checks a step ahead."""
        batch = self._micro * self._gas * self._world
        return self._sampler.indices(self._start + step * batch, batch)[self._sel]

    def _read(self, step: int, steps: int = 1) -> list[MicroBatch]:
        """This rank's micro-batches of ``steps`` steps from ``step`` on, in order."""
        import torch

        batch = self._micro * self._gas * self._world
        base = self._start + step * batch
        idx = self._sampler.indices(base, batch * steps).reshape(steps, batch)[:, self._sel]
        idx = idx.reshape(-1)
        order = np.argsort(idx)  # sorted reads are kinder to a memory map
        n = len(idx)
        if self._take is not None:
            xo, yo = self._take(idx[order])
            xs, ys = np.empty_like(xo), np.empty_like(yo)
            xs[order], ys[order] = xo, yo
        else:
            assert self._y is not None
            xs = np.empty((n, *self._x.shape[1:]), self._x.dtype)
            ys = np.empty((n, *self._y.shape[1:]), self._y.dtype)
            xs[order], ys[order] = self._x[idx[order]], self._y[idx[order]]
        tx, ty = torch.from_numpy(xs), torch.from_numpy(ys)
        if self._x_dtype is not None and tx.is_floating_point():
            tx = tx.to(self._x_dtype)
        mb, gas = self._micro, self._gas
        digests = sample_digests(idx.reshape(steps * gas, mb))
        return [  # micro-batch j is step j // gas's micro-batch j % gas
            MicroBatch(
                tx[j * mb : (j + 1) * mb],
                ty[j * mb : (j + 1) * mb],
                base + (j // gas) * batch + self._offsets[j % gas],
                digests[j],
            )
            for j in range(steps * gas)
        ]

    def _work(self, first: int) -> None:
        try:
            for step in range(first, self._steps):
                for item in self._read(step):
                    if self._stop.is_set():
                        return
                    self._q.put(item)
            self._q.put(None)
        except BaseException as exc:  # surfaced in the step loop, never swallowed
            self._q.put(exc)

    def next(self) -> MicroBatch:
        import time

        t0 = time.perf_counter()
        if self._thread is None:
            if not self._ready:
                if self._next_step >= self._steps:
                    raise StopIteration("prefetcher exhausted")
                # One step a read while the first reads are timed, then chunks.
                k = 1 if self._next_step < self._probe else self._chunk
                k = min(k, self._steps - self._next_step)
                self._ready = self._read(self._next_step, k)[::-1]
                self._next_step += k
                took = time.perf_counter() - t0
                self.wait_s += took
                self._probe_s.append(took / self._gas)
                # The median, not the mean: the first reads of a process pay one-time costs
                # (numpy and torch code paths run for the first time, far slower than later
                # reads) that would hand a fast source to a thread for good.
                if (
                    self._next_step == self._probe
                    and sorted(self._probe_s)[self._probe // 2] > self._threshold
                ):
                    self._thread = self._threading.Thread(
                        target=self._work,
                        args=(self._next_step,),
                        name="wonderland-prefetch",
                        daemon=True,
                    )
                    self._thread.start()
            return self._ready.pop()
        if self._ready:  # the rest of the step read before the thread took over
            return self._ready.pop()
        got = self._q.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(got, BaseException):
            raise got
        if got is None:
            raise StopIteration("prefetcher exhausted")
        return got

    @property
    def threaded(self) -> bool:
        return self._thread is not None

    def close(self) -> None:
        self._stop.set()
        while not self._q.empty():
            self._q.get_nowait()
        if self._thread is not None:
            self._thread.join(timeout=5)
