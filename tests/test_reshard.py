"""Resuming on another world size, resharded at load time, proven by equivalence.

Stage 16 resumed from a checkpoint saved by 2 ranks on 3 (and from 3 on 2), with the same
global batch, must follow the curve of a resume on the saving world size: the first 20 losses
within 1e-5 relative, the same samples, the optimizer state's norms matching. No universal
folder is written, every element of the saved partitions is read by exactly one new rank, and
the check after the load refuses a state that does not match (a fault shifts one range).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.util import REPO, digests, losses, snapshot, wonderland
from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.checkpoint import zero_partitions as zp

pytestmark = pytest.mark.slow

TINY32 = REPO / "tests" / "configs" / "tiny_zero2_fp32.json"
STEPS = 20  # losses compared after the resume
GAS = {1: 6, 2: 3, 3: 2}  # the same global batch (8 x gas x ranks = 48) on 1, 2 and 3 ranks


def ok(result) -> str:
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    return out


def config(tmp: Path, zero: int) -> str:
    raw = json.loads(TINY32.read_text())
    raw["zero_optimization"]["stage"] = zero
    path = tmp / f"tiny_zero{zero}_fp32.json"
    path.write_text(json.dumps(raw))
    return str(path)


def stage(num: int, cfg: str, run: Path, nproc: int, steps: int, *extra: str):
    args = ["train", "--stage", str(num), "--config", cfg, "--run-dir", str(run)]
    args += ["--nproc", str(nproc), "--grad-acc-steps", str(GAS[nproc]), "--steps", str(steps)]
    if num == 16:
        args += ["--resume", "auto", "--optimizer-state", "--scheduler-state"]
    return wonderland(*args, *extra)


def latest(stage_dir: Path) -> Path:
    root = stage_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def resume_record(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["stages"]["16"]["resume"]


def trained_numel(layout: zl.SourceLayout) -> int:
    return sum(p.numel for g in layout.groups for p in g)


def assert_equivalent(source_run: Path, same: Path, resharded: Path, out: str, world: int):
    """The resharded resume against the same-topology one of the same checkpoint."""
    layout = zl.read_source(latest(source_run / "stage15"))
    assert f"world_size {layout.world_size} -> {world}: resharding at load time" in out
    assert "OK    [reshard-check]" in out and "(resharded)" in out
    assert not (resharded / "stage16" / "universal").exists()  # nothing converted or written
    how = resume_record(resharded)
    assert how["load"] == "resharded" and how["from_world_size"] == layout.world_size
    # Every saved element (fp32 weights, exp_avg, exp_avg_sq: 12 bytes) read by exactly one
    # new rank, plus ZeRO-3's frozen fragments (fp32): no rank reads another's share.
    frozen = sum(p.numel for p in layout.frozen)
    assert sum(how["bytes_read"]) == 12 * trained_numel(layout) + 4 * frozen
    share = sum(zp.partition_numel(layout.family(), g, world) for g in layout.groups)
    assert max(how["bytes_read"]) <= 12 * share + 4 * frozen
    assert len(how["bytes_read"]) == world
    # Same samples per step and the same curve, within fp32 reduction order.
    assert digests(resharded / "stage16") == digests(same / "stage16")
    want, got = losses(same / "stage16"), losses(resharded / "stage16")
    assert sorted(got) == sorted(want) and len(got) == STEPS
    rel = max(abs(want[s] - got[s]) / abs(want[s]) for s in want)
    assert rel < 1e-5, rel
    # The optimizer state after 20 more steps: per parameter, the same norms.
    a, b = zl.read_source(latest(same / "stage16")), zl.read_source(latest(resharded / "stage16"))
    assert b.world_size == world and a.norms.keys() == b.norms.keys()
    for name, sums in a.norms.items():
        for key, value in sums.items():
            assert b.norms[name][key] == pytest.approx(value, rel=1e-4), (name, key)
    # Frozen parameters and buffers came through unchanged.
    assert frozen_state(latest(resharded / "stage16")) == frozen_state(
        latest(source_run / "stage15")
    )


def frozen_state(tag_dir: Path) -> dict[str, list[float]]:
    """The frozen parameters and buffers, consolidated by DeepSpeed's own zero_to_fp32."""
    import torch
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    full = get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)
    trained = {p.name for g in zl.read_source(tag_dir, norms=False).groups for p in g}
    model = torch.load(
        next(tag_dir.glob("*model_states.pt")), map_location="cpu", weights_only=False
    )
    buffers = {n: model["module"][n] for n in model.get("buffer_names", [])}
    kept = {n: t for n, t in full.items() if n not in trained} | buffers
    assert kept, "the tiny model has frozen parameters and buffers"
    return {n: t.float().flatten().tolist() for n, t in sorted(kept.items())}


def equivalence(tmp: Path, zero: int, old: int, new: int, source: Path | None = None) -> None:
    cfg = config(tmp, zero)
    if source is None:
        source = tmp / "source"
        ok(stage(15, cfg, source, old, 20))
    same, resharded = tmp / "same", tmp / "resharded"
    shutil.copytree(source, same)
    shutil.copytree(source, resharded)
    ok(stage(16, cfg, same, old, STEPS))
    out = ok(stage(16, cfg, resharded, new, STEPS))
    assert_equivalent(source, same, resharded, out, new)


def test_zero2_saved_by_two_ranks_resumed_on_three(stage15_fp32, tmp_path):
    equivalence(tmp_path, 2, 2, 3, source=stage15_fp32)


@pytest.mark.proofs
def test_zero3_saved_by_three_ranks_resumed_on_two(tmp_path):
    equivalence(tmp_path, 3, 3, 2)
    # Stage 17 on a third world size: each rank's partition of every layer read from the saved
    # fp32 partitions, layers gathered in the forward pass; the numbers of one CPU process on
    # DeepSpeed's consolidated fp32 weights, exactly.
    from wonderland_ds.data import builtin
    from wonderland_ds.eval import evaluate

    run = tmp_path / "resharded"
    args = ["train", "--stage", "17", "--resume", "auto", "--run-dir", str(run)]
    result = wonderland(*args, "--config", config(tmp_path, 3), "--nproc", "3")
    assert (run / "stage17" / "report.json").exists(), (result.stdout + result.stderr)[-3000:]
    report = json.loads((run / "stage17" / "report.json").read_text())
    # Exit 3 is the gate's verdict, and only when the report says it failed.
    want_rc = {"pass": 0, "fail": 3}[report["gate"]["verdict"]]
    assert result.returncode == want_rc, (result.stdout + result.stderr)[-3000:]
    task = builtin.load("digits").materialize()
    for key, ckpt in (("stage16", report["checkpoint"]), ("stage15", report["baseline"])):
        want = evaluate.metrics(task, evaluate.reference_predictions(task, Path(ckpt)))
        assert report[key] == want, key


@pytest.mark.parametrize(
    ("zero", "old", "new"),
    [
        pytest.param(1, 2, 3, marks=pytest.mark.proofs),  # ZeRO-1 growing
        pytest.param(1, 3, 2, marks=pytest.mark.nightly),
        pytest.param(2, 3, 2, marks=pytest.mark.nightly),
        pytest.param(3, 2, 3, marks=pytest.mark.proofs),  # ZeRO-3 growing (shrinking: above)
        pytest.param(2, 2, 1, marks=pytest.mark.nightly),
    ],
)
def test_equivalence_matrix(tmp_path, zero, old, new):
    equivalence(tmp_path, zero, old, new)


@pytest.mark.proofs
def test_a_misplaced_range_is_refused_naming_the_parameter(stage15_fp32, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    before = snapshot(run / "stage15")
    result = stage(16, str(TINY32), run, 3, 5, "--fault", "skew@load:rank=1")
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "FAULT INJECTED: skew at load" in out  # the fault really happened
    assert "ERROR [reshard-check]" in out and "exp_avg" in out and "body." in out
    assert not (run / "stage16" / "checkpoints").exists() or not any(
        (run / "stage16" / "checkpoints").glob("global_step*")
    )
    assert snapshot(run / "stage15") == before  # the source is untouched


@pytest.mark.nightly
def test_the_universal_fallback_is_checked_too(stage15_fp32, tmp_path):
    """fp32 -> bf16 is not resharded: DeepSpeed's universal path, then the same check."""
    raw = json.loads(TINY32.read_text())
    raw["bf16"] = {"enabled": True}
    cfg = tmp_path / "bf16.json"
    cfg.write_text(json.dumps(raw))
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    out = ok(stage(16, str(cfg), run, 2, 3))
    assert "universal checkpoint (ds_to_universal): precision changed" in out
    assert "OK    [reshard-check] 4 parameters" in out and "(universal)" in out
    assert resume_record(run)["load"] == "universal"
