"""The device path, on a CUDA GPU: fp16 loss scaling through a real stage, NCCL all-reduces
of the guards' check, and an async save that takes no device memory.

Marked ``gpu``: conftest.py skips them, naming why, where torch sees no CUDA device. They use
as many ranks as there are GPUs, up to 2 (NCCL refuses two ranks on one device).
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


# ------------------------------------------------------------ on a GPU


@pytest.mark.gpu
@pytest.mark.slow
def test_fp16_loss_scaling_in_a_short_stage_on_cuda(tmp_path):
    """Stage 15 in fp16 with DeepSpeed's dynamic loss scale (2^16 to start): the scale comes
    down to one the digits model does not overflow at, overflowed steps are skipped and
    counted, and the loss still falls."""
    cfg = json.loads(Path(TINY32).read_text())
    cfg["fp16"] = {
        "enabled": True,
        "loss_scale": 0,
        "initial_scale_power": 16,
        "loss_scale_window": 100,
        "hysteresis": 2,
        "min_loss_scale": 1,
    }
    config = tmp_path / "fp16.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
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
        "30",
        timeout=600,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    assert "Setting accelerator to CPU" not in out  # DeepSpeed really took the GPU
    root = run / "stage15" / "checkpoints"
    meta = json.loads((root / "global_step30" / "wonderland_meta.json").read_text())
    assert meta["precision"] == "fp16"
    scale = meta["loss_scale"]
    assert scale is not None and 1 <= scale <= 2**16, scale
    assert math.log2(scale).is_integer(), scale  # dynamic scaling halves and doubles
    assert isinstance(meta["skipped_steps"], int) and 0 <= meta["skipped_steps"] < 30
    with open(run / "stage15" / "metrics.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [int(row["step"]) for row in rows] == list(range(1, 31))
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
def test_guard_check_matrix_all_reduces_over_nccl(tmp_path):
    """The process group on CUDA carries NCCL for device tensors and gloo for the CPU matrix
    of the guards' check: both sum the matrix exactly, and the start check passes on NCCL."""
    world = gpus()
    results = run_ranks("collectives", tmp_path, world)
    for r, got in enumerate(results):
        assert "nccl" in got["backend"] and "gloo" in got["backend"], got
        assert got["device"].startswith("cuda"), got
        assert got["cpu_sum_exact"] and got["device_sum_exact"], (r, got)
        assert got["allreduce_ok"] == [True] * world and got["events"] == [], got


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
