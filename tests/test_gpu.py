"""The device path, on a CUDA GPU: fp16 loss scaling through a real stage, NCCL all-reduces
of the guards' check, and an async save that takes no device memory.

Marked ``gpu``: conftest.py skips them, naming why, where torch sees no CUDA device. A check
across ranks needs two GPUs (NCCL refuses two ranks on one device) and says so on one; the
one-device tests prove what one device can. Each check's negative control runs anywhere.
"""

from __future__ import annotations

import csv
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY32, gpu_skip_reason
from tests.helpers.util import REPO, wonderland

HELPER = str(REPO / "tests" / "helpers" / "device_checks.py")


def gpus() -> int:
    import torch

    return min(2, torch.cuda.device_count())


def run_ranks(check: str, out: Path, world: int) -> list[dict]:
    """``world`` ranks of tests/helpers/device_checks.py, one process each."""
    from wonderland_ds.launch.command import extensions_dir, free_port

    port = str(free_port())
    # DeepSpeed's JIT ops where `wonderland train` builds them: never a second build.
    ops = str(extensions_dir(os.environ))
    procs = [
        subprocess.Popen(
            [sys.executable, HELPER, check, str(out)],
            env=dict(
                os.environ,
                RANK=str(r),
                LOCAL_RANK=str(r),
                WORLD_SIZE=str(world),
                LOCAL_SIZE=str(world),
                MASTER_ADDR="127.0.0.1",
                MASTER_PORT=port,
                TORCH_EXTENSIONS_DIR=ops,
            ),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:  # a rank stuck in a collective must not outlive the test
            if p.poll() is None:
                p.kill()
    for p, log in zip(procs, logs):
        assert p.returncode == 0, log[-4000:]
    return [json.loads((out / f"{check}-rank{r}.json").read_text()) for r in range(world)]


def not_on_cuda(table: list[dict]) -> list[dict]:
    """The ranks of a ``ranks.json`` whose accelerator is not CUDA (a fallback to the CPU)."""
    return [x for x in table if x.get("accelerator") != "cuda"]


INITIAL_SCALE_POWER = 32  # 2^32: the first steps' fp16 gradients overflow for certain


def scale_problems(meta: dict, steps: int) -> list[str]:
    """What says the dynamic loss scale did not work: it must have come down from 2^32 by
    halvings, over skipped (overflowed) steps, fewer than all of them."""
    scale, skipped = meta.get("loss_scale"), meta.get("skipped_steps")
    problems = []
    if meta.get("precision") != "fp16":
        problems.append(f"precision {meta.get('precision')}, not fp16")
    if scale is None or not 1 <= scale < 2**INITIAL_SCALE_POWER:
        problems.append(f"loss scale {scale} did not come down from 2^{INITIAL_SCALE_POWER}")
    elif not math.log2(scale).is_integer():
        problems.append(f"loss scale {scale} is not a power of two")
    if not isinstance(skipped, int) or not 1 <= skipped < steps:
        problems.append(f"{skipped} skipped steps (an overflow skips; not every step may)")
    return problems


# ------------------------------------------------------------ the skip itself (runs anywhere)


def test_gpu_marker_is_skipped_without_cuda_and_says_why(monkeypatch):
    """The conftest hook gives every gpu-marked test a skip with the reason, and no other."""
    import torch

    import tests.conftest as conftest

    class Item:
        def __init__(self, gpu: bool) -> None:
            self.keywords = {"gpu": True} if gpu else {}
            self.added: list = []

        def get_closest_marker(self, name: str):
            return object() if name in self.keywords else None

        def add_marker(self, marker) -> None:
            self.added.append(marker)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reason = gpu_skip_reason()
    assert reason and "CUDA" in reason
    gpu, cpu = Item(True), Item(False)
    conftest.pytest_collection_modifyitems(None, [gpu, cpu])
    assert [m.mark.name for m in gpu.added] == ["skip"]
    assert gpu.added[0].mark.kwargs["reason"] == reason
    assert cpu.added == []

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert gpu_skip_reason() is None
    again = Item(True)
    conftest.pytest_collection_modifyitems(None, [again])
    assert again.added == []


def test_the_cuda_check_fails_on_this_machines_own_rank_record():
    """The fallback's control: the rank record a stage writes, made here. On a CPU it names
    the CPU, and the check the fp16 test applies fails on it."""
    from wonderland_ds.core import distributed as dist

    mine = dist.rank_info()
    assert mine["accelerator"] in ("cpu", "cuda")
    assert not_on_cuda([mine]) == ([] if mine["accelerator"] == "cuda" else [mine])
    assert not_on_cuda([{**mine, "accelerator": "cpu"}]) and not not_on_cuda(
        [{**mine, "accelerator": "cuda"}]
    )


def test_the_loss_scale_check_fails_on_a_scale_that_never_moved():
    """The loss-scale check's controls: the initial scale unchanged with no skipped step, a
    skip on every step, a scale not a power of two, a bf16 run: each fails; a scale that came
    down over some skipped steps passes."""
    good = {"precision": "fp16", "loss_scale": 2.0**15, "skipped_steps": 17}
    assert scale_problems(good, 40) == []
    assert scale_problems({**good, "loss_scale": 2.0**32, "skipped_steps": 0}, 40)
    assert scale_problems({**good, "skipped_steps": 40}, 40)
    assert scale_problems({**good, "loss_scale": 3000.0}, 40)
    assert scale_problems({**good, "precision": "bf16", "loss_scale": None}, 40)


# ------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_loss_scaling_in_a_short_stage_on_cuda(tmp_path):
    """Stage 15 in fp16 with DeepSpeed's dynamic loss scale from 2^32: the first steps
    overflow, are skipped and counted, the scale halves down to one the digits model does not
    overflow at, and the loss still falls. Every rank ran on CUDA, as its record says."""
    cfg = json.loads(Path(TINY32).read_text())
    cfg["fp16"] = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": INITIAL_SCALE_POWER,
        "loss_scale_window": 100,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    steps = 40
    r = wonderland(
        "train",
        "--stage",
        "15",
        "--config",
        str(config),
        "--run-dir",
        str(run),
        "--nproc",
        str(gpus()),
        "--steps",
        str(steps),
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    table = json.loads((run / "stage15" / "ranks.json").read_text())
    assert table and not_on_cuda(table) == [], table  # DeepSpeed really took the GPU
    root = run / "stage15" / "checkpoints"
    meta = json.loads((root / f"global_step{steps}" / "wonderland_meta.json").read_text())
    assert scale_problems(meta, steps) == [], meta
    with open(run / "stage15" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(row["step"]) for row in rows] == list(range(1, steps + 1))
    loss = [float(row["loss"]) for row in rows]
    assert all(math.isfinite(x) for x in loss), loss
    assert sum(loss[-5:]) < sum(loss[:5]), loss
    events = (
        (run / "stage15" / "guards.jsonl").read_text().splitlines()
        if (run / "stage15" / "guards.jsonl").exists()
        else []
    )
    assert not [e for e in events if "loss-scale-stuck" in e or "loss-nan" in e], events


@pytest.mark.gpu
@pytest.mark.slow
def test_guard_check_matrix_all_reduces_across_two_gpus_over_nccl(tmp_path):
    """Two ranks, one GPU each: the process group carries NCCL for device tensors and gloo for
    the CPU matrix of the guards' check; both sum the matrix exactly across the ranks, and the
    start check passes on NCCL. NCCL refuses two ranks on one device, so one GPU cannot prove
    this: the test below proves what one device can."""
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip(f"needs 2 GPUs for a cross-rank all-reduce; {torch.cuda.device_count()} here")
    results = run_ranks("collectives", tmp_path, 2)
    for r, got in enumerate(results):
        assert "nccl" in got["backend"] and "gloo" in got["backend"], got
        assert got["device"].startswith("cuda"), got
        assert got["cpu_sum_exact"] and got["device_sum_exact"], (r, got)
        assert got["allreduce_ok"] == [True, True] and got["events"] == [], got


@pytest.mark.gpu
@pytest.mark.slow
def test_guard_check_groups_come_up_on_one_gpu(tmp_path):
    """What one device proves (no cross-rank claim: world 1): the NCCL and gloo groups come up
    on CUDA, the matrix goes through both, and the start check passes."""
    (got,) = run_ranks("collectives", tmp_path, 1)
    assert "nccl" in got["backend"] and "gloo" in got["backend"], got
    assert got["device"].startswith("cuda"), got
    assert got["cpu_sum_exact"] and got["device_sum_exact"] and got["allreduce_ok"] == [True]
    assert got["events"] == [], got


@pytest.mark.gpu
@pytest.mark.slow
def test_async_save_adds_no_device_memory(tmp_path):
    """Two saves through the snapshot engine of a ZeRO-2 bf16 engine with its optimizer on the
    GPU, each beside DeepSpeed's own synchronous save of the same step. A save adds no device
    memory: none stays allocated when it returns, and its peak is no higher than DeepSpeed's
    own save's (whose collectives allocate a few bytes). The device state goes into one
    page-locked host copy, the same buffers from save to save, and the files load back equal
    to DeepSpeed's."""
    (got,) = run_ranks("async-save", tmp_path, 1)
    assert got["device"].startswith("cuda") and got["state_device"].startswith("cuda"), got
    for save in got["saves"]:
        assert save["saved"] == save["before"], got
        assert save["peak"] - save["before"] <= save["ds_peak"] - save["ds_before"], got
        # After the next step, the steady state again: no device copy kept by the writer.
        assert abs(save["after"] - save["before"]) < got["param_bytes"] // 8, got
    first, second = got["saves"]
    assert got["device_state_bytes"] >= got["param_bytes"], got  # params, fp32 and moments
    assert sum(first["pinned"].values()) == got["device_state_bytes"], got
    assert second["pinned"] == first["pinned"], got  # the same page-locked buffers
    assert second["reused"] - first["reused"] >= len(first["pinned"]), got
    assert second["host_allocs"] == 0 and got["all_pinned"], got
    assert "mp_rank_00_model_states.pt" in got["files"], got
    assert len(got["equal"]) == 2 * len(got["files"]) and all(got["equal"].values()), got


@pytest.mark.nightly
@pytest.mark.slow
def test_device_checks_script_runs_on_this_machine(tmp_path):
    """The scripts the gpu tests run, on whatever this machine has (gloo on a CPU): a broken
    script shows here, not only on a GPU host."""
    if gpu_skip_reason() is None:
        pytest.skip("CUDA present: the gpu tests above run the scripts on it")
    (coll,) = run_ranks("collectives", tmp_path, 1)
    assert coll["cpu_sum_exact"] and coll["device_sum_exact"] and coll["events"] == [], coll
    (save,) = run_ranks("async-save", tmp_path, 1)
    assert save["device"] == "cpu" and "mp_rank_00_model_states.pt" in save["files"], save
    assert save["equal"] and all(save["equal"].values()), save


@pytest.mark.gpu
@pytest.mark.slow
def test_stage17_evaluates_on_the_gpu_in_the_training_dtype(tmp_path):
    """A ZeRO-2 checkpoint's module on the accelerator in bf16: the predictions of the CPU's
    fp32 reference, up to bf16 rounding (a sample or two of the 367)."""
    import numpy as np
    import torch

    from wonderland_ds.data import builtin
    from wonderland_ds.eval import evaluate, weights

    run = tmp_path / "run"  # one rank per GPU: the shared 2-rank fixture needs 2 GPUs here
    args = ["train", "--stage", "15", "--config", TINY32, "--run-dir", str(run)]
    r = wonderland(*args, "--nproc", str(gpus()), timeout=600)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]
    tag = run / "stage15" / "checkpoints" / "global_step40"
    task = builtin.load("digits").materialize()
    with weights.eval_model(task, tag, {"bf16": {"enabled": True}}) as model:
        p = next(model.parameters())
        assert p.device.type == "cuda" and p.dtype == torch.bfloat16
        _, pred = evaluate.predict(task, model)
    want = evaluate.reference_predictions(task, tag)
    assert len(pred) == len(want) and np.mean(pred != want) < 0.01
