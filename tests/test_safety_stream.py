"""World-size invariance of the stream the training loop really reads: every rank's
``Prefetcher`` (the loader of data/sampler.py), not the sampler's own helpers.

For the same global batch, 2 and 3 ranks must consume the same samples at the same stream
positions, step by step, across a resume point and an epoch boundary, in the probe reads and
in the chunked reads that follow them.
"""

from __future__ import annotations

import numpy as np
import pytest

from wonderland_ds.data.sampler import GlobalSampler, Prefetcher, sample_digest

N, SEED, STEPS, BATCH = 97, 11, 14, 12  # 14 x 12 samples from position 41: two epochs of 97
START = 41  # a resumed stream: samples_consumed of an earlier stage


def stream(world: int, micro: int, gas: int, **kw) -> dict[int, int]:
    """Stream position -> dataset index, as every rank's loader delivers it."""
    assert micro * gas * world == BATCH
    x = np.arange(N * 2, dtype=np.float32).reshape(N, 2)
    y = np.arange(N, dtype=np.int64)  # the label is the sample's index
    seen: dict[int, int] = {}
    for rank in range(world):
        loader = Prefetcher(
            x, y, GlobalSampler(N, SEED), START, micro, gas, world, rank, STEPS, **kw
        )
        try:
            for _ in range(STEPS * gas):
                mb = loader.next()
                idx = mb.y.numpy()
                assert len(idx) == micro
                # The features travel with their labels: a sample is read whole.
                assert np.array_equal(mb.x.numpy(), x[idx])
                assert mb.digest == sample_digest(idx)
                for k, i in enumerate(idx.tolist()):
                    assert mb.position + k not in seen, f"position {mb.position + k} read twice"
                    seen[mb.position + k] = i
            with pytest.raises(StopIteration):
                loader.next()
        finally:
            loader.close()
    return seen


def per_step(seen: dict[int, int]) -> list[list[int]]:
    return [
        [seen[p] for p in range(START + s * BATCH, START + (s + 1) * BATCH)] for s in range(STEPS)
    ]


@pytest.mark.parametrize(
    "kw",
    [
        {},  # production's defaults: probe reads, then chunks of steps
        {"chunk_steps": 3},
        {"thread_above_s": 0.0},  # handed over to the read-ahead thread
    ],
    ids=["default", "chunks-of-3", "threaded"],
)
def test_two_and_three_ranks_read_the_same_global_stream(kw):
    two = stream(2, micro=3, gas=2, **kw)
    three = stream(3, micro=2, gas=2, **kw)
    three_gas1 = stream(3, micro=4, gas=1, **kw)
    positions = list(range(START, START + STEPS * BATCH))
    for got in (two, three, three_gas1):
        assert sorted(got) == positions  # every position of the steps, once, nothing beyond
    assert per_step(two) == per_step(three) == per_step(three_gas1)
    # One epoch holds every sample once: the stream is a permutation, not a resampling.
    first_epoch = [two[p] for p in range(N, 2 * N) if p in two]
    assert len(first_epoch) == len(set(first_epoch))


def test_the_stream_continues_where_a_resume_starts():
    """Steps 0-13 from position 41 are, sample for sample, steps 2-15 of a stream that
    started 24 samples earlier (a resume two steps in reads on from there)."""
    whole = {}
    x = np.zeros((N, 1), dtype=np.float32)
    y = np.arange(N, dtype=np.int64)
    for rank in range(2):
        loader = Prefetcher(
            x, y, GlobalSampler(N, SEED), START - 2 * BATCH, 3, 2, 2, rank, STEPS + 2
        )
        for _ in range((STEPS + 2) * 2):
            mb = loader.next()
            whole.update({mb.position + k: int(i) for k, i in enumerate(mb.y.tolist())})
        loader.close()
    resumed = stream(2, micro=3, gas=2)
    assert {p: whole[p] for p in resumed} == resumed
