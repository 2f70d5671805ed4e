"""Every shipped config and hostfile passes `wonderland check`, and so do real public configs.

The shipped configs are checked with the world size that matches them, for every stage of the
stabilization run (15, 16, 17). The public corpus (tests/corpus/public_ds_configs) holds configs
nobody here wrote: the DeepSpeedExamples ones must pass, the Hugging Face template must be
refused with every "auto" named.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import CORPUS, REPO
from wonderland_ds.cli import main as cli
from wonderland_ds.config import ds_config, hostfile
from wonderland_ds.core.findings import Finding
from wonderland_ds.doctor import cpu

CONFIGS = sorted((REPO / "ds_configs").glob("*.json"))
HOSTFILES = sorted(p for p in (REPO / "hostfiles").iterdir() if p.is_file())
HOSTFILE_SLOTS = {
    "a100_8x8": {f"node-a100-{i}": 8 for i in range(8)},
    "a100x8": {"node-a100-0": 8},
    "localhost": {"localhost": 2},
    "localhost3": {"localhost": 3},
    "netns2": {"wl-node0": 1, "wl-node1": 1},
    "netns3": {"wl-node0": 1, "wl-node1": 1, "wl-node2": 1},
}


def hostfiles_for(config: Path) -> list[str]:
    """The shipped hostfiles a config is meant for, by its name."""
    name = config.name
    if name.startswith("a100_8x8_"):
        return ["a100_8x8"]
    if name.startswith("a100x8_"):
        return ["a100x8"]
    if name.startswith("cpu_"):
        return ["localhost", "localhost3"]
    raise AssertionError(f"{name}: no rule says which world size it is for; add one here")


MATRIX = [(c, h) for c in CONFIGS for h in hostfiles_for(c)]
STAGES = [None, 15, 16, 17]


def test_something_is_shipped() -> None:
    assert len(CONFIGS) >= 11
    assert {p.name for p in HOSTFILES} == set(HOSTFILE_SLOTS)


@pytest.mark.parametrize("path", HOSTFILES, ids=lambda p: p.name)
def test_shipped_hostfile_parses(path: Path) -> None:
    hf, findings = hostfile.parse(path)
    assert hf is not None, findings
    assert hf.hosts == HOSTFILE_SLOTS[path.name]
    assert [f.severity for f in findings] == ["ok"]
    assert hf.localhost_only is path.name.startswith("localhost")


@pytest.mark.parametrize("stage", STAGES, ids=lambda s: f"stage{s}" if s else "nostage")
@pytest.mark.parametrize(("config", "host"), MATRIX, ids=[f"{c.stem}@{h}" for c, h in MATRIX])
def test_shipped_config_passes(
    config: Path, host: str, stage: int | None, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["check", str(config), "--hostfile", str(REPO / "hostfiles" / host), "--json"]
    rc = cli.main(argv + (["--stage", str(stage)] if stage else []))
    findings = json.loads(capsys.readouterr().out)
    expected = [("ok", "hostfile"), ("ok", "config")]
    if "bf16" in config.stem and host.startswith("localhost") and cpu.check_bf16("bf16"):
        expected.append(("warn", "cpu-bf16"))  # this machine's CPU would emulate bf16
    assert [(f["severity"], f["rule"]) for f in findings] == expected
    assert rc == 0


@pytest.mark.parametrize(("config", "host"), MATRIX, ids=[f"{c.stem}@{h}" for c, h in MATRIX])
def test_shipped_config_triangle_closes(config: Path, host: str) -> None:
    raw, found = ds_config.load_json(config)
    assert raw is not None, found
    cfg, settings, found = ds_config.validate(raw, str(config))
    assert cfg is not None and settings is not None
    world = sum(HOSTFILE_SLOTS[host].values())
    triangle, found = ds_config.batch_triangle(cfg, world)
    assert found == [] and triangle is not None
    train_batch, micro, grad_acc = triangle
    assert train_batch == micro * grad_acc * world
    assert grad_acc >= 4  # the field notes' minimum, 8 for the A100 runs
    # DeepSpeed gets the same triangle with our section stripped.
    ds = ds_config.deepspeed_dict(raw, None, world)
    assert "wonderland" not in ds
    assert (ds["train_batch_size"], ds["train_micro_batch_size_per_gpu"]) == (train_batch, micro)


@pytest.mark.parametrize("config", [c for c in CONFIGS if not c.name.startswith("cpu_")])
def test_gpu_configs_fix_their_world_size(config: Path) -> None:
    """The A100 configs set all three batch sizes: any other world size is refused."""
    assert ds_config.check_file(config, None) == [
        Finding(
            "batch-triangle",
            "info",
            f"batch sizes imply a data-parallel size of {64 if '8x8' in config.name else 8}",
            "",
            str(config),
            "train_batch_size",
        )
    ]
    assert [f.rule for f in ds_config.check_file(config, 2)] == ["batch-triangle"]


# ---------------------------------------------------------------- the public corpus

VALID_CORPUS = {
    "deepspeedexamples_bert_large_pretraining.json": 8,
    "deepspeedexamples_gpt_neox_20b_zero3.json": 8,
    "deepspeedexamples_llama_70b_multi_node.json": 32,
}
#: Written for older DeepSpeed releases: their 1-bit optimizers (OneBitLamb, OneBitAdam) are
#: gone from DeepSpeed 0.19, whose initialize fails on them; check says so before a launch.
OLD_OPTIMIZER = {
    "deepspeedexamples_bert_large_pretraining.json",
    "deepspeedexamples_llama_70b_multi_node.json",
}
HF_TEMPLATE = CORPUS / "hf_transformers_tests_ds_config_zero2.json"
HF_ZERO3 = CORPUS / "hf_transformers_docs_zero3.json"  # tests/test_auto.py
HF_AUTO_PATHS = {
    "fp16.enabled",
    "bf16.enabled",
    "optimizer.params.lr",
    "optimizer.params.betas",
    "optimizer.params.eps",
    "optimizer.params.weight_decay",
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_max_lr",
    "scheduler.params.warmup_num_steps",
    "gradient_accumulation_steps",
    "gradient_clipping",
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
}


def test_corpus_is_complete() -> None:
    assert {p.name for p in CORPUS.glob("*.json")} == set(VALID_CORPUS) | {
        HF_TEMPLATE.name,
        HF_ZERO3.name,
    }


@pytest.mark.parametrize("name", sorted(VALID_CORPUS))
def test_public_configs_pass(name: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = CORPUS / name
    world = VALID_CORPUS[name]
    for argv in ([], ["--world-size", str(world)]):
        rc = cli.main(["check", str(path), "--json", *argv])
        findings = json.loads(capsys.readouterr().out)
        bad = [f for f in findings if f["severity"] in ("error", "warn")]
        if name in OLD_OPTIMIZER:
            assert [(f["rule"], f["path"]) for f in bad] == [("optimizer-type", "optimizer.type")]
            assert rc == 2
        else:
            assert bad == [] and rc == 0
    # Any other world size does not close their triangle.
    extra = ["optimizer-type"] if name in OLD_OPTIMIZER else []
    assert sorted(f.rule for f in ds_config.check_file(path, world * 2)) == sorted(
        ["batch-triangle", *extra]
    )


#: The template's "auto" values with a source here (the stage plan, the world size): filled.
HF_FILLED = {
    "scheduler.params.warmup_min_lr",
    "scheduler.params.warmup_num_steps",
    "train_batch_size",
}


def test_hf_template_names_every_auto(capsys: pytest.CaptureFixture[str]) -> None:
    """Each "auto" is either filled, with its value and source, or refused, naming its path
    and what to write: none is left to DeepSpeed."""
    rc = cli.main(["check", str(HF_TEMPLATE), "--world-size", "8", "--json"])
    findings = json.loads(capsys.readouterr().out)
    assert rc == 2
    assert len(HF_AUTO_PATHS) == 13
    refused = [f for f in findings if f["rule"] == "auto-value"]
    filled = {f["path"]: f for f in findings if f["rule"] == "auto-filled"}
    assert sorted(f["path"] for f in refused) == sorted(HF_AUTO_PATHS - HF_FILLED)
    assert set(filled) == HF_FILLED and len(findings) == len(HF_AUTO_PATHS)
    for f in refused:
        assert (f["severity"], f["file"]) == ("error", str(HF_TEMPLATE))
        assert f["fix"].startswith("write the value: ")
    assert filled["scheduler.params.warmup_num_steps"]["message"] == (
        '"auto" -> 500 (wonderland.min_warmup_steps)'
    )


def test_hf_template_filled_in_passes(tmp_path: Path) -> None:
    """Once every "auto" is replaced, the template's other settings are all accepted."""
    raw = json.loads(HF_TEMPLATE.read_text())
    raw["fp16"]["enabled"] = False
    raw["bf16"]["enabled"] = True
    raw["optimizer"]["params"] = {"lr": 1e-4, "betas": [0.9, 0.999], "eps": 1e-8}
    raw["optimizer"]["params"]["weight_decay"] = 0.0
    raw["scheduler"]["params"] = {"warmup_min_lr": 0, "warmup_max_lr": 1e-4}
    raw["scheduler"]["params"]["warmup_num_steps"] = 500
    raw.update(
        gradient_accumulation_steps=4,
        gradient_clipping=1.0,
        train_batch_size=64,
        train_micro_batch_size_per_gpu=2,
    )
    path = tmp_path / "filled.json"
    path.write_text(json.dumps(raw))
    assert ds_config.check_file(path, 8, {16}) == []
