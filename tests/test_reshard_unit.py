"""The load-time reshard's map and its reader, without launching ranks.

``transfers`` must rebuild, on any new world size, exactly the partition DeepSpeed would hold
there, reading nothing but that partition's elements; ``read_source`` must describe a real
checkpoint as DeepSpeed's own records do, with norms equal to DeepSpeed's consolidated weights,
and must refuse (universal path) what it does not know.
"""

from __future__ import annotations

import random
import shutil
from pathlib import Path

import numpy as np
import pytest

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.checkpoint import zero_partitions as zp
from wonderland_ds.run import preflight


def _group(rng: random.Random, n: int) -> list[zp.ParamSpan]:
    return [zp.ParamSpan(name=f"p{i}", numel=rng.randint(1, 40)) for i in range(n)]


def _partition(family, group, world, rank, values, pad=np.nan):
    """Rank ``rank``'s flat partition as DeepSpeed lays it out, written here from its rules and
    not from the code under test. ZeRO-1/2: the group's parameters flattened in order, padded
    to a multiple of 2 x world, split in equal slices. ZeRO-3: each parameter on its own, split
    in slices of ceil(numel / world), the last padded; a rank's slices concatenated."""
    if family == "zero12":
        flat = np.concatenate([values[p.name] for p in group])
        align = 2 * world
        padded = np.full(-(-len(flat) // align) * align, pad)
        padded[: len(flat)] = flat
        size = len(padded) // world
        return padded[rank * size : (rank + 1) * size]
    out = []
    for p in group:
        size = -(-p.numel // world)
        piece = np.full(size, pad)
        mine = values[p.name][rank * size : (rank + 1) * size]
        piece[: len(mine)] = mine
        out.append(piece)
    return np.concatenate(out)


def _rebuild(family, old, new, old_world, world, rank, saved, mutate=None):
    got = np.zeros(zp.partition_numel(family, new, world))
    read = 0
    for i, c in enumerate(zp.transfers(family, old, new, old_world, world, rank)):
        if mutate is not None and i == 0:
            c = mutate(c)
        got[c.dst : c.dst + c.numel] = saved[c.rank][c.src : c.src + c.numel]
        read += c.numel
    return got, read


@pytest.mark.parametrize("family", ["zero12", "zero3"])
@pytest.mark.parametrize(("old_world", "world"), [(2, 3), (3, 2), (1, 4), (4, 1), (3, 5), (8, 7)])
def test_transfers_rebuild_every_new_partition_reading_only_its_share(family, old_world, world):
    rng = random.Random(f"{family}{old_world}{world}")
    for trial in range(20):
        old = _group(rng, rng.randint(1, 9))
        values = {p.name: np.arange(p.numel) + 1000.0 * i for i, p in enumerate(old)}
        new = old if trial % 2 else rng.sample(old, len(old))  # ZeRO-3 sub-groups may reorder
        saved = [_partition(family, old, old_world, r, values) for r in range(old_world)]
        for rank in range(world):
            got, read = _rebuild(family, old, new, old_world, world, rank, saved)
            want = _partition(family, new, world, rank, values, pad=0.0)
            assert np.array_equal(got, want), (trial, rank)
            # Nothing but this rank's own elements is read (no padding, no neighbour's data).
            mine = _partition(family, new, world, rank, values)  # NaN where DeepSpeed pads
            assert read == np.count_nonzero(~np.isnan(mine)) and not np.isnan(got).any()


@pytest.mark.parametrize("family", ["zero12", "zero3"])
def test_a_mutated_transfer_is_caught(family):
    """The control: one copy read one element off, or from the wrong source rank, and the
    rebuilt partition no longer equals DeepSpeed's layout."""
    rng = random.Random(family)
    old = _group(rng, 6)
    values = {p.name: np.arange(p.numel) + 1000.0 * i for i, p in enumerate(old)}
    saved = [_partition(family, old, 3, r, values, pad=-1.0) for r in range(3)]
    want = _partition(family, old, 2, 1, values, pad=0.0)
    got, _ = _rebuild(family, old, old, 3, 2, 1, saved)
    assert np.array_equal(got, want)
    for mutate in (
        lambda c: zp.Copy(c.rank, c.src + 1, c.dst, c.numel),
        lambda c: zp.Copy((c.rank + 1) % 3, c.src, c.dst, c.numel),
    ):
        bad, _ = _rebuild(family, old, old, 3, 2, 1, saved, mutate)
        assert not np.array_equal(bad, want)


def test_partition_sizes_follow_deepspeeds_alignment():
    group = [zp.ParamSpan(name="a", numel=10), zp.ParamSpan(name="b", numel=7)]
    # ZeRO-1/2: 17 elements padded to a multiple of 2 x world, split evenly.
    assert zp.partition_numel("zero12", group, 3) == 6  # 18 / 3
    assert zp.partition_numel("zero12", group, 4) == 6  # 24 / 4
    # ZeRO-3: each parameter split on its own, ceil(numel / world).
    assert zp.partition_numel("zero3", group, 3) == 4 + 3
    assert [(p.name, p.param_start, p.numel) for p in zp.pieces("zero3", group, 3, 2)] == [
        ("a", 8, 2),
        ("b", 6, 1),
    ]


@pytest.fixture(scope="module")
def source(stage15_fp32) -> Path:
    root = stage15_fp32 / "stage15" / "checkpoints"
    return root / (root / "latest").read_text().strip()


@pytest.mark.slow
def test_read_source_matches_deepspeeds_consolidated_weights(source):
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    layout = zl.read_source(source)
    assert (layout.zero_stage, layout.world_size, layout.prefix) == (2, 2, "")
    assert layout.state_keys == ["exp_avg", "exp_avg_sq"]
    full = get_fp32_state_dict_from_zero_checkpoint(str(source.parent), tag=source.name)
    trained = {n for g in layout.groups for n in (p.name for p in g)}
    assert trained == set(layout.norms) and trained < set(full)  # frozen ones are not trained
    for name in trained:
        want = float(full[name].double().pow(2).sum())
        assert layout.norms[name][zl.FP32] == pytest.approx(want, rel=1e-12), name
        # The moments: every element of the saved flat vectors lands in exactly one parameter.
    for key in layout.state_keys:
        total = 0.0
        for r in range(layout.world_size):
            sd = torch.load(source / layout.optim_file(r), weights_only=False)
            total += float(
                sd["optimizer_state_dict"]["base_optimizer_state"]["state"][0][key]
                .double()
                .pow(2)
                .sum()
            )
        got = sum(layout.norms[n][key] for n in trained)
        assert got == pytest.approx(total, rel=1e-12), key
    # The plan carries the layout to the ranks as JSON.
    assert zl.SourceLayout.model_validate_json(layout.model_dump_json()) == layout


@pytest.mark.slow
def test_layouts_the_reader_does_not_know_are_refused(source, tmp_path):
    broken = tmp_path / source.name
    shutil.copytree(source, broken)
    (broken / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(zl.UnknownLayout, match="dp_world_size 2 but 1 optimizer files"):
        zl.read_source(broken)
    # A damaged optimizer file is not guessed at either.
    damaged = tmp_path / "damaged" / source.name
    shutil.copytree(source, damaged)
    (damaged / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"not a zip")
    with pytest.raises(zl.UnknownLayout, match="zero_pp_rank_1"):
        zl.read_source(damaged)


def _plan(stage15_fp32, tmp_path, **kw) -> preflight.Plan:
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    meta = ck.read_meta(run / "stage15" / "checkpoints" / "global_step40")
    args = dict(
        min_warmup=20,
        seed=7,
        fingerprint=meta.data.fingerprint,
        world_size=3,
        zero_stage=2,
        precision="fp32",
    )
    return preflight.check(16, "auto", run, **(args | kw))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kw", "how", "why"),
    [
        ({}, "reshard", "resharding at load time"),
        ({"zero_stage": 1}, "reshard", "resharding at load time"),
        ({"precision": "bf16"}, "universal", "precision changed"),
        ({"reshard_blocker": "offload to nvme"}, "universal", "offload to nvme"),
    ],
)
def test_the_plan_reshards_what_it_can_and_says_why_not(stage15_fp32, tmp_path, kw, how, why):
    plan = _plan(stage15_fp32, tmp_path, **kw)
    topo = [f for f in plan.findings if f.rule == "topology"]
    assert len(topo) == 1 and why in topo[0].message, [f.message for f in plan.findings]
    assert (plan.reshard, plan.universal) == (how == "reshard", how == "universal")
    # Either way the source's norms come along for the check after the load.
    assert plan.layout is not None and len(plan.layout.norms) == 4
    assert plan.to_dict()["source_layout"]["world_size"] == 2


@pytest.mark.slow
def test_a_zero3_change_is_refused_before_anything_starts(stage15_fp32, tmp_path):
    """DeepSpeed's ZeRO-3 engine cannot load a ZeRO-2 checkpoint, universal or not."""
    plan = _plan(stage15_fp32, tmp_path, world_size=2, zero_stage=3)
    (err,) = [f for f in plan.findings if f.severity == "error"]
    assert err.rule == "topology" and "zero_stage 2 -> 3" in err.message
    assert "resume with zero_optimization.stage 2" in err.fix
    assert not plan.reshard and not plan.universal


def test_an_engine_the_reshard_cannot_fill_is_named_for_the_universal_path():
    from types import SimpleNamespace

    from wonderland_ds.checkpoint import reshard

    layout = zl.SourceLayout(
        zero_stage=2, world_size=2, ds_version="0.19.8", groups=[], state_keys=["exp_avg"]
    )
    ready = dict(
        round_robin_bit16_groups=[],
        single_partition_of_fp32_groups=[],
        groups_padding=[],
        round_robin_bit16_padding=[[0]],
        partition_count=[2],
        load_state_dict=None,
    )

    def engine(stage=2, mp=1, **opt):
        return SimpleNamespace(
            optimizer=SimpleNamespace(**opt),
            zero_optimization_stage=lambda: stage,
            has_moe_layers=False,
            mp_world_size=mp,
        )

    assert reshard.unsupported(engine(**ready), layout) is None
    assert reshard.unsupported(engine(stage=1, **ready), layout) is None  # 1 and 2 interchange
    assert reshard.unsupported(engine(stage=3, **ready), layout) == "ZeRO stage 2 -> 3"
    assert (
        reshard.unsupported(engine(mp=2, **ready), layout) == "expert, tensor or pipeline parallel"
    )
    aligned = ready | {"round_robin_bit16_padding": [[0, 3]]}
    assert reshard.unsupported(engine(**aligned), layout) == "parameter_alignment is on"
    lacking = {k: v for k, v in ready.items() if k != "groups_padding"}
    assert "lacks ['groups_padding']" in reshard.unsupported(engine(**lacking), layout)
