"""A full disk, for real: the checkpoint folder on a tmpfs that fills. The save that would not
fit is refused before it starts, or fails in the kernel (ENOSPC) and is removed; every rank
stops with one line, exit 5, `latest` still names the last complete checkpoint, status says
`disk full at <folder>`, and `--resume auto` continues once there is room."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import TINY32
from tests.helpers.util import losses, wonderland
from wonderland_ds.checkpoint import contract as ck


def _mount(where: Path, size: str) -> None:
    where.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(where)], check=True)


@pytest.fixture
def tmpfs(tmp_path):
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    where = tmp_path / "tmpfs"
    try:
        _mount(where, "1m")
    except (OSError, subprocess.CalledProcessError) as exc:
        pytest.skip(f"cannot mount a tmpfs here: {exc}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


def _run_on(tmpfs: Path, tmp_path: Path, check: str) -> tuple[Path, str]:
    cfg = json.loads(Path(TINY32).read_text())
    cfg["wonderland"].update({"save_interval": 10, "keep_last": 10, "disk_space_check": check})
    config = tmp_path / "config.json"
    config.write_text(json.dumps(cfg))
    run = tmp_path / "run"
    (run / "stage15").mkdir(parents=True)
    (run / "stage15" / "checkpoints").symlink_to(tmpfs)  # checkpoints on the small disk
    return run, str(config)


@pytest.mark.slow
def test_a_write_that_fails_on_a_full_disk_is_removed_and_the_stage_resumes(tmpfs, tmp_path):
    run, config = _run_on(tmpfs, tmp_path, "off")  # no check first: the kernel refuses a write
    result = wonderland("train", "--stage", "15", "--config", config, "--run-dir", str(run))
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-3000:]
    assert (
        f"the disk is full at {run / 'stage15' / 'checkpoints'}" in out and "Traceback" not in out
    )
    root = run / "stage15" / "checkpoints"
    newest = ck.newest_complete(root, deep=True)
    assert newest is not None and ck.read_latest(root) == newest.tag_dir.name
    assert [p.name for _, p in ck.tags(root)] == [
        f"global_step{s}" for s in range(10, 10 * len(ck.tags(root)) + 1, 10)
    ]
    assert all(ck.read_meta(p) is not None for _, p in ck.tags(root))  # the partial is gone
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert entry["status"] == "disk-full" and str(root) in entry["error"]
    status = wonderland("status", str(run)).stdout
    assert "disk-full at step" in status and f"the disk is full at {root}" in status
    assert f"checkpoint {newest.tag_dir.name}" in status and "once there is room" in status
    subprocess.run(["mount", "-o", "remount,size=16m", str(tmpfs)], check=True)  # room again
    again = wonderland(
        "train", "--stage", "15", "--config", config, "--run-dir", str(run), "--resume", "auto"
    )
    assert again.returncode == 0, (again.stdout + again.stderr)[-3000:]
    assert f"resumed {newest.tag_dir}" in again.stdout and max(losses(run / "stage15")) == 40


@pytest.mark.slow
def test_one_rank_refused_a_write_stops_every_rank_at_once_with_its_cause(tmp_path):
    """Only rank 1's writes fail (RLIMIT_FSIZE, a real EFBIG): rank 0's shards fit, and its wait
    for rank 1's marker ends at once on rank 1's failure marker, not at the time limit; the
    stop names rank 1's write as the cause (exit 5), not rank 0's wait."""
    run = tmp_path / "run"
    t0 = time.monotonic()
    result = wonderland(
        "train", "--stage", "15", "--config", TINY32, "--run-dir", str(run),
        "--steps", "30", "--fault", "diskfull@save:step=20:rank=1",
    )  # fmt: skip
    elapsed = time.monotonic() - t0
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-3000:]
    assert "FAULT INJECTED: diskfull at save step 20" in out  # the fault really happened
    assert "refused a write (a file-size limit" in out and "Traceback" not in out
    assert "(rank 1: OSError" in out and "did not finish" not in out  # the cause, not the echo
    assert elapsed < 60, f"rank 0 waited for the time limit: {elapsed:.0f} s"
    root = run / "stage15" / "checkpoints"
    assert [p.name for _, p in ck.tags(root)] == ["global_step10"]  # the partial is gone
    assert ck.read_latest(root) == "global_step10"


@pytest.mark.slow
def test_a_save_that_would_not_fit_is_not_started(tmpfs, tmp_path):
    run, config = _run_on(tmpfs, tmp_path, "stop")
    result = wonderland("train", "--stage", "15", "--config", config, "--run-dir", str(run))
    out = result.stdout + result.stderr
    assert result.returncode == 5, out[-3000:]
    assert "nearly full" in out  # the warning ahead: one more save fits
    root = run / "stage15" / "checkpoints"
    assert all(ck.read_meta(p) is not None for _, p in ck.tags(root))  # nothing half-written
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert entry["status"] == "disk-full" and "the save would not fit" in entry["error"]
    assert "MB free, a checkpoint takes" in entry["error"]


def test_the_metrics_writer_on_a_full_disk_stops_the_stage(tmpfs, tmp_path):
    from wonderland_ds.core.signals import StopSignals
    from wonderland_ds.training.callbacks import MetricsRows
    from wonderland_ds.training.rows import StepRow

    stage = tmpfs / "stage15"
    stage.mkdir()
    with open(tmpfs / "ballast", "wb") as fh:  # fill the disk, for real
        try:
            while True:
                fh.write(b"\0" * 65536)
        except OSError as exc:
            assert exc.errno == errno.ENOSPC
    run = type("Run", (), {})()
    run.stage_dir, run.signals = stage, StopSignals()
    rows = MetricsRows.__new__(MetricsRows)
    rows.run, rows.main, rows.rows, rows.flushed = run, True, [StepRow(1, 0.5)], time.monotonic()
    rows.sources = []
    rows.flush()
    assert run.signals.first is not None and run.signals.first.reason == "disk-full"
    assert "writing metrics.csv failed" in run.signals.first.detail and rows.rows  # kept
