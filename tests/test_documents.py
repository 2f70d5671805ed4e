"""Document masking: a packed sample's loss with masking is the sum of its documents' losses
computed one by one, for each architecture transformers supports it on; one that does not
(OPT) is refused by ``check`` and by the stage, naming it; the setting reaches the engine."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from tests.helpers.archs import configs
from tests.helpers.util import REPO, losses, wonderland
from wonderland_ds.cli import main as cli
from wonderland_ds.data.documents import positions
from wonderland_ds.data.tasks import Task
from wonderland_ds.data.tokens import IGNORE

transformers = pytest.importorskip("transformers")

EOS = 2


def test_positions_restart_after_each_eos_and_no_label_crosses_a_boundary():
    y = torch.tensor([[5, 9, EOS, 3, 4, EOS, 7, IGNORE, IGNORE], [EOS, 6, 6, 6, 6, 6, 6, 6, 6]])
    pos, labels = positions(y, EOS)
    assert pos.tolist() == [[0, 1, 2, 0, 1, 2, 0, 1, 2], [0, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert labels.tolist() == [
        [5, 9, EOS, IGNORE, 4, EOS, IGNORE, IGNORE, IGNORE],
        [EOS, IGNORE, 6, 6, 6, 6, 6, 6, 6],
    ]


def _task(vocab: int) -> Task:
    return Task(
        name="t", num_classes=0, build_model=lambda: None, kind="lm", normalize=False,
        batch_format="hf", document_eos=EOS, meta={"vocab": vocab},
    )  # fmt: skip


SUPPORTED = ["llama", "gpt2", "qwen2", "mistral", "gemma3_text", "gpt_neox", "falcon", "mixtral"]


@pytest.mark.parametrize("arch", SUPPORTED)
def test_a_packed_samples_loss_is_the_sum_of_its_documents_losses(arch):
    """The sample starts inside a document and ends inside another, as packed samples do."""
    cfg = configs()[arch]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    gen = torch.Generator().manual_seed(1)

    def doc(n: int, eos: bool = True) -> torch.Tensor:
        ids = torch.randint(3, cfg.vocab_size, (n,), generator=gen)
        return torch.cat([ids, torch.tensor([EOS])]) if eos else ids

    docs = [doc(4), doc(9), doc(1), doc(7), doc(5, eos=False)]
    x = torch.cat(docs)[None]
    task = _task(cfg.vocab_size)
    with torch.no_grad():
        packed = task.loss(task.forward(model, x, x.clone()), x) * task.targets(x)
        alone = sum(model(input_ids=d[None], labels=d[None]).loss * (len(d) - 1) for d in docs)
        plain = model(input_ids=x, labels=x).loss * (x.shape[1] - 1)  # masking off
    assert task.targets(x) == sum(len(d) - 1 for d in docs)
    assert float(packed) == pytest.approx(float(alone), rel=1e-5, abs=1e-4)
    assert abs(float(plain) - float(alone)) > 1e-2  # without masking, documents see each other


def test_an_architecture_without_packed_sequences_is_refused_by_check_and_the_stage(
    tmp_path, capsys
):
    """OPT computes its positions from the attention mask, not the position ids."""
    model = tmp_path / "opt"
    configs()["opt"].save_pretrained(model)
    cfg = _config(tmp_path, model, masking=True)
    assert cli.main(["check", str(cfg), "--json"]) == 2
    out = json.loads(capsys.readouterr().out)
    found = {f["rule"]: f for f in out}
    assert (
        "OPTForCausalLM does not keep attention inside documents"
        in (found["document-masking"]["message"])
    )
    run = tmp_path / "run"
    done = wonderland("train", "--stage", "15", "--config", str(cfg), "--run-dir", str(run))
    assert done.returncode == 2, (done.stdout + done.stderr)[-3000:]
    assert "[document-masking]" in done.stdout + done.stderr
    assert "Traceback" not in done.stdout + done.stderr
    assert not list(run.glob("stage15/checkpoints/global_step*"))  # nothing trained


def test_a_model_without_a_usable_eos_needs_data_eos_id(tmp_path, capsys):
    model = tmp_path / "gpt2"
    transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2
    ).save_pretrained(model)  # eos 50256
    cfg = _config(tmp_path, model, masking=True, vocab=64)
    assert cli.main(["check", str(cfg), "--json"]) == 2
    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)}
    assert (
        "eos_token_id is 50256, not a token id below the vocabulary size 64"
        in (found["data-eos"]["message"])
    )
    body = json.loads(cfg.read_text())
    body["wonderland"]["data"]["eos_id"] = EOS
    cfg.write_text(json.dumps(body))
    assert cli.main(["check", str(cfg), "--json"]) in (0, 1)
    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)}
    assert found["document-masking"]["severity"] == "ok"


@pytest.mark.slow
def test_document_masking_reaches_the_engine(tmp_path):
    """The stage asks the model it built to train (the probe runs the training forward on the
    engine's module) and trains with it."""
    model = tmp_path / "llama"
    configs()["llama"].save_pretrained(model)
    cfg = _config(tmp_path, model, masking=True)
    run = tmp_path / "run"
    args = ["--config", str(cfg), "--run-dir", str(run), "--steps", "3", "--nproc", "1"]
    done = wonderland("train", "--stage", "15", *args)
    out = done.stdout + done.stderr
    assert done.returncode == 0, out[-3000:]
    assert "document masking: LlamaForCausalLM keeps attention and positions inside" in out
    trained = losses(run / "stage15")
    assert len(trained) == 3 and all(np.isfinite(list(trained.values())))


def _config(tmp_path, model, masking: bool, vocab: int = 256):
    rng = np.random.default_rng(0)
    docs = [np.append(rng.integers(3, vocab, rng.integers(2, 12)), EOS) for _ in range(400)]
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "train.bin")
    config = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 4
    config["gradient_accumulation_steps"] = 1
    data = {
        "train": [str(tmp_path / "train.bin")],
        "heldout": {"h": [str(tmp_path / "train.bin")]},
        "dtype": "uint16",
        "seq_len": 32,
        "document_masking": masking,
    }
    config["wonderland"] = {"task": "causal-lm", "model": {"hf": str(model)}, "data": data}
    path = tmp_path / f"config_{model.name}_{masking}.json"
    path.write_text(json.dumps(config))
    return path
