"""The causal-LM task: a Hugging Face model on token files, configured in JSON.

Bad input is refused by the front process (exit 2, nothing written) and by ``wonderland
check``; the model contract takes tensors, ``ModelOutput``s and dicts; the example runs
stages 15 -> 18 and its export reloads with ``from_pretrained`` at stage 17's loss."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.util import REPO, losses, snapshot, wonderland
from wonderland_ds.cli import main as cli
from wonderland_ds.data.tasks import ModelContractError, standard_loss

transformers = pytest.importorskip("transformers")

BASE = REPO / "ds_configs" / "cpu_zero2_bf16_pylm.json"


def tiny_model(folder: Path, vocab: int = 64, positions: int = 32) -> Path:
    transformers.GPT2Config(
        vocab_size=vocab, n_positions=positions, n_embd=16, n_layer=1, n_head=2
    ).save_pretrained(folder)
    return folder


def tokens(path: Path, n: int, vocab: int = 64, dtype=np.uint16) -> Path:
    (np.arange(n) * 7 % vocab).astype(dtype).tofile(path)
    return path


@pytest.fixture
def setup(tmp_path):
    """A model directory, token files and a config naming them; returns (config, edit)."""
    model = tiny_model(tmp_path / "model")
    tokens(tmp_path / "train.bin", 4000)
    tokens(tmp_path / "held.bin", 500)
    config = json.loads(BASE.read_text())
    config["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(model)},
        "data": {
            "train": [str(tmp_path / "train.bin")],
            "heldout": {"web": [str(tmp_path / "held.bin")]},
            "dtype": "uint16",
            "seq_len": 16,
        },
    }
    path = tmp_path / "config.json"

    def edit(change=None) -> Path:
        body = json.loads(json.dumps(config))
        if change:
            change(body["wonderland"])
        path.write_text(json.dumps(body))
        return path

    return edit, tmp_path


def refused(capsys, config: Path, run: Path, rule: str) -> str:
    before = snapshot(config.parent)
    rc = cli.main(["train", "--stage", "15", "--config", str(config), "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert f"[{rule}]" in err and "Traceback" not in err, err
    assert not run.exists() and snapshot(config.parent) == before  # nothing written
    rc = cli.main(["check", str(config), "--json"])  # check finds the same, before any launch
    found = json.loads(capsys.readouterr().out)
    assert rc == 2 and rule in {f["rule"] for f in found}, found
    return err


def test_a_missing_token_file(capsys, setup):
    edit, tmp = setup
    cfg = edit(lambda w: w["data"].update(train=[str(tmp / "nope.bin")]))
    assert "nope.bin" in refused(capsys, cfg, tmp / "run", "data-missing")


def test_a_file_that_is_not_whole_tokens(capsys, setup):
    edit, tmp = setup
    (tmp / "odd.bin").write_bytes(b"\x01\x00\x02")
    cfg = edit(lambda w: w["data"].update(train=[str(tmp / "odd.bin")]))
    assert "not a multiple" in refused(capsys, cfg, tmp / "run", "data-size")


def test_a_token_outside_the_vocabulary(capsys, setup):
    edit, tmp = setup
    tokens(tmp / "wide.bin", 4000, vocab=100)  # ids up to 99, the model has 64
    cfg = edit(lambda w: w["data"].update(train=[str(tmp / "wide.bin")]))
    err = refused(capsys, cfg, tmp / "run", "data-vocab")
    assert "vocabulary of 64" in err


def test_seq_len_longer_than_the_models_positions(capsys, setup):
    edit, tmp = setup
    cfg = edit(lambda w: w["data"].update(seq_len=33))
    assert "32 positions" in refused(capsys, cfg, tmp / "run", "data-seq-len")


def test_a_model_directory_without_config_json(capsys, setup):
    edit, tmp = setup
    (tmp / "empty").mkdir()
    cfg = edit(lambda w: w["model"].update(hf=str(tmp / "empty")))
    assert "no config.json" in refused(capsys, cfg, tmp / "run", "model-config")


def test_weights_asked_for_but_none_there(capsys, setup):
    edit, tmp = setup
    cfg = edit(lambda w: w["model"].update(init="weights"))
    refused(capsys, cfg, tmp / "run", "model-weights")


def test_a_heldout_source_with_no_files(capsys, setup):
    edit, tmp = setup
    cfg = edit(lambda w: w["data"]["heldout"].update(code=[str(tmp / "code_*.bin")]))
    assert "code_*.bin" in refused(capsys, cfg, tmp / "run", "data-missing")
    cfg = edit(lambda w: w["data"]["heldout"].update(code=[]))
    rc = cli.main(["check", str(cfg)])
    assert rc == 2 and "lists no files" in capsys.readouterr().out


def test_config_sections_are_validated(capsys, setup):
    edit, tmp = setup
    for change, text in (
        (lambda w: w.pop("model"), "needs model"),
        (lambda w: w.update(task="digits"), "configure the causal-lm task"),
        (lambda w: w["data"].update(dtype="float32"), "dtype"),
        (lambda w: w["data"].update(seq_lenn=4), "seq_lenn"),
    ):
        rc = cli.main(["check", str(edit(change))])
        out = capsys.readouterr().out
        assert rc == 2 and text in out, out


def test_check_runs_one_forward_and_loss(capsys, setup):
    edit, _ = setup
    rc = cli.main(["check", str(edit()), "--json"])
    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)}
    assert rc == 0 and found["task"]["severity"] == "ok", found
    assert "one micro-batch (4x16)" in found["task"]["message"]


def test_check_refuses_a_model_whose_output_the_loss_cannot_use(capsys, tmp_path):
    cfg = json.loads((REPO / "ds_configs" / "cpu_zero2_bf16.json").read_text())
    cfg["wonderland"]["task"] = "tests.helpers.broken_tasks:digits_without_logits"
    path = tmp_path / "c.json"
    path.write_text(json.dumps(cfg))
    rc = cli.main(["check", str(path)])
    out = capsys.readouterr().out
    assert rc == 2 and "[task-forward]" in out and "without logits or loss" in out, out


def test_the_model_contract_takes_tensors_model_outputs_and_dicts():
    from transformers.modeling_outputs import CausalLMOutputWithCrossAttentions

    torch.manual_seed(0)
    logits = torch.randn(2, 5, 11)
    y = torch.randint(0, 11, (2, 5))
    y[1, 3:] = -100  # padding
    # Shifted labels (transformers' convention) against a hand-written shift.
    ref = torch.nn.functional.cross_entropy(
        logits[:, :-1].reshape(-1, 11), y[:, 1:].reshape(-1), ignore_index=-100
    )
    for out in (logits, {"logits": logits}, CausalLMOutputWithCrossAttentions(logits=logits)):
        assert torch.allclose(standard_loss(out, y, "lm", shift=True), ref)
    given = torch.tensor(1.25)
    assert standard_loss({"loss": given, "logits": logits}, y, "lm", True) == given  # its own
    with pytest.raises(ModelContractError, match="without logits or loss"):
        standard_loss({"hidden": logits}, y, "lm", True)
    with pytest.raises(ModelContractError, match="do not fit"):
        standard_loss(logits[:, :3], y, "lm", True)


def test_the_task_loss_is_the_hf_models_own(setup):
    """The built-in task's loss on a batch equals the model's loss given labels (the loss
    stage 17 and a reloaded export compute)."""
    edit, _ = setup
    from wonderland_ds.config import ds_config
    from wonderland_ds.data import lm

    raw, _ = ds_config.load_json(edit())
    _, settings, _ = ds_config.validate(raw)
    task = lm.load_task("causal-lm", settings)
    torch.manual_seed(0)
    model = task.build_model().eval()
    x, y = (torch.from_numpy(a) for a in task.heldout_sources["web"].take(np.arange(3)))
    with torch.no_grad():
        ours = task.batch_loss(model, x, y)
        theirs = model(input_ids=x, labels=x).loss
    assert torch.allclose(ours, theirs) and task.targets(y) == 3 * 15


@pytest.mark.slow
def test_pretrained_weights_train_in_training_mode(tmp_path):
    """from_pretrained returns a model in eval mode; the stage trains it in training mode:
    with dropout in the model's config the first loss differs from the same weights' without
    (the same batch, the same seed). transformers' gradient checkpointing, too, acts only in
    training mode."""
    torch.manual_seed(0)
    folder = tmp_path / "model"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    ).save_pretrained(folder)
    tokens(tmp_path / "train.bin", 4000)
    first = {}
    for drop in (0.0, 0.5):
        hf = json.loads((folder / "config.json").read_text())
        hf.update(resid_pdrop=drop, embd_pdrop=drop, attn_pdrop=drop)
        (folder / "config.json").write_text(json.dumps(hf))
        config = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
        config["wonderland"] = {
            "task": "causal-lm",
            "model": {"hf": str(folder), "init": "weights"},
            "data": {
                "train": [str(tmp_path / "train.bin")],
                "heldout": {"held": [str(tmp_path / "train.bin")]},
                "dtype": "uint16",
                "seq_len": 16,
            },
        }
        path = tmp_path / f"drop{drop}.json"
        path.write_text(json.dumps(config))
        run = tmp_path / f"run{drop}"
        args = ["--config", str(path), "--run-dir", str(run), "--steps", "1", "--nproc", "1"]
        done = wonderland("train", "--stage", "15", *args)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        first[drop] = losses(run / "stage15")[1]
    assert first[0.5] != pytest.approx(first[0.0], rel=1e-4), first  # dropout was on


@pytest.mark.examples
def test_example_runs_stages_15_to_18_and_its_export_reloads(tmp_path):
    out = tmp_path / "ex"
    prep = subprocess.run(
        [sys.executable, "examples/hf_causal_lm/prepare.py", "--out", str(out), "--steps", "12"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert prep.returncode == 0, prep.stderr
    cfg, run = out / "config.json", out / "run"
    assert cli.main(["check", str(cfg)]) == 0  # in this process: transformers is imported
    result = wonderland(
        "pipeline", "--from", "15", "--to", "18", "--config", str(cfg), "--run-dir", str(run),
        timeout=500,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads((run / "stage17" / "report.json").read_text())
    per = {r["source"]: r for r in report["stage16"]["per_source"]}
    assert set(per) == {"story", "sums"} and report["gate"]["verdict"] == "pass"
    assert (run / "stage17" / "loss_per_source.png").stat().st_size > 0
    assert report["stage16"]["loss"] < report["stage15"]["loss"]  # stage 16 trained
    # The run folder holds no copy of the data.
    copies = [p for p in run.rglob("*") if p.suffix in (".bin", ".npy")]
    assert sum(p.stat().st_size for p in copies) < 1 << 20, copies
    # The export is a save_pretrained folder with the tokenizer; reloaded, its held-out loss
    # per source is stage 17's.
    export = run / "stage18"
    assert {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json"} <= {
        p.name for p in export.iterdir()
    }
    # Stage 17 evaluated in the training dtype (bf16) from the engine's module weights, which
    # are the fp32 master weights rounded: the export cast to bf16 gives its losses, to the
    # bf16 rounding of forward passes over other batch shapes.
    model = transformers.AutoModelForCausalLM.from_pretrained(export).eval().to(torch.bfloat16)
    transformers.AutoTokenizer.from_pretrained(export)
    seq = json.loads(cfg.read_text())["wonderland"]["data"]["seq_len"]
    for source, row in per.items():
        ids = np.fromfile(out / "data" / f"heldout_{source}.bin", dtype=np.uint16).astype(np.int64)
        total, count = 0.0, 0
        for s in range(0, len(ids), seq):
            window = torch.from_numpy(ids[s : s + seq])[None]
            if window.shape[1] < 2:
                continue
            with torch.no_grad():
                loss = model(input_ids=window, labels=window).loss
            total += float(loss) * (window.shape[1] - 1)
            count += window.shape[1] - 1
        assert count == row["tokens"]
        assert abs(total / count - row["loss"]) <= 2e-3 * row["loss"], (source, total / count, row)
    shutil.rmtree(run / "stage15", ignore_errors=True)  # keep tmp small
