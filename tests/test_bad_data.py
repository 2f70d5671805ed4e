"""Bad data deep in a token file, found before the model reads it: a real out-of-vocabulary id
the sampled checks cannot see, and a file that changes under a running stage. Every rank
stops at the same step, exit 2, naming file, offset and id; the steps before are saved; once
the file is fixed the stage continues."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.helpers.util import REPO, losses, wonderland
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.data.sampler import GlobalSampler

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, TOKENS, SEED = 1000, 32, 2_000_000, 1234
MICRO, GAS, WORLD = 4, 2, 2
BAD_STEP = 30  # the step whose data holds the bad id


def _setup(tmp: Path) -> tuple[Path, Path]:
    transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(tmp / "model")  # fmt: skip
    rng = np.random.default_rng(0)
    rng.integers(0, VOCAB, TOKENS, dtype=np.uint32).tofile(tmp / "train.bin")
    rng.integers(0, VOCAB, 2000, dtype=np.uint32).tofile(tmp / "held.bin")
    cfg = json.loads((REPO / "tests" / "configs" / "tiny_zero2_fp32.json").read_text())
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = MICRO, GAS
    cfg["wonderland"] = {
        "task": "causal-lm",
        "seed": SEED,
        "model": {"hf": str(tmp / "model")},
        "data": {
            "train": [str(tmp / "train.bin")],
            "heldout": {"held": [str(tmp / "held.bin")]},
            "dtype": "uint32",
            "seq_len": SEQ,
        },
        "train_steps": 60,
        "save_interval": 1000,
        "log_interval": 1000,
        "process_group_timeout_s": 60,
    }
    config = tmp / "config.json"
    config.write_text(json.dumps(cfg))
    return config, tmp / "train.bin"


def _offset_read_at(step: int) -> int:
    """A token offset that step ``step`` reads, outside the blocks the fingerprint samples."""
    from wonderland_ds.data.tokens import BLOCK_BYTES, FINGERPRINT_BLOCKS

    n, size, item = TOKENS // SEQ, TOKENS * 4, 4
    span = FINGERPRINT_BLOCKS - 1
    blocks = [k * (size - BLOCK_BYTES) // span // item * item for k in range(span + 1)]
    batch = MICRO * GAS * WORLD
    for slot in range(batch):
        sample = int(GlobalSampler(n, SEED).indices((step - 1) * batch + slot, 1)[0])
        offset = sample * SEQ + 5
        if not any(b <= offset * item < b + BLOCK_BYTES for b in blocks):
            return offset
    raise AssertionError("every sample of the step lies in a sampled block")


@pytest.mark.slow
def test_an_id_outside_the_vocabulary_deep_in_a_file_stops_every_rank_before_the_model(tmp_path):
    config, train = _setup(tmp_path)
    offset = _offset_read_at(BAD_STEP)
    data = np.memmap(train, dtype=np.uint32, mode="r+")
    good = int(data[offset])
    data[offset] = 70000  # a real out-of-range id, in place
    data.flush()
    del data
    check = wonderland("check", str(config))
    assert check.returncode == 0, check.stdout  # the sampled blocks do not hold it
    run = tmp_path / "run"
    result = wonderland("train", "--stage", "15", "--config", str(config), "--run-dir", str(run))
    out = result.stdout + result.stderr
    assert result.returncode == 2, out[-3000:]
    assert "[data-token-range]" in out and f"token id 70000 at token offset {offset} of" in out
    assert str(train) in out and "Traceback" not in out and "IndexError" not in out
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert entry["status"] == "failed" and entry["exit_code"] == 2
    assert f"token offset {offset}" in entry["error"]
    # Every rank stopped after the step before it, saved there; no step read the bad id.
    assert entry["stop"]["step"] == BAD_STEP - 1 and entry["stop"]["saved"]
    root = run / "stage15" / "checkpoints"
    assert ck.read_latest(root) == f"global_step{BAD_STEP - 1}"
    assert max(losses(run / "stage15")) == BAD_STEP - 1
    status = wonderland("status", str(run)).stdout
    assert f"failed at step {BAD_STEP - 1}" in status and "continue with" in status
    # Fixed, the stage continues from that checkpoint to its end.
    data = np.memmap(train, dtype=np.uint32, mode="r+")
    data[offset] = good
    data.flush()
    del data
    again = wonderland(
        "train", "--stage", "15", "--config", str(config), "--run-dir", str(run),
        "--resume", "auto", "--allow-data-change",
    )  # fmt: skip
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert max(losses(run / "stage15")) == 60


def test_the_check_finds_an_id_and_a_changed_file(tmp_path):
    from wonderland_ds.data.tokens import CHANGED, TokenData, open_files

    path = tmp_path / "t.bin"
    np.arange(1000, dtype=np.uint16).astype(np.uint16).tofile(path)
    data = TokenData(open_files([path], "uint16", "w"), 10)
    data.vocab = 1000
    assert data.check(np.arange(len(data))) is None
    data.vocab = 500  # ids 500..999 are out of range now
    finding, place = data.check(np.array([7, 60]))
    assert place == (0 << 40) | 600 and "token id 600 at token offset 600" in finding.message
    assert data.describe(place).message == finding.message  # what another rank writes
    with pytest.raises(Exception, match="token id 600"):
        data.take(np.array([60]))
    with open(path, "ab") as fh:  # the file grows under the stage
        fh.write(b"\0\0")
    finding, place = data.check(np.array([1]))
    assert place & CHANGED == CHANGED and "changed under the running stage" in finding.message


@pytest.mark.nightly
def test_a_file_that_changes_under_a_running_stage_stops_it(tmp_path):
    import subprocess
    import sys
    import time

    from wonderland_ds.run import liveness

    config, train = _setup(tmp_path)
    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "wonderland_ds.cli.main", "train", "--stage", "15", "--config",
         str(config), "--run-dir", str(run), "--steps", "3000"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.time() + 240
    while time.time() < deadline:
        beats = liveness.heartbeats(run / "stage15")
        if max((b.get("step") or 0 for b in beats), default=0) >= 10:
            break
        time.sleep(0.2)
    with open(train, "ab") as fh:  # someone appends to the corpus the stage reads
        fh.write(np.zeros(SEQ, np.uint32).tobytes())
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 2, out[-3000:]
    assert "[data-changed]" in out and f"{train} changed under the running stage" in out
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert entry["stop"]["saved"] and entry["status"] == "failed"
