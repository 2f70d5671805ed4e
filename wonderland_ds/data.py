"""A deterministic, resumable sampler: the global order depends on (seed, epoch) only.

Position ``p`` in the stream is sample ``perm(seed, p // N)[p % N]``. Step ``s`` consumes the
global batch ``[p, p + B)`` with ``B = micro x grad_acc x world``, split across micro-steps and
ranks by position, so the samples of a step are the same for any world size and any micro /
grad-acc split with the same global batch. The state is the number of samples consumed: a
resume continues at the exact next sample in O(1). If the global batch changes between stages,
the stream continues at the same position; only the grouping into steps changes.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class LoaderState:
    seed: int
    samples_consumed: int
    fingerprint: str
    dataset_size: int

    @property
    def epoch(self) -> int:
        return self.samples_consumed // self.dataset_size

    def to_dict(self) -> dict[str, object]:
        return {**asdict(self), "epoch": self.epoch}


class GlobalSampler:
    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed = n, seed
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) > 2:
                self._perms.pop(min(self._perms))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.n)
        return self._perms[epoch]

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of stream positions ``[start, start + count)``."""
        pos = np.arange(start, start + count)
        out = np.empty(count, dtype=np.int64)
        for epoch in np.unique(pos // self.n):
            sel = pos // self.n == epoch
            out[sel] = self._perm(int(epoch))[pos[sel] % self.n]
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
    return float((((indices.astype(np.int64) + 1) * 2654435761) % 2147483647).sum())


@dataclass
class MicroBatch:
    x: Any
    y: Any
    position: int
    """Stream position of the micro-batch's first sample (seeds its dropout noise)."""
    digest: float


class Prefetcher:
    """Reads this rank's next micro-batches from the memory-mapped cache on a background
    thread, so the step loop only waits when the data is really late. ``wait_s`` accumulates
    the time the loop was blocked (the data stall)."""

    def __init__(
        self,
        x: np.ndarray,
        y: np.ndarray,
        sampler: GlobalSampler,
        start: int,
        micro: int,
        gas: int,
        world: int,
        rank: int,
        steps: int,
        x_dtype: Any = None,
        depth: int = 16,
    ) -> None:
        import queue
        import threading

        import torch

        self._torch, self.wait_s = torch, 0.0
        self._q: queue.Queue[MicroBatch | BaseException | None] = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        batch = micro * gas * world

        def work() -> None:
            try:
                for i in range(steps * gas):
                    if self._stop.is_set():
                        return
                    step, m = divmod(i, gas)
                    pos = start + step * batch + (m * world + rank) * micro
                    idx = sampler.indices(pos, micro)
                    order = np.argsort(idx)  # sorted reads are kinder to a memory map
                    xs, ys = (
                        np.empty((micro, *x.shape[1:]), x.dtype),
                        np.empty((micro, *y.shape[1:]), y.dtype),
                    )
                    xs[order], ys[order] = x[idx[order]], y[idx[order]]
                    tx = torch.from_numpy(xs)
                    if x_dtype is not None and tx.is_floating_point():
                        tx = tx.to(x_dtype)
                    self._q.put(MicroBatch(tx, torch.from_numpy(ys), pos, sample_digest(idx)))
                self._q.put(None)
            except BaseException as exc:  # surfaced in the step loop, never swallowed
                self._q.put(exc)

        self._thread = threading.Thread(target=work, name="wonderland-prefetch", daemon=True)
        self._thread.start()

    def next(self) -> MicroBatch:
        import time

        t0 = time.perf_counter()
        item = self._q.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            raise item
        if item is None:
            raise StopIteration("prefetcher exhausted")
        return item

    def close(self) -> None:
        self._stop.set()
        while not self._q.empty():
            self._q.get_nowait()
        self._thread.join(timeout=5)
