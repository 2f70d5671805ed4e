"""The stage plan: decided once by the front process, written with its receipt, and taken by
rank 0 through the same model instead of deciding again."""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import TINY32
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.cli.train import build_train_parser
from wonderland_ds.core.findings import Refused
from wonderland_ds.launch import plan as plan_mod
from wonderland_ds.launch import stage
from wonderland_ds.launch.plan import StageOptions
from wonderland_ds.run import preflight


def _args(*argv: str) -> argparse.Namespace:
    return build_train_parser().parse_args(list(argv))


def _no_second_preflight(monkeypatch) -> None:
    def refuse(*a, **k):
        raise AssertionError("rank 0 ran the preflight again")

    monkeypatch.setattr(preflight, "check", refuse)


def test_options_give_back_the_flags_they_came_from(tmp_path):
    args = _args(
        *("--stage", "16", "--config", TINY32, "--resume", "auto", "--steps", "7"),
        *("--seed", "3", "--task", "digits", "--optimizer-state", "--trust-checkpoint"),
        *("--out", str(tmp_path / "rel" / ".." / "out")),
    )
    opts = StageOptions.from_args(args, tmp_path)
    assert opts.out == str((tmp_path / "out").resolve()) and opts.resume == "auto"
    again = StageOptions.from_args(_args(*opts.argv()), tmp_path)
    assert again == opts  # what the ranks parse is what the front decided


def test_rank0_takes_the_fronts_plan_without_deciding_again(tmp_path, monkeypatch):
    run = tmp_path / "run"
    args = _args("--stage", "15", "--config", TINY32, "--run-dir", str(run), "--steps", "4")
    decided, task = stage.plan_stage(StageOptions.from_args(args, run.resolve()), 2, run)
    path = run / ".verified-stage15.json"
    plan_mod.write(path, decided, stage.receipt())
    assert json.loads(path.read_text())["format"] == plan_mod.FORMAT

    _no_second_preflight(monkeypatch)
    monkeypatch.setattr(stage, "_FRESH_CACHES", set())  # as in a rank's own process
    rank_args = _args(*decided.options.argv(), "--verified", str(path))
    got = stage.from_front(
        rank_args.verified, StageOptions.from_args(rank_args, run.resolve()), 2, run
    )
    assert got is not None
    plan, rank_task = got
    assert plan.model_dump(exclude={"receipt"}) == decided.model_dump(exclude={"receipt"})
    assert plan.receipt.fresh_caches  # what the front verified came along
    assert plan.settings == decided.settings and plan.cfg == decided.cfg
    assert rank_task.fingerprint == task.fingerprint
    assert plan.inputs(rank_task).ds_dict == decided.ds_dict

    # Another world, other options, or another format: rank 0 decides itself.
    assert (
        stage.from_front(str(path), StageOptions.from_args(rank_args, run.resolve()), 3, run)
        is None
    )
    other = _args(*decided.options.argv(), "--steps", "5")
    assert stage.from_front(str(path), StageOptions.from_args(other, run.resolve()), 2, run) is None
    body = json.loads(path.read_text()) | {"format": plan_mod.FORMAT + 1}
    path.write_text(json.dumps(body))
    assert (
        stage.from_front(str(path), StageOptions.from_args(rank_args, run.resolve()), 2, run)
        is None
    )
    path.write_text("{not json")
    assert (
        stage.from_front(str(path), StageOptions.from_args(rank_args, run.resolve()), 2, run)
        is None
    )
    assert stage.from_front(None, StageOptions.from_args(rank_args, run.resolve()), 2, run) is None


@pytest.mark.slow
def test_a_checkpoint_changed_after_the_fronts_preflight_is_refused_on_rank0(
    stage15_fp32, tmp_path, monkeypatch
):
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    argv = ["--stage", "16", "--config", TINY32, "--run-dir", str(run), "--resume", "auto"]
    args = _args(*argv, "--optimizer-state", "--scheduler-state", "--min-warmup-steps", "10")
    decided, _ = stage.plan_stage(StageOptions.from_args(args, run.resolve()), 2, run)
    source = decided.preflight.source
    assert source is not None and decided.preflight.source_info["global_step"] == 40
    path = run / ".verified-stage16.json"
    plan_mod.write(path, decided, stage.receipt())

    _no_second_preflight(monkeypatch)
    rank_args = _args(*decided.options.argv())
    got = stage.from_front(str(path), StageOptions.from_args(rank_args, run.resolve()), 2, run)
    assert got is not None and got[0].preflight.source == source
    assert got[0].preflight.source_info == decided.preflight.source_info

    shard = next(p for p in sorted(source.iterdir()) if p.name.endswith("optim_states.pt"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))  # damaged between the front's preflight and rank 0
    assert not ck.verify(source).complete
    with pytest.raises(Refused):
        stage.from_front(str(path), StageOptions.from_args(rank_args, run.resolve()), 2, run)


def test_the_plan_file_is_written_whole(tmp_path):
    run = tmp_path / "run"
    args = _args("--stage", "15", "--config", TINY32, "--run-dir", str(run))
    decided, _ = stage.plan_stage(StageOptions.from_args(args, run.resolve()), 1, run)
    path = Path(run / ".verified-stage15.json")
    plan_mod.write(path, decided, stage.receipt())
    assert plan_mod.read(str(path)) is not None
    assert not [p for p in run.iterdir() if p.name.endswith(".tmp")]
