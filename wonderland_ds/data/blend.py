"""Weighted sources: which source each position of the sample stream reads, in O(1) memory.

Megatron's ``BlendedDataset`` decides sample by sample which source is furthest behind its
weight and keeps the answer as two index arrays (source, sample within it) of the whole
run's length. The interleave here is as deterministic but needs no arrays: the sources are
the leaves of a balanced binary tree, and each inner node splits the positions that reach it
between its two sides with a Bresenham line, ``left(p) = floor(p * r + 1/2)`` positions of
the first ``p`` going left, ``r`` its left side's share of the weight. A position's source and
its place within that source follow from integer arithmetic, one tree level at a time, and
every source is within one sample per level of its exact share, at any position, in any
global batch. The place within the source is then read through the source's own seeded
:class:`~wonderland_ds.data.sampler.GlobalSampler`, so a source that runs out starts a new
epoch in a new order while the others go on.

Positions are global, so the blend is the same for any world size with the same global
batch, and a resume continues at the exact next sample from the count of samples consumed.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np

from wonderland_ds.data.sampler import GlobalSampler

ORDER = "bresenham-tree-1"
"""The name of the blend's order, recorded with the loader state."""
_DEN = 1 << 30
"""Shares are fractions of 2**30: a weight is rounded by at most 2**-31."""


@dataclass(frozen=True)
class Source:
    name: str
    weight: float
    """Normalized: the sources' weights sum to 1."""
    first: int
    """The source's first sample in the dataset's index space."""
    size: int
    """Its samples (one epoch)."""


@dataclass(frozen=True)
class _Node:
    leaf: int  # source index, or -1 for an inner node
    num: int = 0  # the left side's share, in 1 / _DEN
    left: _Node | None = None
    right: _Node | None = None


def _tree(weights: list[float], first: int = 0) -> tuple[_Node, float]:
    if len(weights) == 1:
        return _Node(first), weights[0]
    half = len(weights) // 2
    left, wl = _tree(weights[:half], first)
    right, wr = _tree(weights[half:], first + half)
    num = min(_DEN - 1, max(1, round(wl / (wl + wr) * _DEN)))
    return _Node(-1, num, left, right), wl + wr


def _left(p: np.ndarray, num: int) -> np.ndarray:
    """Positions of the first ``p`` reaching a node that go to its left side:
    ``floor((p * num + DEN / 2) / DEN)``, split so that no product leaves int64."""
    hi, lo = np.divmod(p, np.int64(_DEN))
    return hi * np.int64(num) + (lo * np.int64(num) + np.int64(_DEN // 2)) // np.int64(_DEN)


class Blend:
    """The interleave of ``sources`` (their weights normalized) and each source's order."""

    def __init__(self, sources: list[Source], seed: int) -> None:
        self.sources = sources
        self.seed = seed
        self._root, _ = _tree([s.weight for s in sources])
        self._orders = [GlobalSampler(s.size, _source_seed(seed, s.name)) for s in sources]

    def counts(self, p: int) -> list[int]:
        """Samples each source contributed to stream positions ``[0, p)``."""
        out = [0] * len(self.sources)

        def walk(node: _Node, n: int) -> None:
            if node.leaf >= 0:
                out[node.leaf] = n
                return
            left = int(_left(np.asarray([n], np.int64), node.num)[0])
            assert node.left is not None and node.right is not None
            walk(node.left, left)
            walk(node.right, n - left)

        walk(self._root, p)
        return out

    def assign(self, pos: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(source, place within the source's own stream) of each stream position."""
        pos = np.asarray(pos, dtype=np.int64)
        src = np.zeros(len(pos), dtype=np.int64)
        place = pos.copy()
        todo: list[tuple[_Node, np.ndarray]] = [(self._root, np.arange(len(pos)))]
        while todo:
            node, sel = todo.pop()
            if node.leaf >= 0:
                src[sel] = node.leaf
                continue
            p = place[sel]
            before, after = _left(p, node.num), _left(p + 1, node.num)
            go_left = after > before
            place[sel] = np.where(go_left, before, p - before)
            assert node.left is not None and node.right is not None
            todo += [(node.left, sel[go_left]), (node.right, sel[~go_left])]
        return src, place

    def indices(self, start: int, count: int) -> np.ndarray:
        """Dataset indices of stream positions ``[start, start + count)``: the
        :class:`~wonderland_ds.data.sampler.GlobalSampler` interface."""
        src, place = self.assign(np.arange(start, start + count, dtype=np.int64))
        out = np.empty(count, dtype=np.int64)
        for s in np.unique(src):
            sel = src == s
            source = self.sources[int(s)]
            q = place[sel]
            out[sel] = source.first + self._orders[int(s)].indices(int(q[0]), len(q))
            # A source's places in a stream range are consecutive: one read of its order.
            assert int(q[-1]) - int(q[0]) == len(q) - 1
        return out

    def between(self, a: int, b: int) -> list[int]:
        """Samples each source contributed to stream positions ``[a, b)``."""
        return [y - x for x, y in zip(self.counts(a), self.counts(b))]

    def epoch_starts(self, a: int, b: int) -> list[tuple[str, int]]:
        """(source, epoch) for each epoch after the first that positions ``[a, b)`` start."""
        out = []
        for s, x, y in zip(self.sources, self.counts(a), self.counts(b)):
            # Epoch k starts at the source's sample k * size: read in [a, b) when x <= k*size < y.
            out += [(s.name, k) for k in range(max(1, -(-x // s.size)), -(-y // s.size))]
        return out

    def epochs(self, p: int) -> dict[str, dict[str, float | int]]:
        """Each source's samples and epochs (started; and as a fraction) after ``p``."""
        return {
            s.name: {
                "weight": round(s.weight, 6),
                "samples": n,
                "epoch": n // s.size,
                "epochs": round(n / s.size, 4),
            }
            for s, n in zip(self.sources, self.counts(p))
        }


def _source_seed(seed: int, name: str) -> int:
    """A source's order seed: independent of the other sources and of their order."""
    return int.from_bytes(hashlib.sha256(f"{seed}\0{name}".encode()).digest()[:8], "big") >> 1
