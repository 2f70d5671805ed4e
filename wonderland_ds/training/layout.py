"""The guards' per-step vector: where each number sits in the row every check all-reduces.

One float64 row per trained step: ``[loss sum, sample digest, grad norm per rank,
parameter fingerprint per rank, step s, probe s, extra...]``. Summed over ranks, every rank
reads the same numbers; each rank fills only its own slots of the per-rank parts.
"""

from __future__ import annotations


class VectorLayout:
    """Offsets into one step's row for a world of ``world`` ranks and ``extra`` trailing slots
    of the caller's (the trainer's: whether the rank's checkpoint writer is busy)."""

    __slots__ = ("world", "norms", "prints", "step_s", "probe_s", "first_extra", "size")
    LOSS = 0
    DIGEST = 1

    def __init__(self, world: int, extra: int = 0) -> None:
        self.world = world
        self.norms = slice(2, 2 + world)  # each rank's local gradient norm
        self.prints = slice(2 + world, 2 + 2 * world)  # each rank's parameter fingerprint
        self.step_s = 2 + 2 * world  # summed: the mean step time is this over world
        self.probe_s = 3 + 2 * world  # summed: the mean transfer-probe time likewise
        self.first_extra = 4 + 2 * world
        self.size = 4 + 2 * world + extra

    def norm(self, rank: int) -> int:
        return 2 + rank

    def fingerprint(self, rank: int) -> int:
        return 2 + self.world + rank

    def extra(self, i: int) -> int:
        return self.first_extra + i
