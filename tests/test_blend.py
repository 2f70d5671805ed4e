"""Weighted sources: the blend's proportions in every global batch, its determinism for any
world size, an exact resume, new epochs in new orders, O(1) memory; the config's mixes and
``check``'s epoch warning."""

from __future__ import annotations

import json
import time
import tracemalloc

import numpy as np
import pytest

from wonderland_ds.data.blend import Blend, Source
from wonderland_ds.data.sampler import Prefetcher


def sources(weights, sizes) -> list[Source]:
    total, first, out = sum(weights), 0, []
    for i, (w, n) in enumerate(zip(weights, sizes)):
        out.append(Source(f"s{i}", w / total, first, n))
        first += n
    return out


def owner(srcs: list[Source], idx: np.ndarray) -> np.ndarray:
    """Which source each dataset index lies in."""
    firsts = np.asarray([s.first for s in srcs])
    return np.searchsorted(firsts, idx, side="right") - 1


MIXES = [
    ([0.7, 0.3], [500, 400]),
    ([0.5, 0.3, 0.2], [300, 1000, 50]),
    ([1, 2, 3, 4, 5], [97, 89, 83, 79, 73]),
    ([0.98, 0.02], [10_000, 7]),
]


@pytest.mark.parametrize(("weights", "sizes"), MIXES)
def test_every_global_batch_takes_the_weights_share_of_each_source(weights, sizes):
    srcs = sources(weights, sizes)
    blend = Blend(srcs, seed=5)
    levels = int(np.ceil(np.log2(len(srcs))))  # the tree's depth: one sample off per level
    for batch in (8, 48, 256):
        for k in range(40):
            idx = blend.indices(k * batch, batch)
            got = np.bincount(owner(srcs, idx), minlength=len(srcs))
            want = np.asarray([s.weight for s in srcs]) * batch
            assert np.all(np.abs(got - want) <= levels + 1), (batch, k, got, want)
            assert np.array_equal(got, blend.between(k * batch, (k + 1) * batch))
    # Cumulatively: within one sample per level of the share at any position (shares are the
    # weights rounded to 2**-30).
    for p in (1, 7, 1000, 12_345, 10**9, 10**12, 10**15):
        counts = blend.counts(p)
        bound = levels + p * 2**-30
        assert sum(counts) == p
        assert all(abs(c - s.weight * p) <= bound for c, s in zip(counts, srcs)), (p, counts)


def test_a_source_that_runs_out_starts_a_new_epoch_in_a_new_order():
    srcs = sources([0.5, 0.5], [40, 1000])
    blend = Blend(srcs, seed=1)
    idx = blend.indices(0, 160)  # 80 samples of s0: two epochs
    small = idx[owner(srcs, idx) == 0]
    e0, e1 = small[:40], small[40:]
    assert sorted(e0) == sorted(e1) == list(range(40))  # each epoch: every sample once
    assert not np.array_equal(e0, e1)  # a new order
    big = idx[owner(srcs, idx) == 1]
    assert len(set(big.tolist())) == 80  # the other source goes on in its first epoch
    # Positions [0, 80) read s0's first epoch; its second starts in [80, 160), its third
    # with position 160 or 161.
    assert blend.epoch_starts(0, 80) == [] and blend.epoch_starts(80, 160) == [("s0", 1)]
    assert blend.epoch_starts(160, 162) == [("s0", 2)] and blend.epoch_starts(0, 162) == [
        ("s0", 1),
        ("s0", 2),
    ]
    e = blend.epochs(160)
    assert e["s0"] == {"weight": 0.5, "samples": 80, "epoch": 2, "epochs": 2.0}
    assert e["s1"]["epoch"] == 0 and e["s1"]["epochs"] == 0.08


def test_a_sources_order_does_not_depend_on_the_others():
    """A source's seed is its name's: adding a source changes its share, not its order."""
    a = Blend([Source("web", 1.0, 0, 100)], seed=3).indices(0, 100)
    two = [Source("web", 0.5, 0, 100), Source("code", 0.5, 100, 50)]
    idx = Blend(two, seed=3).indices(0, 200)
    assert np.array_equal(idx[idx < 100], a)


def test_resume_is_positional_and_the_same_for_any_world_size():
    """A fresh blend at position k gives the rest of the stream; a step's samples are the
    same on 1, 2 or 4 ranks with the same global batch (the Prefetcher's slices)."""
    srcs = sources([0.6, 0.3, 0.1], [200, 300, 100])
    whole = Blend(srcs, seed=9).indices(0, 2000)
    for k in (1, 63, 64, 999):
        rest = Blend(srcs, seed=9).indices(k, 2000 - k)
        assert np.array_equal(rest, whole[k:])
    assert not np.array_equal(Blend(srcs, seed=10).indices(0, 2000), whole)

    x = np.arange(600, dtype=np.float32)[:, None]
    y = np.arange(600, dtype=np.int64)
    batch, steps, start = 16, 6, 48
    seen = {}
    for world, micro, gas in ((1, 16, 1), (2, 4, 2), (4, 2, 2)):
        per_step: list[list[int]] = [[] for _ in range(steps)]
        for rank in range(world):
            p = Prefetcher(x, y, Blend(srcs, 9), start, micro, gas, world, rank, steps)
            for i in range(steps * gas):
                per_step[i // gas] += [int(v) for v in np.asarray(p.next().y)]
            p.close()
        seen[world] = [sorted(s) for s in per_step]
    assert seen[1] == seen[2] == seen[4]
    assert seen[1][0] == sorted(whole[start : start + batch].tolist())


def test_the_blend_holds_no_array_the_size_of_the_stream():
    """O(1) memory: reading at position 10**12 costs what reading at 0 does."""
    srcs = sources([0.7, 0.2, 0.1], [10**9, 10**8, 10**7])
    blend = Blend(srcs, seed=2)
    tracemalloc.start()
    t0 = time.perf_counter()
    for start in (0, 10**6, 10**12):
        idx = blend.indices(start, 4096)
        assert len(idx) == 4096 and idx.min() >= 0 and idx.max() < 10**9 + 10**8 + 10**7
    took = time.perf_counter() - t0
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 4 << 20, peak  # a few 4096-long arrays, not the stream
    assert took < 2.0, took


def test_the_stream_is_the_same_bytes_every_time():
    srcs = sources([0.7, 0.3], [500, 400])
    a = Blend(srcs, seed=5).indices(0, 5000).tobytes()
    assert Blend(srcs, seed=5).indices(0, 5000).tobytes() == a
    # Two sources are one Bresenham line: position p reads the first source when
    # floor(w * (p + 1) + 1/2) > floor(w * p + 1/2), w its share (exact for w = 3/4).
    from fractions import Fraction

    w = Fraction(3, 4)
    want = [
        0 if (w * (p + 1) + Fraction(1, 2)) // 1 > (w * p + Fraction(1, 2)) // 1 else 1
        for p in range(1000)
    ]
    got = Blend(sources([3, 1], [500, 400]), seed=5).assign(np.arange(1000))[0].tolist()
    assert got == want


# --- the config's mixes -------------------------------------------------------------------


def _data(tmp_path, train, **more):
    from wonderland_ds.config.settings import TokenFiles

    body = {"train": train, "heldout": {"h": [str(tmp_path / "h.bin")]}, "seq_len": 8} | more
    return TokenFiles.model_validate(body)


@pytest.mark.parametrize(
    ("train", "message"),
    [
        ({}, "names no source"),
        ({"web": {"files": ["a.bin"], "weight": 0}}, "greater than 0"),
        ({"web": {"files": [], "weight": 1}}, "at least 1 item"),
        ({"we b": {"files": ["a.bin"], "weight": 1}}, "source name 'we b'"),
        ({"web": {"files": ["a.bin"]}}, "weight"),
        ({"web": {"files": ["a.bin"], "weight": 1, "wieght": 2}}, "wieght"),
        ([], "lists no files"),
    ],
)
def test_a_bad_mix_is_refused_naming_the_field(tmp_path, train, message):
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match=message):
        _data(tmp_path, train)


def test_stage_train_is_keyed_by_stage_and_chosen_per_stage(tmp_path):
    from pydantic import ValidationError

    mix = {"hq": {"files": ["hq.bin"], "weight": 1}}
    data = _data(tmp_path, ["a.bin"], stage_train={"16": mix})
    assert data.mix_for(15) == ("train", ["a.bin"])
    name, got = data.mix_for(16)
    assert name == "stage_train.16" and got["hq"].files == ["hq.bin"]
    with pytest.raises(ValidationError, match="not a stage number"):
        _data(tmp_path, ["a.bin"], stage_train={"sixteen": mix})


def test_check_warns_when_a_weight_would_repeat_a_source_too_often(tmp_path, capsys):
    """Stages 15 and 16 read train's stream on: 2 x 50 steps x 64 samples = 6400 samples,
    90% of them from a source of 800 samples is 7.2 epochs, past data.max_epochs 4."""
    from tests.helpers.util import REPO
    from tests.test_causal_lm import tiny_model
    from wonderland_ds.cli import main as cli

    model = tiny_model(tmp_path / "model")
    rng = np.random.default_rng(0)
    for name, n in (("small", 800 * 16), ("big", 20_000 * 16)):
        rng.integers(0, 64, n).astype(np.uint16).tofile(tmp_path / f"{name}.bin")
    # 16 x 4 x 1 rank = 64 samples a step
    config = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    config["wonderland"] = {
        "task": "causal-lm",
        "train_steps": 50,
        "model": {"hf": str(model)},
        "data": {
            "train": {
                "small": {"files": [str(tmp_path / "small.bin")], "weight": 0.9},
                "big": {"files": [str(tmp_path / "big.bin")], "weight": 0.1},
            },
            "heldout": {"h": [str(tmp_path / "small.bin")]},
            "dtype": "uint16",
            "seq_len": 16,
        },
    }
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    assert cli.main(["check", str(path), "--world-size", "1", "--json"]) in (0, 1)
    found = [f for f in json.loads(capsys.readouterr().out) if f["rule"] == "data-epochs"]
    assert len(found) == 1, found
    assert "source 'small' (weight 0.9) would be read 7.2 times" in found[0]["message"]
    config["wonderland"]["data"]["max_epochs"] = 8
    path.write_text(json.dumps(config))
    cli.main(["check", str(path), "--world-size", "1", "--json"])
    assert not [f for f in json.loads(capsys.readouterr().out) if f["rule"] == "data-epochs"]
