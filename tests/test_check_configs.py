"""`wonderland check` on configs: a corpus of broken configs and malformed files.

Every broken config is a mutation of ``BASE`` (valid for a world size of 8, every stage) and
must be refused with the named rule at the named JSON path, exit code 2, and nothing else.
"""

from __future__ import annotations

import copy
import json
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from wonderland_ds.cli import main as cli
from wonderland_ds.config import ds_config

BASE: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 8,
    "gradient_clipping": 1.0,
    "steps_per_print": 100,
    "bf16": {"enabled": True},
    "zero_optimization": {"stage": 2, "overlap_comm": True},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-4, "betas": [0.9, 0.95]}},
    "scheduler": {
        "type": "WarmupDecayLR",
        "params": {"warmup_max_lr": 1e-4, "warmup_num_steps": 600, "total_num_steps": 5000},
    },
    "checkpoint": {"load_universal": False},
    "wonderland": {"seed": 1, "train_steps": 100, "stage_train_steps": {"16": 50}},
}

DROP = object()
FP16 = {"enabled": True, "loss_scale": 0, "loss_scale_window": 1000, "min_loss_scale": 1}
FINDING_KEYS = {"file", "path", "rule", "severity", "message", "fix"}


def mutate(changes: dict[str, Any]) -> dict[str, Any]:
    """BASE with each dotted path set to a value (DROP removes it)."""
    cfg = copy.deepcopy(BASE)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split(".")
        node = cfg
        for part in parents:
            node = node.setdefault(part, {})
        if value is DROP:
            node.pop(leaf, None)
        else:
            node[leaf] = copy.deepcopy(value)
    return cfg


def write(tmp_path: Path, cfg: Any, name: str = "cfg.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(cfg, indent=2), encoding="utf-8")
    return path


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[dict[str, str]]]:
    rc = cli.main(["check", *argv, "--json"])
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    return rc, json.loads(out.out)


@dataclass(frozen=True)
class Broken:
    id: str
    changes: dict[str, Any]
    rule: str
    path: str
    fix: str = ""
    """A substring the finding's fix must contain."""
    world: int = 8
    stage: int | None = None
    severity: str = "error"
    also: tuple[tuple[str, str], ...] = field(default=())
    """Other (rule, path) errors the mutation must also produce."""


BROKEN = [
    # unknown / misspelled top-level keys: DeepSpeed ignores them silently
    Broken(
        "typo-gradient_acumulation_steps",
        {"gradient_acumulation_steps": 8},
        "unknown-key",
        "gradient_acumulation_steps",
        "did you mean 'gradient_accumulation_steps'",
    ),
    Broken(
        "typo-train_micro_batch_size",
        {"train_micro_batch_size": 4},
        "unknown-key",
        "train_micro_batch_size",
        "did you mean 'train_micro_batch_size_per_gpu'",
    ),
    Broken(
        "typo-zero_optimisation",
        {"zero_optimisation": {"stage": 3}},
        "unknown-key",
        "zero_optimisation",
        "did you mean 'zero_optimization'",
    ),
    Broken(
        "typo-optimiser",
        {"optimiser": {"type": "Adam"}},
        "unknown-key",
        "optimiser",
        "did you mean 'optimizer'",
    ),
    Broken(
        "typo-schedular",
        {"schedular": {"type": "WarmupLR"}},
        "unknown-key",
        "schedular",
        "did you mean 'scheduler'",
    ),
    Broken(
        "typo-gradient_cliping",
        {"gradient_cliping": 1.0},
        "unknown-key",
        "gradient_cliping",
        "did you mean 'gradient_clipping'",
    ),
    Broken(
        "typo-steps_per_prnt",
        {"steps_per_prnt": 10},
        "unknown-key",
        "steps_per_prnt",
        "did you mean 'steps_per_print'",
    ),
    # typos inside sections
    Broken(
        "typo-checkpoint-load_universl",
        {"checkpoint.load_universl": True},
        "unknown-key",
        "checkpoint.load_universl",
        "did you mean 'load_universal'",
    ),
    Broken(
        "typo-checkpoint-tag_validaton",
        {"checkpoint.tag_validaton": "Fail"},
        "unknown-key",
        "checkpoint.tag_validaton",
        "did you mean 'tag_validation'",
    ),
    Broken(
        "typo-scheduler-warmup_num_step",
        {"scheduler.params.warmup_num_step": 600},
        "unknown-key",
        "scheduler.params.warmup_num_step",
        "did you mean 'warmup_num_steps'",
    ),
    Broken(
        "typo-scheduler-total_num_step",
        {"scheduler.params.total_num_step": 5000},
        "unknown-key",
        "scheduler.params.total_num_step",
        "did you mean 'total_num_steps'",
    ),
    Broken(
        "typo-zero-overlap_com",
        {"zero_optimization.overlap_com": True},
        "unknown-key",
        "zero_optimization.overlap_com",
        "did you mean 'overlap_comm'",
    ),
    Broken(
        "typo-zero-reduce_bucket_sz",
        {"zero_optimization.reduce_bucket_sz": 500_000_000},
        "unknown-key",
        "zero_optimization.reduce_bucket_sz",
        "did you mean 'reduce_bucket_size'",
    ),
    Broken(
        "typo-offload_optimizer-pin_memroy",
        {"zero_optimization.offload_optimizer": {"device": "cpu", "pin_memroy": True}},
        "unknown-key",
        "zero_optimization.offload_optimizer.pin_memroy",
        "did you mean 'pin_memory'",
    ),
    Broken(
        "typo-offload_param-buffer_cnt",
        {
            "zero_optimization.stage": 3,
            "zero_optimization.offload_param": {"device": "cpu", "buffer_cnt": 4},
        },
        "unknown-key",
        "zero_optimization.offload_param.buffer_cnt",
        "did you mean 'buffer_count'",
    ),
    Broken(
        "typo-fp16-loss_scale_windw",
        {"bf16": DROP, "fp16": {**FP16, "loss_scale_windw": 500}},
        "unknown-key",
        "fp16.loss_scale_windw",
        "did you mean 'loss_scale_window'",
    ),
    Broken(
        "typo-bf16-enable",
        {"bf16.enable": True},
        "unknown-key",
        "bf16.enable",
        "did you mean 'enabled'",
    ),
    Broken(
        "typo-tensorboard-output_pth",
        {"tensorboard": {"enabled": True, "output_pth": "runs"}},
        "unknown-key",
        "tensorboard.output_pth",
        "did you mean 'output_path'",
    ),
    Broken(
        "typo-comms_logger-verbos",
        {"comms_logger": {"enabled": True, "verbos": True}},
        "unknown-key",
        "comms_logger.verbos",
        "did you mean 'verbose'",
    ),
    # keys DeepSpeed 0.19 removed (and refuses)
    Broken(
        "removed-sparse_gradients", {"sparse_gradients": True}, "removed-key", "sparse_gradients"
    ),
    Broken("removed-amp", {"amp": {"enabled": True}}, "removed-key", "amp"),
    Broken("removed-elasticity", {"elasticity": {"enabled": True}}, "removed-key", "elasticity"),
    Broken(
        "removed-curriculum_learning",
        {"curriculum_learning": {"enabled": False}},
        "removed-key",
        "curriculum_learning",
    ),
    Broken(
        "removed-zero-mics_shard_size",
        {"zero_optimization.mics_shard_size": 8},
        "unknown-key",
        "zero_optimization.mics_shard_size",
    ),
    # "auto" values (Hugging Face Trainer templates) at nested paths
    Broken("auto-lr", {"optimizer.params.lr": "auto"}, "auto-value", "optimizer.params.lr"),
    Broken(
        "auto-in-list",
        {"optimizer.params.betas": ["auto", 0.95]},
        "auto-value",
        "optimizer.params.betas[0]",
    ),
    Broken(
        "auto-zero-bucket",
        {"zero_optimization.reduce_bucket_size": "auto"},
        "auto-value",
        "zero_optimization.reduce_bucket_size",
    ),
    Broken(
        "auto-clipping",
        {"gradient_clipping": "auto"},
        "auto-value",
        "gradient_clipping",
        "the max gradient norm",
    ),
    Broken("auto-scheduler-type", {"scheduler.type": "Auto"}, "auto-value", "scheduler.type"),
    # wrong JSON types
    Broken(
        "grad-acc-2.5",
        {"gradient_accumulation_steps": 2.5},
        "type",
        "gradient_accumulation_steps",
        "whole JSON number",
    ),
    Broken(
        "clipping-string",
        {"gradient_clipping": "1.0"},
        "type",
        "gradient_clipping",
        "without quotes",
    ),
    Broken(
        "micro-string",
        {"train_micro_batch_size_per_gpu": "8"},
        "type",
        "train_micro_batch_size_per_gpu",
        "without quotes",
    ),
    Broken("bool-string", {"bf16.enabled": "true"}, "type", "bf16.enabled", "true or false"),
    Broken("stage-string", {"zero_optimization.stage": "2"}, "type", "zero_optimization.stage"),
    Broken(
        "zero-bucket-not-a-number",
        {"zero_optimization.reduce_bucket_size": "big"},
        "type",
        "zero_optimization.reduce_bucket_size",
    ),
    Broken(
        "zero-bucket-zero",
        {"zero_optimization.reduce_bucket_size": 0},
        "type",
        "zero_optimization.reduce_bucket_size",
    ),
    Broken(
        "communication_data_type-fp8",
        {"communication_data_type": "fp8"},
        "type",
        "communication_data_type",
        "fp16, bf16, fp32",
    ),
    Broken(
        "micro-zero",
        {"train_micro_batch_size_per_gpu": 0},
        "type",
        "train_micro_batch_size_per_gpu",
    ),
    # precision
    Broken(
        "fp16-and-bf16",
        {"fp16": FP16},
        "precision-conflict",
        "fp16.enabled",
        "enable one",
    ),
    Broken(
        "fp16-and-bfloat16-old-name",
        {"bf16": DROP, "bfloat16": {"enabled": True}, "fp16": FP16},
        "precision-conflict",
        "fp16.enabled",
    ),
    Broken(
        "loss_scale_window-0",
        {"bf16": DROP, "fp16": {**FP16, "loss_scale_window": 0}},
        "loss-scale",
        "fp16.loss_scale_window",
    ),
    Broken(
        "min_loss_scale-0",
        {"bf16": DROP, "fp16": {**FP16, "min_loss_scale": 0}},
        "loss-scale",
        "fp16.min_loss_scale",
    ),
    # the batch-size triangle: train_batch = micro x grad_acc x world size
    Broken(
        "triangle-all-three",
        {"train_batch_size": 128},
        "batch-triangle",
        "train_batch_size",
        "set train_batch_size to 256",
    ),
    Broken(
        "triangle-batch-micro-not-divisible",
        {"train_batch_size": 100, "gradient_accumulation_steps": DROP},
        "batch-triangle",
        "train_batch_size",
        "multiple of 32",
    ),
    Broken(
        "triangle-batch-grad_acc-not-divisible",
        {"train_batch_size": 100, "train_micro_batch_size_per_gpu": DROP},
        "batch-triangle",
        "train_batch_size",
        "multiple of 64",
    ),
    Broken(
        "triangle-batch-only-not-divisible",
        {
            "train_batch_size": 12,
            "train_micro_batch_size_per_gpu": DROP,
            "gradient_accumulation_steps": DROP,
        },
        "batch-triangle",
        "train_batch_size",
        "multiple of 8",
    ),
    Broken(
        "triangle-neither-batch-nor-micro",
        {"train_micro_batch_size_per_gpu": DROP},
        "batch-triangle",
        "train_batch_size",
        "train_micro_batch_size_per_gpu",
    ),
    Broken(
        "triangle-world-3",
        {"train_batch_size": 64},
        "batch-triangle",
        "train_batch_size",
        "96",
        world=3,
    ),
    # optimizer and scheduler
    Broken(
        "missing-scheduler", {"scheduler": DROP}, "missing-scheduler", "scheduler", "WarmupDecayLR"
    ),
    Broken("missing-optimizer", {"optimizer": DROP}, "missing-optimizer", "optimizer", "AdamW"),
    Broken(
        "scheduler-type-unknown",
        {"scheduler.type": "WarmupDecay"},
        "scheduler-type",
        "scheduler.type",
        "did you mean 'WarmupDecayLR'",
    ),
    Broken(
        "total-below-warmup",
        {"scheduler.params.total_num_steps": 100},
        "scheduler-params",
        "scheduler.params.total_num_steps",
    ),
    Broken(
        "warmup-string",
        {"scheduler.params.warmup_num_steps": "600"},
        "scheduler-params",
        "scheduler.params.warmup_num_steps",
    ),
    # ZeRO
    Broken(
        "zero0-fp32",
        {"bf16": DROP, "zero_optimization.stage": 0},
        "zero0-no-universal",
        "zero_optimization.stage",
    ),
    Broken(
        "zero0-fp16",
        {"bf16": DROP, "fp16": FP16, "zero_optimization.stage": 0},
        "zero0-no-universal",
        "zero_optimization.stage",
    ),
    Broken("zero-stage-4", {"zero_optimization.stage": 4}, "type", "zero_optimization.stage"),
    Broken(
        "offload_param-stage-2",
        {"zero_optimization.offload_param": {"device": "cpu"}},
        "offload-stage",
        "zero_optimization.offload_param.device",
        "raise zero_optimization.stage to 3",
    ),
    Broken(
        "offload_optimizer-stage-0",
        {"zero_optimization.stage": 0, "zero_optimization.offload_optimizer": {"device": "cpu"}},
        "offload-stage",
        "zero_optimization.offload_optimizer.device",
    ),
    Broken(
        "offload-device-gpu",
        {"zero_optimization.offload_optimizer": {"device": "gpu"}},
        "type",
        "zero_optimization.offload_optimizer.device",
    ),
    Broken(
        "nvme-without-path",
        {"zero_optimization.stage": 3, "zero_optimization.offload_param": {"device": "nvme"}},
        "offload-stage",
        "zero_optimization.offload_param.nvme_path",
        "nvme_path",
    ),
    # the field notes' rules
    Broken(
        "grad-acc-2-world-8-fp16",
        {"bf16": DROP, "fp16": FP16, "gradient_accumulation_steps": 2},
        "grad-acc-min",
        "gradient_accumulation_steps",
        ">= 4",
    ),
    Broken(
        "grad-acc-2-world-8-bf16-warns",
        {"gradient_accumulation_steps": 2},
        "grad-acc-min",
        "gradient_accumulation_steps",
        severity="warn",
    ),
    Broken(
        "stage16-warmup-400",
        {"scheduler.params.warmup_num_steps": 400},
        "stage16-warmup",
        "scheduler.params.warmup_num_steps",
        ">= 500",
        stage=16,
    ),
    # the "wonderland" section
    Broken(
        "wonderland-unknown-key",
        {"wonderland.sed": 1},
        "unknown-key",
        "wonderland.sed",
        "remove the key",
    ),
    Broken(
        "wonderland-negative-seed",
        {"wonderland.seed": -1},
        "wonderland-settings",
        "wonderland.seed",
    ),
    Broken(
        "wonderland-stage_train_steps-key",
        {"wonderland.stage_train_steps": {"sixteen": 10}},
        "wonderland-settings",
        "wonderland",
    ),
    Broken(
        "wonderland-stage_train_steps-zero",
        {"wonderland.stage_train_steps": {"16": 0}},
        "wonderland-settings",
        "wonderland",
    ),
    Broken(
        "wonderland-guards-check_interval-zero",
        {"wonderland.guards": {"check_interval": 0}},
        "wonderland-settings",
        "wonderland.guards.check_interval",
    ),
    Broken(
        "wonderland-guards-overlap_check-string",
        {"wonderland.guards": {"overlap_check": "maybe"}},
        "wonderland-settings",
        "wonderland.guards.overlap_check",
    ),
    Broken(
        "wonderland-async_save_copy-string",
        {"wonderland.async_save_copy": "sometimes"},
        "wonderland-settings",
        "wonderland.async_save_copy",
    ),
    Broken(
        "wonderland-disk_space_check-unknown",
        {"wonderland.disk_space_check": "ask"},
        "wonderland-settings",
        "wonderland.disk_space_check",
    ),
    Broken(
        "wonderland-preemption-stop_margin_s-zero",
        {"wonderland.preemption": {"stop_margin_s": 0}},
        "wonderland-settings",
        "wonderland.preemption.stop_margin_s",
    ),
    Broken(
        "wonderland-preemption-requeue-string",
        {"wonderland.preemption": {"requeue": "yes please"}},
        "wonderland-settings",
        "wonderland.preemption.requeue",
    ),
    Broken(
        "wonderland-preemption-end_time_poll_s-too-often",
        {"wonderland.preemption": {"end_time_poll_s": 0.1}},
        "wonderland-settings",
        "wonderland.preemption.end_time_poll_s",
    ),
    Broken(
        "wonderland-train_steps-string",
        {"wonderland.train_steps": "100"},
        "wonderland-settings",
        "wonderland.train_steps",
    ),
]


def test_corpus_is_large_and_ids_unique() -> None:
    assert len(BROKEN) >= 40
    assert len({c.id for c in BROKEN}) == len(BROKEN)


@pytest.mark.parametrize("stage", [None, 15, 16, 17])
def test_base_config_is_valid(tmp_path: Path, capsys: pytest.CaptureFixture[str], stage) -> None:
    argv = [str(write(tmp_path, BASE)), "--world-size", "8"]
    rc, findings = run_json(capsys, *argv, *(["--stage", str(stage)] if stage else []))
    assert rc == 0
    assert [f["severity"] for f in findings] == ["ok"]


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.id)
def test_broken_config(case: Broken, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, mutate(case.changes))
    argv = [str(path), "--world-size", str(case.world)]
    if case.stage:
        argv += ["--stage", str(case.stage)]
    rc, findings = run_json(capsys, *argv)

    hits = [f for f in findings if (f["rule"], f["path"]) == (case.rule, case.path)]
    assert len(hits) == 1, findings
    hit = hits[0]
    assert hit["severity"] == case.severity
    assert hit["file"] == str(path)
    assert hit["message"]
    assert hit["fix"], "every refusal says how to fix it"
    assert case.fix in hit["fix"]
    # Nothing else is wrong with the mutation: no unrelated or duplicate errors.
    errors = sorted((f["rule"], f["path"]) for f in findings if f["severity"] == "error")
    expected = sorted({(case.rule, case.path)} if case.severity == "error" else set())
    assert errors == sorted(expected + list(case.also))
    assert rc == (2 if errors else 0)


def test_stage16_warmup_only_applies_to_stage_16(tmp_path: Path) -> None:
    path = write(tmp_path, mutate({"scheduler.params.warmup_num_steps": 400}))
    for stages, refused in ((set(), False), ({15}, False), ({17}, False), ({16}, True)):
        found = ds_config.check_file(path, 8, stages)
        assert any(f.rule == "stage16-warmup" for f in found) is refused, stages


def test_stage16_warmup_uses_min_warmup_steps_setting(tmp_path: Path) -> None:
    cfg = mutate({"scheduler.params.warmup_num_steps": 400, "wonderland.min_warmup_steps": 300})
    assert not ds_config.check_file(write(tmp_path, cfg), 8, {16})


def test_grad_acc_rule_needs_a_large_world(tmp_path: Path) -> None:
    cfg = mutate({"bf16": DROP, "fp16": FP16, "gradient_accumulation_steps": 2})
    path = write(tmp_path, cfg)
    assert not [f for f in ds_config.check_file(path, 4) if f.severity == "error"]
    assert [f.rule for f in ds_config.check_file(path, 8)] == ["grad-acc-min"]


def test_all_errors_reported_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = mutate({"optimiser": {}, "scheduler": DROP, "fp16": FP16, "sparse_gradients": True})
    rc, findings = run_json(capsys, str(write(tmp_path, cfg)), "--world-size", "8")
    assert rc == 2
    assert {f["rule"] for f in findings} >= {
        "unknown-key",
        "missing-scheduler",
        "precision-conflict",
        "removed-key",
    }


def test_world_size_from_hostfile(tmp_path: Path, capsys: pytest.CaptureFixture[str], repo) -> None:
    cfg = write(tmp_path, mutate({"train_batch_size": 256}))
    rc, _ = run_json(capsys, str(cfg), "--hostfile", str(repo / "hostfiles" / "a100x8"))
    assert rc == 0
    rc, findings = run_json(capsys, str(cfg), "--hostfile", str(repo / "hostfiles" / "localhost"))
    assert rc == 2
    assert [f["rule"] for f in findings if f["severity"] == "error"] == ["batch-triangle"]
    assert "world size 2" in findings[-1]["message"]


def test_broken_hostfile_refuses_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("node-1 slots = 8\n")
    rc, findings = run_json(capsys, str(write(tmp_path, BASE)), "--hostfile", str(hostfile))
    assert rc == 2
    assert [(f["rule"], f["path"]) for f in findings if f["severity"] == "error"] == [
        ("hostfile", "line 1")
    ]


def test_one_bad_config_among_good_ones_refuses(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write(tmp_path, BASE, "good.json")
    bad = write(tmp_path, mutate({"amp": {}}), "bad.json")
    rc, findings = run_json(capsys, str(good), str(bad), "--world-size", "8")
    assert rc == 2
    assert {f["file"] for f in findings if f["severity"] == "error"} == {str(bad)}
    assert {f["file"] for f in findings if f["severity"] == "ok"} == {str(good)}


# ---------------------------------------------------------------- output formats


def test_json_output_shape(tmp_path: Path, capsys: pytest.CaptureFixture[str], repo) -> None:
    bad = write(tmp_path, mutate({"optimiser": {}, "gradient_clipping": "1"}), "bad.json")
    good = write(tmp_path, BASE, "good.json")
    hostfile = repo / "hostfiles" / "a100x8"
    rc = cli.main(["check", str(bad), str(good), "--hostfile", str(hostfile), "--json"])
    out = capsys.readouterr().out
    findings = json.loads(out)  # the whole of stdout is one JSON document
    assert rc == 2
    assert isinstance(findings, list) and len(findings) >= 4
    for f in findings:
        assert set(f) == FINDING_KEYS
        assert all(isinstance(v, str) for v in f.values())
        assert f["severity"] in {"ok", "info", "warn", "error"}
    assert {f["file"] for f in findings} == {str(bad), str(good), str(hostfile)}


def test_text_output_names_path_and_fix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path, mutate({"checkpoint.load_universl": True}))
    rc = cli.main(["check", str(path), "--world-size", "8"])
    out = capsys.readouterr().out
    assert rc == 2
    assert f"ERROR [unknown-key] {path}: checkpoint.load_universl:" in out
    assert "fix: did you mean 'load_universal'?" in out
    assert out.rstrip().endswith("refused: 1 config(s), 1 error(s), 0 warning(s)")


# ---------------------------------------------------------------- malformed input

MALFORMED: list[tuple[str, bytes, str]] = [
    ("broken-json", b'{\n  "train_micro_batch_size_per_gpu": 4,\n}\n', "line 3 column 1"),
    ("broken-json-line-2", b'{"a": 1,\n "b" 2}', "line 2 column"),
    ("empty", b"", "is empty"),
    ("whitespace-only", b"  \n\t\n ", "is empty"),
    ("top-level-array", b'[{"train_batch_size": 8}]', "JSON array, not an object"),
    ("top-level-string", b'"config"', "JSON string, not an object"),
    ("top-level-null", b"null", "JSON null, not an object"),
    ("duplicate-key", b'{"train_batch_size": 8, "train_batch_size": 16}', "duplicate key"),
    ("nested-duplicate-key", b'{"fp16": {"enabled": true, "enabled": false}}', "duplicate key"),
    ("nan", b'{"gradient_clipping": NaN}', "NaN is not valid JSON"),
    ("infinity", b'{"gradient_clipping": -Infinity}', "-Infinity is not valid JSON"),
    ("overflow", b'{"gradient_clipping": 1e400}', "infinity"),
    ("non-utf8", b'{"optimizer": "\xff\xfe"}', "UTF-8"),
    ("latin1", '{"wonderland": {"task": "caf\u00e9"}}'.encode("latin-1"), "UTF-8"),
    ("deeply-nested", b"[" * 100_000, "nested too deeply"),
    ("trailing-garbage", b'{"a": 1} {"b": 2}', "Extra data"),
]


@pytest.mark.parametrize(("name", "content", "needle"), MALFORMED, ids=[m[0] for m in MALFORMED])
def test_malformed_file(
    name: str, content: bytes, needle: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / f"{name}.json"
    path.write_bytes(content)
    rc = cli.main(["check", str(path), "--world-size", "2"])
    out = capsys.readouterr()
    assert rc == 2
    assert "Traceback" not in out.out + out.err
    assert needle in out.out
    assert "[config-unreadable]" in out.out
    assert "fix:" in out.out


def test_missing_file_and_directory(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope.json"
    rc, findings = run_json(capsys, str(missing), str(tmp_path))
    assert rc == 2
    assert [(f["file"], f["rule"]) for f in findings] == [
        (str(missing), "config-unreadable"),
        (str(tmp_path), "config-unreadable"),
    ]
    assert "does not exist" in findings[0]["message"]
    assert "directory" in findings[1]["message"]


def test_cli_process_exits_2_without_traceback(tmp_path: Path) -> None:
    broken = tmp_path / "broken.json"
    broken.write_bytes(b'{"train_batch_size": 8,,}')
    deep = tmp_path / "deep.json"
    deep.write_bytes(b"[" * 100_000)
    proc = subprocess.run(
        [sys.executable, "-m", "wonderland_ds.cli.main", "check", str(broken), str(deep)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert "line 1 column" in proc.stdout
    assert "nested too deeply" in proc.stdout


def test_check_does_not_import_torch(tmp_path: Path) -> None:
    """`check` must answer in well under a second (cli.py): no torch, no deepspeed."""
    code = (
        "import sys; from wonderland_ds.cli import main as cli; rc = cli.main(['check', sys.argv[1]]); "
        "heavy = sorted(m for m in ('torch', 'deepspeed') if m in sys.modules); "
        "print('HEAVY', heavy); sys.exit(rc)"
    )
    cfg = write(tmp_path, BASE)
    proc = subprocess.run(
        [sys.executable, "-c", code, str(cfg)], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "HEAVY []" in proc.stdout


def test_argument_errors_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = str(write(tmp_path, BASE))
    for argv in (["--world-size", "0"], ["--world-size", "two"], ["--stage", "19"], []):
        with pytest.raises(SystemExit) as exc:
            cli.main(["check", cfg, *argv] if argv else ["check"])
        assert exc.value.code == 2
    assert "Traceback" not in capsys.readouterr().err
