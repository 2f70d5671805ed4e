"""`wonderland inspect`: our checkpoints, plain DeepSpeed ones, damaged and untrusted ones."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from wonderland_ds.cli import main as cli

pytestmark = pytest.mark.slow


def inspect_json(capsys, path) -> tuple[int, dict]:
    rc = cli.main(["inspect", str(path), "--json"])
    return rc, json.loads(capsys.readouterr().out)


def rules(report: dict, severity: str | None = None) -> set[str]:
    return {f["rule"] for f in report["findings"] if severity in (None, f["severity"])}


def test_inspect_our_checkpoint(capsys, stage15_fp32):
    rc, report = inspect_json(capsys, stage15_fp32 / "stage15" / "checkpoints")
    info = report["checkpoint"]
    assert rc == 0 and info["written_by"] == "wonderland" and info["complete"] is True
    assert info["global_step"] == 40 and info["warmup_progress"] == 40
    assert info["has_optimizer_state"] and info["has_scheduler_state"]
    assert info["data"]["seed"] == 7 and info["world_size"] == 2
    assert rules(report, "error") == set()


def test_inspect_plain_deepspeed_checkpoint_names_what_is_missing(capsys, plain_ds_checkpoints):
    rc, report = inspect_json(capsys, plain_ds_checkpoints["plain"])
    info = report["checkpoint"]
    assert rc == 0, report
    assert info["written_by"] == "unknown" and info["global_step"] == 3
    assert info["has_optimizer_state"] and info["has_scheduler_state"]
    assert {"ckpt-metadata", "ckpt-universal-info", "ckpt-missing-field"} <= rules(report, "warn")
    messages = " ".join(f["message"] for f in report["findings"])
    assert "data-loader state" in messages and "RNG states" in messages


def test_inspect_plain_checkpoint_without_scheduler(capsys, plain_ds_checkpoints):
    rc, report = inspect_json(capsys, plain_ds_checkpoints["no_scheduler"])
    assert rc == 2 and "ckpt-scheduler-state" in rules(report, "error")


def test_inspect_flipped_byte(capsys, stage15_fp32, tmp_path):
    dest = tmp_path / "global_step40"
    shutil.copytree(stage15_fp32 / "stage15" / "checkpoints" / "global_step40", dest)
    shard = dest / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    data = bytearray(shard.read_bytes())
    data[100] ^= 1
    shard.write_bytes(bytes(data))
    rc, report = inspect_json(capsys, dest)
    assert rc == 2
    bad = [f for f in report["findings"] if f["rule"] == "ckpt-checksum"]
    assert bad and bad[0]["path"] == "zero_pp_rank_0_mp_rank_00_optim_states.pt"


class _Payload:
    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_inspect_never_runs_a_pickle_payload(capsys, tmp_path):
    marker = tmp_path / "PWNED"
    ckpt = tmp_path / "global_step1"
    ckpt.mkdir()
    torch.save(
        {"module": {}, "payload": _Payload(str(marker))}, ckpt / "mp_rank_00_model_states.pt"
    )
    assert not marker.exists()
    rc, report = inspect_json(capsys, ckpt)
    assert rc == 2 and "ckpt-untrusted" in rules(report, "error")
    assert not marker.exists()  # the payload did not run
