"""Token files read in place, their cheap fingerprint, and the O(1) sampler over them."""

from __future__ import annotations

import time

import numpy as np
import pytest

from wonderland_ds.core.findings import Refused
from wonderland_ds.data.sampler import GlobalSampler, Prefetcher
from wonderland_ds.data.tokens import (
    BLOCK_BYTES,
    FINGERPRINT_BLOCKS,
    IGNORE,
    TokenData,
    expand,
    open_files,
)


def write(path, tokens, dtype=np.uint16):
    np.asarray(tokens, dtype=dtype).tofile(path)
    return path


def data(paths, seq_len=4, pad_tail=False, dtype="uint16"):
    return TokenData(open_files(list(paths), dtype, "test"), seq_len, pad_tail)


def test_windows_stay_inside_their_file_and_are_int64(tmp_path):
    a = write(tmp_path / "a.bin", range(10))  # 2 windows of 4, 2 tokens left over
    b = write(tmp_path / "b.bin", range(100, 109))  # 2 windows, 1 left over
    d = data([a, b])
    assert len(d) == 4 and d.tokens_per_sample == 4
    x, y = d.take(np.array([0, 1, 2, 3]))
    assert x.dtype == np.int64 and y.dtype == np.int64
    assert x.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7], [100, 101, 102, 103], [104, 105, 106, 107]]
    assert (x == y).all()  # labels are the inputs (transformers shifts them)
    x, _ = d.take(np.array([3, 0]))  # any order
    assert x[:, 0].tolist() == [104, 0]


def test_heldout_tail_is_padded_with_the_ignore_label(tmp_path):
    a = write(tmp_path / "a.bin", range(10))  # tail of 2 tokens: a sample
    b = write(tmp_path / "b.bin", range(100, 109))  # tail of 1 token: nothing to predict
    d = data([a, b], pad_tail=True)
    assert len(d) == 5
    x, y = d.take(np.array([2]))
    assert x.tolist() == [[8, 9, 0, 0]] and y.tolist() == [[8, 9, IGNORE, IGNORE]]


def test_uint32_and_int32_files(tmp_path):
    big = write(tmp_path / "big.bin", [70000, 1, 2, 3], np.uint32)
    x, _ = data([big], dtype="uint32").take(np.array([0]))
    assert x.tolist() == [[70000, 1, 2, 3]]
    neg = write(tmp_path / "neg.bin", [5, -1, 2, 3], np.int32)
    assert data([neg], dtype="int32").smallest_token() == -1


def test_a_size_that_is_not_whole_tokens_is_refused(tmp_path):
    odd = tmp_path / "odd.bin"
    odd.write_bytes(b"\x01\x00\x02")
    with pytest.raises(Refused) as exc:
        open_files([odd], "uint16", "wonderland.data.train")
    (f,) = exc.value.findings
    assert f.rule == "data-size" and "3 bytes" in f.message and f.path == "wonderland.data.train"


def test_missing_files_and_empty_globs_are_refused_by_name(tmp_path):
    write(tmp_path / "t_1.bin", range(8))
    assert expand([str(tmp_path / "t_*.bin")], "w") == [tmp_path / "t_1.bin"]
    with pytest.raises(Refused) as exc:
        expand([str(tmp_path / "none_*.bin"), str(tmp_path / "gone.bin")], "w")
    msgs = [f.message for f in exc.value.findings]
    assert len(msgs) == 2 and "matches no file" in msgs[0] and "gone.bin" in msgs[1]


def test_fingerprint_catches_size_changes_and_flips_in_sampled_blocks(tmp_path):
    tokens = np.arange(2_000_000) % 60_000  # 4 MB: four times the 16 sampled blocks
    path = write(tmp_path / "c.bin", tokens)
    base, largest = data([path]).fingerprint("t")
    assert largest == int(tokens.max())
    assert data([path]).fingerprint("t")[0] == base  # stable
    assert data([path], seq_len=8).fingerprint("t")[0] != base  # seq_len is part of it
    raw = bytearray(path.read_bytes())
    blocks = data([path]).sample_blocks()
    inside = blocks[3][1] + 10  # a byte inside a sampled block
    outside = next(  # and one in no sampled block
        o for o in range(0, len(raw), 2) if all(not (b <= o < b + len(d)) for _, b, d in blocks)
    )
    for at, caught in ((inside, True), (outside, False)):
        flipped = bytearray(raw)
        flipped[at] ^= 0xFF
        path.write_bytes(flipped)
        assert (data([path]).fingerprint("t")[0] != base) is caught, at
    path.write_bytes(raw + b"\x00\x00")  # one more token
    assert data([path]).fingerprint("t")[0] != base


def test_fingerprint_reads_a_bounded_amount_whatever_the_size(tmp_path):
    big = tmp_path / "big.bin"
    with open(big, "wb") as fh:  # a sparse 4 GB file: nothing on disk
        fh.truncate(4 << 30)
    d = data([big])
    t0 = time.perf_counter()
    fp, _ = d.fingerprint("t")
    took = time.perf_counter() - t0
    read = sum(len(b) for _, _, b in d.sample_blocks())
    assert read <= FINGERPRINT_BLOCKS * BLOCK_BYTES and took < 2.0, (read, took)
    assert len(d) == (2 << 30) // 4


@pytest.mark.parametrize("n", [1, 2, 3, 5, 17, 1000, 4096, 4097])
def test_sampler_is_a_bijection_per_epoch(n):
    s = GlobalSampler(n, seed=11)
    for epoch in range(3):
        got = s.indices(epoch * n, n)
        assert sorted(got.tolist()) == list(range(n))
    if n > 3:
        assert s.indices(0, n).tolist() != s.indices(n, n).tolist()  # epochs differ
        assert GlobalSampler(n, 12).indices(0, n).tolist() != s.indices(0, n).tolist()


def test_sampler_is_computed_per_position_not_materialized():
    n = 10**12  # a permutation of this many rows would need 8 TB
    s = GlobalSampler(n, seed=3)
    t0 = time.perf_counter()
    a = s.indices(5 * 10**11, 1000)
    assert time.perf_counter() - t0 < 1.0
    assert len(set(a.tolist())) == 1000 and a.min() >= 0 and a.max() < n
    assert (GlobalSampler(n, 3).indices(5 * 10**11 + 10, 5) == a[10:15]).all()  # any start


def test_loader_stream_over_token_files_is_the_same_for_any_world_size(tmp_path):
    path = write(tmp_path / "s.bin", np.arange(4 * 97) % 1000)
    d = data([path])
    sampler = GlobalSampler(len(d), seed=5)

    def steps(world, micro, gas, nsteps=6):
        per_step: list[list[int]] = [[] for _ in range(nsteps)]
        for rank in range(world):
            p = Prefetcher(d, None, sampler, 24, micro, gas, world, rank, nsteps)
            for s in range(nsteps):
                for _ in range(gas):
                    mb = p.next()
                    per_step[s] += mb.x[:, 0].tolist()
            p.close()
        return [sorted(v) for v in per_step]

    one = steps(1, 12, 1)
    assert steps(2, 3, 2) == one == steps(3, 2, 2)
    assert len({t for step in one for t in step}) == 6 * 12  # 72 distinct samples in 6 steps
