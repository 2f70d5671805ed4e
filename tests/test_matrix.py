"""The architecture matrix: tiny configs of every supported ``transformers`` family, built
offline, each through stage 15 (1 rank) -> 16 (resumed on 2 ranks) -> 17 -> 18 under ZeRO-3,
and the families whose ZeRO-2 path differs under ZeRO-2 as well. The export reloads with
``from_pretrained``, scores stage 17's held-out loss and keeps tied weights tied; a MoE model
logs its router loss. Run with ``pytest -m matrix`` (``.ci/run`` runs it on two workers,
``-n 2``); the default suite's fast subset is ``tests/test_model_room.py`` (partitioned
construction, levers, MoE routing, the export) and the causal-LM example."""

from __future__ import annotations

import csv
import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.archs import MOE, VOCAB, configs
from tests.helpers.util import REPO, wonderland

transformers = pytest.importorskip("transformers")

SEQ, STEPS = 16, 4
#: Under ZeRO-2 every rank builds the whole model and DeepSpeed partitions flat optimizer
#: groups, whatever the architecture; what differs by family is a weight stored once for two
#: names (tied embeddings), GPT-2's Conv1D layout and a MoE's experts and router loss. ZeRO-3's
#: partitioned construction differs by family, so every family runs under ZeRO-3.
ZERO2 = ("llama", "qwen2", "gpt2", "mixtral")


def cases() -> list:
    names = list(configs())
    assert set(ZERO2) <= set(names), ZERO2
    return [
        pytest.param(a, z, id=f"{a}-zero{z}", marks=pytest.mark.matrix)
        for a in names
        for z in (2, 3)
        if z == 3 or a in ZERO2
    ]


def setup(tmp: Path, arch: str, zero: int) -> Path:
    folder = tmp / "model"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(configs()[arch]).save_pretrained(folder)
    rng = np.random.default_rng(1)
    # A learnable stream (a repeated random phrase) so that training lowers the loss.
    phrase = rng.integers(0, VOCAB, 40)
    np.tile(phrase, 200).astype(np.uint16).tofile(tmp / "train.bin")
    np.tile(phrase, 5)[3:].astype(np.uint16).tofile(tmp / "held.bin")
    raw = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    raw["zero_optimization"] = {"stage": zero}
    raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"] = 2, 1
    raw["scheduler"]["params"] |= {"warmup_num_steps": STEPS, "total_num_steps": 4 * STEPS}
    raw["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(folder), "init": "weights"},
        "data": {"train": [str(tmp / "train.bin")], "heldout": {"held": [str(tmp / "held.bin")]},
                 "dtype": "uint16", "seq_len": SEQ},
        "train_steps": STEPS, "save_interval": STEPS, "min_warmup_steps": STEPS,
        "log_interval": STEPS, "eval": {"lm_loss_rise": 10.0},
        "export": {"max_shard_size": "40KB"},  # several shards even for a tiny model
    }  # fmt: skip
    path = tmp / "config.json"
    path.write_text(json.dumps(raw))
    return path


def run(stage: int, cfg: Path, run_dir: Path, nproc: int) -> None:
    args = ["train", "--stage", str(stage), "--config", str(cfg), "--run-dir", str(run_dir)]
    args += ["--nproc", str(nproc)]
    if stage > 15:
        args += ["--resume", "auto"]
    if stage == 16:
        args += ["--optimizer-state", "--scheduler-state"]
    t0 = time.perf_counter()
    result = wonderland(*args, timeout=400)
    print(f"stage {stage} on {nproc}: {time.perf_counter() - t0:.1f} s")
    out = result.stdout + result.stderr
    assert result.returncode == 0, f"stage {stage}:\n{out[-4000:]}"


def heldout_loss(model: torch.nn.Module, path: Path) -> tuple[float, int]:
    """Stage 17's held-out loss, recomputed: seq_len windows, each predicting its next tokens."""
    ids = torch.from_numpy(np.fromfile(path, dtype=np.uint16).astype(np.int64))
    total, count = 0.0, 0
    for s in range(0, len(ids), SEQ):
        window = ids[s : s + SEQ][None]
        if window.shape[1] < 2:
            continue
        with torch.no_grad():
            total += float(model(input_ids=window, labels=window).loss) * (window.shape[1] - 1)
        count += window.shape[1] - 1
    return total / count, count


@pytest.mark.parametrize(("arch", "zero"), cases())
def test_architecture_runs_stages_15_to_18(tmp_path, arch, zero):
    cfg, run_dir = setup(tmp_path, arch, zero), tmp_path / "run"
    run(15, cfg, run_dir, 1)
    run(16, cfg, run_dir, 2)  # resharded from 1 rank to 2
    entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
    resume = entry["resume"]
    assert entry["world_size"] == 2 and resume["load"] == "resharded", entry
    assert resume["from_world_size"] == 1 and len(resume["bytes_read"]) == 2, resume
    run(17, cfg, run_dir, 2)
    run(18, cfg, run_dir, 1)
    rows = list(csv.DictReader((run_dir / "stage16" / "metrics.csv").open()))
    assert len(rows) == STEPS and all(np.isfinite(float(r["loss"])) for r in rows)
    if arch in MOE:  # the router's load-balancing loss, logged on its own
        assert all(float(r["aux_loss"]) > 0 for r in rows), rows
    else:
        assert all(r["aux_loss"] == "" for r in rows)
    report = json.loads((run_dir / "stage17" / "report.json").read_text())
    assert report["stage16"]["loss"] < report["stage15"]["loss"], report  # stage 16 trained
    export = run_dir / "stage18"
    meta = json.loads((export / "export.json").read_text())
    shards = [f for f in meta["files"] if f.endswith(".safetensors")]
    assert len(shards) > 1 and "model.safetensors.index.json" in meta["files"], meta
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval()
    loss, count = heldout_loss(model, tmp_path / "held.bin")
    (row,) = report["stage16"]["per_source"]
    assert count == row["tokens"]
    assert loss == pytest.approx(row["loss"], rel=1e-4), (loss, row)
    if configs()[arch].tie_word_embeddings:
        assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
        index = json.loads((export / "model.safetensors.index.json").read_text())
        assert not any(k.endswith("lm_head.weight") for k in index["weight_map"])  # stored once
    shutil.rmtree(run_dir / "stage15", ignore_errors=True)  # keep tmp small
