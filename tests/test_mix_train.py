"""Weighted sources on real DeepSpeed (2 gloo ranks): the proportions asked, read off the loss
when one source is learnable and the other is noise; stage 16 on its own mix from the config
(no flag), recorded in the preflight report, run.json and ``status``; a kill and a resume
inside that mix read the very same samples; a silent change of the mix is still refused."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.util import REPO, digests, wonderland

transformers = pytest.importorskip("transformers")

SEQ, BATCH = 16, 32  # 16 samples a micro-batch x 2 ranks
NOISE_LOSS = math.log(32)  # noise: uniform over tokens 32..63, nothing to learn


def _mix(root: Path, learn: float, noise: float) -> dict:
    return {
        "learn": {"files": [str(root / "learn.bin")], "weight": learn},
        "noise": {"files": [str(root / "noise.bin")], "weight": noise},
    }


def _setup(root: Path, train: dict, stage16: dict | None) -> Path:
    """A tiny GPT-2, a learnable source (token t is followed by t + 7 mod 32: a bigram the
    model learns to a loss near 0) and a noise source (tokens 32..63 drawn uniformly: its loss
    stays at ln 32); a config on ``train`` with stage 16 on ``stage16``."""
    model = root / "model"
    if not model.exists():
        transformers.GPT2Config(
            vocab_size=64, n_positions=32, n_embd=32, n_layer=1, n_head=2
        ).save_pretrained(model)
        (np.arange(3000 * SEQ) * 7 % 32).astype(np.uint16).tofile(root / "learn.bin")
        rng = np.random.default_rng(0)
        rng.integers(32, 64, 3000 * SEQ).astype(np.uint16).tofile(root / "noise.bin")
        (np.arange(100 * SEQ) * 7 % 32).astype(np.uint16).tofile(root / "held_learn.bin")
        rng.integers(32, 64, 100 * SEQ).astype(np.uint16).tofile(root / "held_noise.bin")
    cfg = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    cfg["gradient_accumulation_steps"] = 1
    cfg["optimizer"]["params"]["lr"] = 0.01
    cfg["scheduler"]["params"].update(
        warmup_max_lr=0.01, warmup_num_steps=20, total_num_steps=10_000
    )
    data = {
        "train": train,
        "heldout": {s: [str(root / f"held_{s}.bin")] for s in ("learn", "noise")},
        "dtype": "uint16",
        "seq_len": SEQ,
    }
    if stage16 is not None:
        data["stage_train"] = {"16": stage16}
    cfg["wonderland"] = {
        "task": "causal-lm",
        "seed": 7,
        "train_steps": 150,
        "stage_train_steps": {"16": 100},
        "save_interval": 50,
        "min_warmup_steps": 0,
        "log_interval": 50,
        "model": {"hf": str(root / "model")},
        "data": data,
    }
    path = root / f"config_{len(list(root.glob('config_*')))}.json"
    path.write_text(json.dumps(cfg))
    return path


def _rows(stage_dir: Path) -> list[dict[str, str]]:
    with open(stage_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


def _noise_share_read_off_the_loss(rows: list[dict[str, str]]) -> float:
    """The learnable source's loss is near 0 once learned, the noise's ln 32: the mean loss of
    the last 40 steps over ln 32 is the noise's share of the batches."""
    return float(np.mean([float(r["loss"]) for r in rows[-40:]])) / NOISE_LOSS


@pytest.mark.slow
def test_two_sources_train_in_the_proportions_asked_and_stage_16_on_its_own_mix(tmp_path):
    cfg = _setup(tmp_path, _mix(tmp_path, 0.75, 0.25), _mix(tmp_path, 0.4, 0.6))
    run = tmp_path / "run"
    done = wonderland(
        "pipeline", "--from", "15", "--to", "16", "--config", str(cfg), "--run-dir", str(run),
        timeout=400,
    )  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-4000:]

    # The proportions, read off the loss: a quarter noise in stage 15, 60% in stage 16.
    r15, r16 = _rows(run / "stage15"), _rows(run / "stage16")
    assert len(r15) == 150 and len(r16) == 100
    share15, share16 = _noise_share_read_off_the_loss(r15), _noise_share_read_off_the_loss(r16)
    assert abs(share15 - 0.25) < 0.04 and abs(share16 - 0.6) < 0.04, (share15, share16)

    # metrics.csv: each step's tokens per source, the batch's tokens in the weights' shares
    # (two sources: one Bresenham line, within a sample of the exact share in every batch).
    for rows, noise in ((r15, 0.25), (r16, 0.6)):
        for r in rows:
            learn_t, noise_t = int(r["tokens_learn"]), int(r["tokens_noise"])
            assert learn_t + noise_t == BATCH * SEQ
            assert abs(noise_t / SEQ - noise * BATCH) <= 1, r
        total = sum(int(r["tokens_noise"]) for r in rows)
        assert abs(total / (len(rows) * BATCH * SEQ) - noise) < 1e-3

    # The learnable source (3000 samples, 75% of 4800) ran out in stage 15: a new epoch.
    assert "stage 15 step 126: source 'learn' ran out and starts epoch 2 (a new order)" in out

    # Stage 16's mix came from the config, without a flag: in the preflight report (its
    # stream from its first sample), in run.json with each source's epochs, and in status.
    pre = json.loads((run / "stage16" / "preflight.json").read_text())
    assert pre["data_mix"] == {
        "mix": "stage_train.16",
        "from": "train",
        "sources": "learn 0.4, noise 0.6",
    }
    assert "data-mix" in {f["rule"] for f in pre["findings"]}
    assert "data-fingerprint" not in {f["rule"] for f in pre["findings"]}
    stages = json.loads((run / "run.json").read_text())["stages"]
    assert stages["15"]["data_mix"] == "train" and stages["15"]["data_mix_change"] is None
    assert stages["15"]["sources"]["learn"] == {
        "weight": 0.75, "samples": 3600, "epoch": 1, "epochs": 1.2,
    }  # fmt: skip
    assert stages["16"]["data_mix"] == "stage_train.16"
    assert stages["16"]["sources"]["noise"]["samples"] == 1920  # 60% of 100 x 32, from 0
    status = wonderland("status", str(run))
    assert status.returncode == 0
    assert (
        "data: data.stage_train.16 (learn 0.4: 0.43 epochs, noise 0.6: 0.64 epochs), declared"
        " for this stage (the checkpoint's: data.train)"
    ) in status.stdout, status.stdout

    # A kill inside stage 16 and a resume: the very same samples, step for step.
    again = tmp_path / "again"
    start = str(run / "stage15" / "checkpoints" / "global_step150")
    args = ["--config", str(cfg), "--run-dir", str(again)]
    killed = wonderland(
        "train", "--stage", "16", *args, "--resume", start, "--fault", "kill@step:step=215:rank=1"
    )
    assert killed.returncode not in (0, 2, 3), (killed.stdout + killed.stderr)[-3000:]
    assert "FAULT INJECTED: kill at step step 215 rank 1" in killed.stdout + killed.stderr
    resumed = wonderland("train", "--stage", "16", *args, "--resume", "auto")
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert "global_step200 at step 200" in resumed.stdout + resumed.stderr
    assert digests(again / "stage16") == digests(run / "stage16")

    # A silent change is refused: other weights for train, and no stage_train declaring them.
    changed = _setup(tmp_path, _mix(tmp_path, 0.5, 0.5), None)
    refused = wonderland(
        "train", "--stage", "16", "--config", str(changed), "--run-dir", str(tmp_path / "other"),
        "--resume", start, "--dry-run",
    )  # fmt: skip
    assert refused.returncode == 2, refused.stdout + refused.stderr
    assert "[data-fingerprint]" in refused.stdout + refused.stderr
