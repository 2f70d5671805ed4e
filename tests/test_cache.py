"""The dataset cache (`wonderland cache`): written once, verified, refused when damaged."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from wonderland_ds.cli import main as cli
from wonderland_ds.core.findings import Refused
from wonderland_ds.data import builtin, cache, tasks


@pytest.fixture(scope="module")
def digits_task():
    return builtin.digits().materialize()


@pytest.fixture
def built(tmp_path, digits_task) -> Path:
    out = tmp_path / "cache"
    cache.write(digits_task, out)
    return out


def test_write_then_open_round_trips_memory_mapped(built, digits_task):
    opened = cache.open_task(builtin.digits(), built)
    assert isinstance(opened.train.x, np.memmap)
    assert np.array_equal(opened.train.x, digits_task.train.x)
    assert np.array_equal(opened.heldout.y, digits_task.heldout.y)
    assert opened.fingerprint == digits_task.fingerprint
    index = json.loads((built / "index.json").read_text())
    assert index["rows"] == {"train": 1116, "heldout": 367}
    assert all(len(s["x"]["sha256"]) == 64 for s in index["splits"]["train"])


def test_writing_the_same_dataset_again_is_a_no_op(built, digits_task):
    before = {p: p.stat().st_mtime_ns for p in built.rglob("*")}
    _, found = cache.write(digits_task, built)
    assert "nothing to do" in found[0].message
    assert {p: p.stat().st_mtime_ns for p in built.rglob("*")} == before


def test_a_different_dataset_is_refused_not_overwritten(built):
    other = builtin.digits(minority=(1,)).materialize()
    with pytest.raises(Refused, match="already holds a different dataset"):
        cache.write(other, built)


def test_half_written_cache_is_never_complete(built, tmp_path, digits_task):
    (built / "index.json").unlink()  # what a crash before the last write leaves
    index, found = cache.verify(built)
    assert index is None and "incomplete" in found[0].message
    with pytest.raises(Refused, match="not a complete wonderland cache"):
        cache.write(digits_task, built)


@pytest.mark.parametrize("damage", ["flip", "truncate", "missing"])
def test_damaged_shard_is_refused_naming_it(built, damage):
    shard = built / "train" / "x_00000.npy"
    if damage == "flip":
        data = bytearray(shard.read_bytes())
        data[-7] ^= 0x10
        shard.write_bytes(bytes(data))
    elif damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:-64])
    else:
        shard.unlink()
    with pytest.raises(Refused) as exc:
        cache.open_task(builtin.digits(), built)
    (finding,) = exc.value.findings
    assert finding.rule == "cache-shard" and finding.file == str(shard)
    assert {"flip": "sha256", "truncate": "truncated", "missing": "missing"}[damage] in (
        finding.message
    )


def test_training_refuses_a_corrupt_cache(built, tmp_path, capsys, repo):
    data = bytearray((built / "train" / "y_00000.npy").read_bytes())
    data[-1] ^= 1
    (built / "train" / "y_00000.npy").write_bytes(bytes(data))
    cfg = json.loads((repo / "tests" / "configs" / "tiny_zero2_fp32.json").read_text())
    cfg["wonderland"]["cache"] = str(built)
    path = tmp_path / "cfg.json"
    path.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    rc = cli.main(["train", "--stage", "15", "--config", str(path), "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and "y_00000.npy fails its sha256 check" in err
    assert not run.exists()  # nothing trained on bad data, nothing written


def test_cache_cli_exit_codes(tmp_path, capsys):
    out = tmp_path / "c"
    assert cli.main(["cache", "digits", "--out", str(out), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rows"]["train"] == 1116 and report["shards"] == 2
    assert cli.main(["cache", "not-a-task", "--out", str(tmp_path / "d")]) == 2
    assert not (tmp_path / "d").exists()


def test_pylm_task_from_the_standard_library(tmp_path):
    task = builtin.pylm().materialize()
    assert task.train.x.shape[1] == 128 and task.train.x.dtype == np.int64
    assert np.array_equal(task.train.x[:, 1:], task.train.y[:, :-1])  # next-byte targets
    assert len(task.meta["heldout_sources"]) == len(task.heldout)
    opened = cache.open_task(builtin.pylm(), cache.write(task, tmp_path / "lm") and tmp_path / "lm")
    assert opened.meta["heldout_sources"][:3] == task.meta["heldout_sources"][:3]


def test_pylm_source_key_covers_every_file_the_data_is_read_from(monkeypatch):
    read: list[Path] = []
    real = Path.read_bytes
    monkeypatch.setattr(Path, "read_bytes", lambda self: read.append(self) or real(self))
    builtin._pylm_splits({})
    assert read == builtin._pylm_used_files() and len(read) > 50


def test_a_matching_source_key_proves_the_cache_fresh_without_rebuilding(tmp_path, monkeypatch):
    """The front's stale-cache check: equal source keys skip rebuilding the data; a changed key
    rebuilds and compares fingerprints (same data: fine; other data: refused)."""
    from wonderland_ds.config.settings import WonderlandSettings
    from wonderland_ds.launch import stage
    from wonderland_ds.launch.plan import StageOptions

    base = builtin.digits().materialize()
    state = {"key": "v1", "builds": 0, "flip": False}

    def splits():
        state["builds"] += 1
        if state["flip"]:
            return tasks.Split(base.train.x[::-1].copy(), base.train.y), base.heldout
        return base.train, base.heldout

    def factory() -> tasks.Task:
        return tasks.Task(
            name="counting",
            num_classes=10,
            build_model=lambda: None,
            make_splits=tasks.Source(splits, lambda: state["key"]),
        )

    monkeypatch.setitem(builtin.BUILTIN, "counting", factory)
    monkeypatch.setattr(stage, "_FRESH_CACHES", set())
    args = StageOptions(stage=15, config="c.json", run_dir=str(tmp_path / "run"), task="counting")
    settings = WonderlandSettings()
    cache_dir = tmp_path / "run" / "cache" / "counting"
    cache.write(factory().materialize(), cache_dir)
    assert json.loads((cache_dir / "index.json").read_text())["source_key"] == "v1"
    state["builds"] = 0

    stage._task_data(args, settings, tmp_path / "run", check_stale=True)
    assert state["builds"] == 0  # same key: nothing rebuilt
    stage._FRESH_CACHES.clear()
    state["key"] = "v2"  # e.g. a source file touched: rebuilt and compared, same data
    stage._task_data(args, settings, tmp_path / "run", check_stale=True)
    assert state["builds"] == 1
    stage._FRESH_CACHES.clear()
    state["flip"] = True  # the source now makes other data: refused, as before
    with pytest.raises(Refused) as exc:
        stage._task_data(args, settings, tmp_path / "run", check_stale=True)
    assert exc.value.findings[0].rule == "cache-stale" and state["builds"] == 2


def test_a_task_that_replaces_a_builtin_source_loses_its_key():
    import dataclasses

    task = builtin.digits()
    assert task.source_key is not None
    mine = dataclasses.replace(task, make_splits=lambda: task.make_splits())
    assert mine.source_key is None  # its data is checked the full way
