"""``"auto"`` as Hugging Face's DeepSpeed configs hold it: filled from the model, the world
size, the stage plan and the optimizer's ``lr`` where this engine knows the value, refused by
key where it does not; a default ZeRO-3 bucket far beyond the model's needs is a warning;
transformers' ZeRO-3 config, with only its unfillable values written in, trains 15 -> 16."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import CORPUS
from tests.helpers.util import wonderland
from wonderland_ds.cli import main as cli
from wonderland_ds.config import auto, ds_config

transformers = pytest.importorskip("transformers")

HF_ZERO3 = CORPUS / "hf_transformers_docs_zero3.json"
#: What nothing here can fill: the Trainer's own arguments, and the batch keys past one.
UNFILLABLE = {
    "fp16.enabled": "true or false",
    "bf16.enabled": "true or false",
    "optimizer.params.lr": "the learning rate",
    "optimizer.params.betas": "[0.9, 0.95]",
    "optimizer.params.eps": "1e-8",
    "optimizer.params.weight_decay": "0.1",
    "scheduler.params.warmup_max_lr": "the peak LR",  # it follows lr, itself "auto"
    "gradient_clipping": "max gradient norm",
    "gradient_accumulation_steps": "micro batch and gradient accumulation",
    "train_micro_batch_size_per_gpu": "micro batch and gradient accumulation",
}
HIDDEN = 32


def _setup(tmp_path: Path, raw: dict, arch: str = "llama") -> Path:
    from tests.helpers.archs import configs

    model = tmp_path / "model"
    if not model.exists():
        configs()[arch].save_pretrained(model)
        rng = np.random.default_rng(0)
        rng.integers(3, 256, 200 * 32).astype(np.uint16).tofile(tmp_path / "train.bin")
    raw = json.loads(json.dumps(raw))
    raw["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(model)},
        "data": {
            "train": [str(tmp_path / "train.bin")],
            "heldout": {"h": [str(tmp_path / "train.bin")]},
            "dtype": "uint16",
            "seq_len": 32,
        },
        "stage_train_steps": {"15": 4, "16": 3},
        "min_warmup_steps": 2,
        "save_interval": 4,
    }
    path = tmp_path / f"config_{len(list(tmp_path.glob('config_*')))}.json"
    path.write_text(json.dumps(raw))
    return path


def _written(raw: dict) -> dict:
    """The transformers config with only its unfillable "auto" values written in."""
    raw = json.loads(json.dumps(raw))
    raw["fp16"]["enabled"] = False
    raw["bf16"]["enabled"] = False
    raw["optimizer"]["params"].update(lr=1e-3, betas=[0.9, 0.95], eps=1e-8, weight_decay=0.0)
    raw.update(gradient_clipping=1.0, train_micro_batch_size_per_gpu=2)
    raw["gradient_accumulation_steps"] = 2
    return raw


def test_check_refuses_each_auto_without_a_source_and_fills_the_rest(tmp_path, capsys):
    cfg = _setup(tmp_path, json.loads(HF_ZERO3.read_text()))
    assert cli.main(["check", str(cfg), "--world-size", "2", "--json"]) == 2
    found = json.loads(capsys.readouterr().out)
    refused = {f["path"]: f for f in found if f["rule"] == "auto-value"}
    assert set(refused) == set(UNFILLABLE)
    for path, hint in UNFILLABLE.items():
        assert refused[path]["severity"] == "error" and hint in refused[path]["fix"], path
    filled = {f["path"]: f["message"] for f in found if f["rule"] == "auto-filled"}
    assert filled == {
        "zero_optimization.reduce_bucket_size": '"auto" -> 1024 (the model\'s hidden_size 32,'
        " squared)",
        "zero_optimization.stage3_prefetch_bucket_size": '"auto" -> 921 (the model\'s'
        " hidden_size 32, squared x 0.9)",
        "zero_optimization.stage3_param_persistence_threshold": '"auto" -> 320 (the model\'s'
        " hidden_size 32, x 10)",
        "scheduler.params.warmup_min_lr": '"auto" -> 0 (0, as the Hugging Face integration'
        " fills it)",
        "scheduler.params.warmup_num_steps": '"auto" -> 2 (wonderland.min_warmup_steps)',
        "train_batch_size": '"auto" -> derived at launch (derived from the other two batch'
        " keys and the world size)",
    }


def test_the_filled_values_are_the_integrations_and_the_stage_plans(tmp_path):
    raw = _written(json.loads(HF_ZERO3.read_text()))
    raw["scheduler"] = {
        "type": "WarmupDecayLR",
        "params": {k: "auto" for k in ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps")}
        | {"total_num_steps": "auto"},
    }
    body = json.loads(_setup(tmp_path, raw, arch="gpt2").read_text())  # GPT-2: n_embd
    out, filled, refused = auto.fill(body, "c.json", world_size=4)
    assert refused == []
    values = {f.path: f.value for f in filled}
    assert values == {
        "zero_optimization.reduce_bucket_size": HIDDEN * HIDDEN,
        "zero_optimization.stage3_prefetch_bucket_size": int(0.9 * HIDDEN * HIDDEN),
        "zero_optimization.stage3_param_persistence_threshold": 10 * HIDDEN,
        "scheduler.params.warmup_min_lr": 0,
        "scheduler.params.warmup_max_lr": 1e-3,  # the optimizer's lr
        "scheduler.params.warmup_num_steps": 2,  # min_warmup_steps
        "scheduler.params.total_num_steps": 7,  # stages 15 and 16: 4 + 3
        "train_batch_size": 16,  # 2 x 2 x 4 ranks
    }
    assert "n_embd 32" in next(f.source for f in filled if "reduce" in f.path)
    resolved = ds_config.deepspeed_dict(body, None, 4)  # what deepspeed.initialize gets
    assert resolved["zero_optimization"]["reduce_bucket_size"] == 1024
    assert resolved["scheduler"]["params"]["total_num_steps"] == 7
    assert resolved["train_batch_size"] == 16 and "auto" not in json.dumps(resolved)
    assert auto.fill(out)[1:] == ([], [])  # filled once, nothing left


def test_a_bucket_auto_without_a_model_config_is_refused(tmp_path, capsys):
    raw = _written(json.loads(HF_ZERO3.read_text()))
    path = tmp_path / "digits.json"
    path.write_text(json.dumps(raw))  # the built-in task: no config.json to size buckets
    assert cli.main(["check", str(path), "--world-size", "2", "--json"]) == 2
    refused = {
        f["path"]: f for f in json.loads(capsys.readouterr().out) if f["severity"] == "error"
    }
    assert set(refused) == set(auto.BUCKETS)
    assert "no wonderland.model.hf config.json" in refused[auto.BUCKETS[0]]["message"]


def test_check_warns_about_default_zero3_buckets_on_a_small_model(tmp_path, capsys):
    raw = _written(json.loads(HF_ZERO3.read_text()))
    for key in ("reduce_bucket_size", "stage3_prefetch_bucket_size"):
        del raw["zero_optimization"][key]
    cfg = _setup(tmp_path, raw)
    assert cli.main(["check", str(cfg), "--world-size", "2", "--json"]) == 0  # a warning
    warned = {
        f["path"]: f for f in json.loads(capsys.readouterr().out) if f["rule"] == "zero-bucket-size"
    }
    assert set(warned) == {
        "zero_optimization.reduce_bucket_size",
        "zero_optimization.stage3_prefetch_bucket_size",
    }
    msg = warned["zero_optimization.reduce_bucket_size"]["message"]
    assert "default 500,000,000 elements" in msg and "= 1.86 GiB per rank" in msg
    assert '"auto" (fills 1,024)' in warned["zero_optimization.reduce_bucket_size"]["fix"]
    # An explicit value is the user's: not judged.
    raw["zero_optimization"]["reduce_bucket_size"] = 500_000_000
    raw["zero_optimization"]["stage3_prefetch_bucket_size"] = 50_000_000
    cfg = _setup(tmp_path, raw)
    assert cli.main(["check", str(cfg), "--world-size", "2", "--json"]) == 0
    assert "zero-bucket-size" not in capsys.readouterr().out


@pytest.mark.matrix
def test_the_transformers_zero3_config_trains_with_its_fillable_autos_left_in(tmp_path):
    """CPU offload of optimizer and parameters, as the page has it; stage 16 resumes with the
    same filled numbers."""
    raw = _written(json.loads(HF_ZERO3.read_text()))
    cfg = _setup(tmp_path, raw)
    assert "auto" in cfg.read_text()
    run = tmp_path / "run"
    done = wonderland(
        "pipeline", "--from", "15", "--to", "16", "--config", str(cfg), "--run-dir", str(run),
        timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    recorded = {n: json.loads((run / f"stage{n}" / "ds_config.json").read_text()) for n in (15, 16)}
    for ds in recorded.values():
        zero = ds["zero_optimization"]
        assert zero["offload_optimizer"]["device"] == "cpu"
        assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"]) == (1024, 921)
        assert zero["stage3_param_persistence_threshold"] == 320
        assert ds["scheduler"]["params"] == {
            "warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 2,
        }  # fmt: skip
        assert ds["train_batch_size"] == 8 and "auto" not in json.dumps(ds)
    assert recorded[15] == recorded[16]
    assert "auto-filled" in done.stdout + done.stderr  # the launch shows what it filled
