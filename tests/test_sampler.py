"""The deterministic sampler: a step's samples do not depend on world size or split."""

from __future__ import annotations

import numpy as np
import pytest

from wonderland_ds.data.sampler import GlobalSampler, LoaderState, sample_digest


def step_samples(sampler: GlobalSampler, start: int, micro: int, gas: int, world: int):
    return np.sort(
        np.concatenate(
            [
                sampler.micro_batch(start, m, micro, world, r)
                for m in range(gas)
                for r in range(world)
            ]
        )
    )


@pytest.mark.parametrize(
    ("micro", "gas", "world"), [(8, 6, 1), (8, 3, 2), (8, 2, 3), (4, 4, 3), (16, 1, 3), (24, 2, 1)]
)
def test_same_samples_per_step_for_any_split(micro, gas, world):
    s = GlobalSampler(1116, seed=7)
    ref = GlobalSampler(1116, seed=7)
    for step in range(30):  # crosses an epoch boundary (30 x 48 > 1116)
        start = step * 48
        got = step_samples(s, start, micro, gas, world)
        want = np.sort(ref.indices(start, 48))
        assert np.array_equal(got, want)


def test_every_sample_once_per_epoch_and_epochs_differ():
    s = GlobalSampler(100, seed=3)
    e0, e1 = s.indices(0, 100), s.indices(100, 100)
    assert sorted(e0) == list(range(100)) and sorted(e1) == list(range(100))
    assert not np.array_equal(e0, e1)


def test_resume_is_positional_and_seed_matters():
    a = GlobalSampler(500, seed=1).indices(1234, 10)
    b = GlobalSampler(500, seed=1).indices(1234, 10)  # a fresh sampler: no replay needed
    c = GlobalSampler(500, seed=2).indices(1234, 10)
    assert np.array_equal(a, b) and not np.array_equal(a, c)


def test_loader_state_epoch():
    st = LoaderState(seed=7, samples_consumed=2500, fingerprint="f", dataset_size=1000)
    assert st.epoch == 2 and st.to_dict()["epoch"] == 2


@pytest.mark.parametrize("threshold", [0.0, 10.0])  # 0: always hand over to the thread
def test_prefetcher_yields_the_same_batches_inline_or_threaded(threshold):
    from wonderland_ds.data.sampler import Prefetcher

    x = np.arange(200 * 3, dtype=np.float32).reshape(200, 3)
    y = np.arange(200, dtype=np.int64)
    s = GlobalSampler(200, seed=5)
    p = Prefetcher(x, y, s, 40, micro=4, gas=2, world=2, rank=1, steps=12, thread_above_s=threshold)
    got = [p.next() for _ in range(24)]
    with pytest.raises(StopIteration):
        p.next()
    p.close()
    assert p.threaded == (threshold == 0.0)
    assert_rank1_stream(got, x, s)


def assert_rank1_stream(got, x, s):
    """``got``: rank 1's micro-batches (4 samples, 2 a step, 2 ranks) from position 40 on,
    each as read alone, a step at a time."""
    for i, mb in enumerate(got):
        step, m = divmod(i, 2)
        pos = 40 + step * 16 + (m * 2 + 1) * 4
        assert mb.position == pos
        assert mb.y.tolist() == s.indices(pos, 4).tolist()
        assert np.array_equal(mb.x.numpy(), x[s.indices(pos, 4)])
        assert mb.digest == sample_digest(s.indices(pos, 4))


class _SlowSource:
    """An array whose reads take ``slow_s`` each: always, or only for the first ``first`` reads
    (a process's one-time warm-up)."""

    def __init__(self, a: np.ndarray, slow_s: float, first: int | None) -> None:
        self.a, self.slow_s, self.first, self.reads = a, slow_s, first, 0
        self.shape, self.dtype = a.shape, a.dtype

    def __getitem__(self, idx):
        import time

        self.reads += 1
        if self.first is None or self.reads <= self.first:
            time.sleep(self.slow_s)
        return self.a[idx]


@pytest.mark.parametrize(("first", "threaded"), [(2, False), (None, True)])
def test_prefetcher_judges_its_source_by_the_median_read(first, threaded):
    """Slow first reads (warm-up) must not hand a fast source to a thread for good (measured on
    digits: the first reads took 2-11 ms, later ones 45 us; by the mean it went threaded and a
    read then cost 145 us); a source that stays slow still gets the thread."""
    from wonderland_ds.data.sampler import Prefetcher

    x = _SlowSource(np.zeros((64, 3), dtype=np.float32), 0.01, first)  # mean of 8: 2.5 ms
    y = np.zeros(64, dtype=np.int64)
    p = Prefetcher(x, y, GlobalSampler(64, 1), 0, 4, 1, 1, 0, 12, thread_above_s=2e-3)
    for _ in range(10):
        p.next()
    p.close()
    assert x.reads >= 8 and p.threaded == threaded


class _CountedSource:
    """An array that counts its reads (fancy-indexed gathers)."""

    def __init__(self, a: np.ndarray) -> None:
        self.a, self.reads = a, 0
        self.shape, self.dtype = a.shape, a.dtype

    def __getitem__(self, idx):
        self.reads += 1
        return self.a[idx]


@pytest.mark.parametrize(
    ("chunk_steps", "chunk_bytes", "reads"),
    [
        (16, 1 << 20, 8 + 2),  # 8 timed reads, then chunks of 16 steps: 16 + 6 of 30
        (5, 1 << 20, 8 + 5),  # chunks of 5: 5 + 5 + 5 + 5 + 2
        (16, 1, 30),  # a chunk may hold no step: one step a read
        (1, 1 << 20, 30),
    ],
)
def test_prefetcher_reads_chunks_of_steps_with_the_same_batches(chunk_steps, chunk_bytes, reads):
    """Read in the loop, the steps after the timed first reads come in chunks (fewer numpy
    calls on cold CPU caches); positions, samples and digests are the same as a step at a
    time, across epoch boundaries (200 samples, 16 a step) and up to the last step."""
    from wonderland_ds.data.sampler import Prefetcher

    xa = np.arange(200 * 3, dtype=np.float32).reshape(200, 3)
    x, y = _CountedSource(xa), np.arange(200, dtype=np.int64)
    s = GlobalSampler(200, seed=5)
    p = Prefetcher(
        x,
        y,
        s,
        40,
        4,
        2,
        2,
        1,
        30,
        thread_above_s=10.0,
        chunk_steps=chunk_steps,
        chunk_bytes=chunk_bytes,
    )
    got = [p.next() for _ in range(60)]
    with pytest.raises(StopIteration):
        p.next()
    p.close()
    assert not p.threaded and x.reads == reads
    assert_rank1_stream(got, xa, s)
