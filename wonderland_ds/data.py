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
