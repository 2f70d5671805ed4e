"""The model room: under ZeRO-3 a rank never holds the whole model, and what it builds trains
as the whole model does; MoE ranks routed to disjoint experts do not hang; the levers are
checked before a launch.

The ZeRO checks run ``tests/helpers/zero3_model.py`` on 2 gloo ranks (torchrun): the model is
built as a stage builds it (``wonderland_ds.model.construct``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from tests.helpers.util import REPO
from wonderland_ds.cli import main as cli

transformers = pytest.importorskip("transformers")
BIN = Path(sys.executable).parent


def llama(folder: Path, **extra) -> Path:
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        rope_theta=10000.0, **extra,
    )  # fmt: skip
    torch.manual_seed(3)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def mixtral(folder: Path) -> Path:
    config = transformers.MixtralConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(5)
    transformers.MixtralForCausalLM(config).save_pretrained(folder)
    return folder


def ranks(tmp: Path, name: str, spec: dict, nproc: int = 2, timeout: int = 240) -> list[dict]:
    """The helper on ``nproc`` ranks; each rank's record."""
    (tmp / f"{name}.json").write_text(json.dumps(spec))
    out = tmp / name
    port = 29000 + os.getpid() % 2000
    cmd = [str(BIN / "torchrun"), "--nproc_per_node", str(nproc), "--master_port", str(port)]
    cmd += [str(REPO / "tests" / "helpers" / "zero3_model.py"), str(tmp / f"{name}.json"), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(nproc)]


def test_zero3_builds_partitioned_and_trains_as_the_whole_model(tmp_path):
    model = llama(tmp_path / "llama")
    spec = {"hf": str(model), "init": "weights", "steps": 3, "seq": 32}
    z3 = ranks(tmp_path, "z3", {**spec, "zero": 3})
    z2 = ranks(tmp_path, "z2", {**spec, "zero": 2})
    numel = z3[0]["numel"]
    for r in z3:  # every parameter partitioned at construction: a half each, nothing whole
        assert r["partitioned"], r
        assert numel / 2 <= r["held"] <= numel / 2 + 4 * 64, (r["held"], numel)
    assert not z2[0]["partitioned"] and z2[0]["held"] == numel
    # The same weights (loaded into the partitions on rank 0's reads) and buffers: the same
    # losses as the model built whole, before and after optimizer updates.
    reference = transformers.AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    for name, buf in reference.named_buffers():  # RoPE's non-persistent inv_freq included
        assert z3[0]["buffers"][name] == pytest.approx(float(buf.double().sum()), rel=1e-6)
    assert z3[0]["losses"] == pytest.approx(z2[0]["losses"], rel=1e-5)
    assert z3[0]["losses"][0] == z3[1]["losses"][0]  # both ranks saw the same batch
    assert z3[0]["losses"][-1] < z3[0]["losses"][0]  # it trained


def test_gradient_checkpointing_trains_the_same_under_zero3(tmp_path):
    model = llama(tmp_path / "llama")
    spec = {"hf": str(model), "init": "weights", "steps": 2, "seq": 32, "zero": 3}
    plain = ranks(tmp_path, "plain", spec)
    ckpt = ranks(tmp_path, "ckpt", {**spec, "model": {"gradient_checkpointing": True}})
    assert ckpt[0]["checkpointing"] and not plain[0]["checkpointing"]
    assert ckpt[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)


def _routes(model: torch.nn.Module, token: int) -> list[frozenset[int]]:
    """The experts each layer's router picks for a sequence of one repeated token (every
    position has the same hidden state, so one set per layer)."""
    got: list[frozenset[int]] = []
    hooks = [
        m.register_forward_hook(
            lambda _m, _a, out: got.append(frozenset(out[2].flatten().tolist()))
        )
        for m in model.modules()
        if type(m).__name__.endswith("TopKRouter")
    ]
    with torch.no_grad():
        model(input_ids=torch.full((1, 16), token))
    for h in hooks:
        h.remove()
    return got


def test_moe_ranks_routed_to_disjoint_experts_train_without_a_hang(tmp_path):
    folder = mixtral(tmp_path / "mixtral")
    reference = transformers.AutoModelForCausalLM.from_pretrained(folder).eval()
    routes = {t: _routes(reference, t) for t in range(128)}
    pair = next(
        (a, b)
        for a in range(128)
        for b in range(a + 1, 128)
        if all(x.isdisjoint(y) for x, y in zip(routes[a], routes[b]))
    )
    spec = {"hf": str(folder), "init": "weights", "steps": 3, "seq": 16, "zero": 3}
    spec["tokens"] = [[pair[0]] * 16, [pair[1]] * 16]
    got = ranks(tmp_path, "moe", spec, timeout=180)  # a hang would time out
    for layer, (a, b) in enumerate(zip(got[0]["first_routes"], got[1]["first_routes"])):
        assert set(a).isdisjoint(b), (layer, a, b)  # the ranks really ran different experts
    for r in got:
        assert r["leaf"] == ["MixtralSparseMoeBlock"] * 2, r["leaf"]
        assert len(r["aux"]) == 3 and all(a > 0 for a in r["aux"])  # the router loss trained
        assert r["losses"][-1] < r["losses"][0]


def _json(out: str) -> list[dict]:
    # DeepSpeed's logger, made by an earlier test of this process, may hold pytest's stdout.
    return json.loads("\n".join(line for line in out.splitlines() if not line.startswith("[20")))


def _check(tmp_path: Path, capsys, model: dict, expect: int = 2) -> list[dict]:
    folder = llama(tmp_path / "llama")
    raw = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    (tmp_path / "t.bin").write_bytes((np.arange(2000) % 200).astype(np.uint16).tobytes())
    raw["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(folder), **model},
        "data": {"train": [str(tmp_path / "t.bin")], "heldout": {"a": [str(tmp_path / "t.bin")]},
                 "dtype": "uint16", "seq_len": 16},
    }  # fmt: skip
    path = tmp_path / "c.json"
    path.write_text(json.dumps(raw))
    rc = cli.main(["check", str(path), "--json"])
    found = _json(capsys.readouterr().out)
    assert rc == expect, found
    return found


def test_check_refuses_flash_attention_when_it_is_not_installed(tmp_path, capsys):
    found = _check(tmp_path, capsys, {"attn_implementation": "flash_attention_2"})
    (f,) = [f for f in found if f["rule"] == "model-attention"]
    assert f["path"] == "wonderland.model.attn_implementation" and "flash-attn" in f["fix"]


def test_check_refuses_a_half_load_dtype_for_fp32_training(tmp_path, capsys):
    found = _check(tmp_path, capsys, {"dtype": "bfloat16"})
    (f,) = [f for f in found if f["rule"] == "model-dtype"]
    assert f["path"] == "wonderland.model.dtype" and "bf16" in f["fix"]


def test_check_refuses_an_unknown_lever_with_its_path(tmp_path, capsys):
    found = _check(tmp_path, capsys, {"attn_implementation": "fast"})
    assert any("attn_implementation" in f["path"] for f in found if f["severity"] == "error")


def test_check_estimates_memory_per_rank_and_refuses_what_does_not_fit(tmp_path, capsys):
    # Declared devices too small for the model: refused, the fixes named, ZeRO-3 among them.
    found = _check(tmp_path, capsys, {}, expect=0)
    raw = json.loads((tmp_path / "c.json").read_text())
    raw["wonderland"]["device_memory_gb"] = 0.0005
    raw["train_micro_batch_size_per_gpu"] = 8
    (tmp_path / "c.json").write_text(json.dumps(raw))
    assert cli.main(["check", str(tmp_path / "c.json"), "--json", "--world-size", "2"]) == 2
    (est,) = [f for f in _json(capsys.readouterr().out) if f["rule"] == "memory"]
    assert est["severity"] == "error" and est["path"] == "wonderland.device_memory_gb"
    assert "ZeRO-3" in est["fix"] and "gradient_checkpointing" in est["fix"], est
    assert "with gradient checkpointing" in est["message"]
    # 2 ranks under ZeRO-2 in fp32: the optimizer states are split in two, parameters are not.
    model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "llama")
    params = sum(p.numel() for p in model.parameters())
    assert f"{params / 1e6:.1f}M parameters, ZeRO-2, 2 rank(s)" in est["message"]
    assert f"parameters {4 * params / 1e9:.2f} GB" in est["message"]
    assert f"optimizer {12 * params / 2 / 1e9:.2f} GB" in est["message"]
    assert [f["severity"] for f in found if f["rule"] == "memory"] == ["ok"]  # fits here
