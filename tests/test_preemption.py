"""A stage stopped by a real signal, without Slurm: it stops at a step every rank agrees on,
saves a verified checkpoint there, exits 4, reads ``preempted`` in ``status``, and continues
with ``--resume auto`` exactly as an uninterrupted run goes on."""

from __future__ import annotations

import csv
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY32
from tests.helpers.util import REPO, losses, wonderland
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.run import liveness

STEPS = 300


def _config(tmp: Path, **wonderland_fields) -> str:
    cfg = json.loads(Path(TINY32).read_text())
    cfg["wonderland"].update({"save_interval": 1000, "log_interval": 1000, **wonderland_fields})
    path = tmp / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _start(config: str, run: Path, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "wonderland_ds.cli.main", "train", "--stage", "15", "--config",
         config, "--run-dir", str(run), "--steps", str(STEPS), *extra],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip


def _until_step(proc: subprocess.Popen, run: Path, step: int) -> int:
    deadline = time.time() + 240
    while time.time() < deadline:
        beats = liveness.heartbeats(run / "stage15")
        reached = max((b.get("step") or 0 for b in beats), default=0)
        if reached >= step:
            return reached
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"stage 15 did not reach step {step}: {proc.communicate()[0][-3000:]}")


def _rows(stage_dir: Path) -> list[dict[str, str]]:
    with open(stage_dir / "metrics.csv", newline="") as fh:
        return list(csv.DictReader(fh))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("uninterrupted")
    config = _config(tmp)
    result = wonderland(
        "train", "--stage", "15", "--config", config, "--run-dir", str(tmp / "run"),
        "--steps", str(STEPS),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    return losses(tmp / "run" / "stage15")


@pytest.mark.slow
def test_sigterm_to_the_job_saves_at_the_next_step_and_resumes_exactly(uninterrupted, tmp_path):
    config, run = _config(tmp_path), tmp_path / "run"
    proc = _start(config, run)
    seen = _until_step(proc, run, 100)
    # No save yet (save_interval 1000), and metrics.csv grows as the stage runs.
    deadline = time.time() + 10
    while len(_rows(run / "stage15")) < 50 and time.time() < deadline:
        time.sleep(0.2)
    assert len(_rows(run / "stage15")) >= 50 and not ck.tags(run / "stage15" / "checkpoints")
    seen = max(seen, int(_rows(run / "stage15")[-1]["step"]))
    os.killpg(proc.pid, signal.SIGTERM)  # every process: the front, the launcher, each rank
    signalled = time.time()
    out = proc.communicate(timeout=120)[0]
    took = time.time() - signalled
    assert proc.returncode == 4, out[-3000:]
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    stop = entry["stop"]
    assert entry["status"] == "preempted" and stop["saved"] and stop["signal"] == "SIGTERM"
    step = stop["step"]
    assert seen <= step < STEPS
    # Every rank trained at most the step under way and one more after the signal.
    rows = _rows(run / "stage15")
    assert [int(r["step"]) for r in rows] == list(range(1, step + 1))  # every row, written
    assert sum(float(r["wall"]) > signalled for r in rows) <= 2
    tag = run / "stage15" / "checkpoints" / f"global_step{step}"
    assert ck.read_latest(run / "stage15" / "checkpoints") == tag.name
    assert ck.verify(tag, deep=True).complete and stop["checkpoint"] == str(tag)
    assert took < 30, f"signal to exit took {took:.1f} s"
    assert "stopped on SIGTERM" in out and "resumable" in out
    status = json.loads(wonderland("status", str(run), "--json").stdout)["stages"]["15"]
    assert status["state"] == "preempted" and status["step"] == step and "status" not in status
    assert "--resume auto" in status["next"]
    text = wonderland("status", "--run-dir", str(run)).stdout
    assert f"preempted at step {step} on SIGTERM" in text and "continue with:" in text
    # The same command again, with --resume auto: it ends where it was going to end, and every
    # step's loss is the uninterrupted run's.
    again = wonderland(
        "train", "--stage", "15", "--config", config, "--run-dir", str(run), "--resume", "auto"
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed {tag}" in again.stdout
    assert losses(run / "stage15") == uninterrupted


@pytest.mark.slow
@pytest.mark.nightly
def test_a_signal_to_the_front_alone_reaches_the_ranks(tmp_path):
    config, run = _config(tmp_path), tmp_path / "run"
    proc = _start(config, run)
    _until_step(proc, run, 60)
    proc.send_signal(signal.SIGUSR1)  # only the front (Slurm's B:USR1 to the batch shell)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 4, out[-3000:]
    stop = json.loads((run / "run.json").read_text())["stages"]["15"]["stop"]
    assert stop["reason"] == "front" and stop["signal"] == "SIGUSR1" and stop["saved"]
    assert ck.read_latest(run / "stage15" / "checkpoints") == f"global_step{stop['step']}"


@pytest.mark.slow
@pytest.mark.proofs
def test_sigkill_during_the_stop_save_leaves_the_previous_checkpoint(tmp_path):
    config, run = _config(tmp_path, save_interval=50), tmp_path / "run"
    # From step 51 on, rank 0's saves wait 10 s before their metadata: the stop's save is slow.
    proc = _start(config, run, "--fault", "slow@save-before-meta:step=51:factor=10")
    _until_step(proc, run, 60)
    os.killpg(proc.pid, signal.SIGTERM)
    fired = False
    deadline = time.time() + 60
    lines = []
    assert proc.stdout is not None
    while time.time() < deadline and not fired:
        line = proc.stdout.readline()
        lines.append(line)
        fired = "FAULT INJECTED: slow at save-before-meta" in line
    assert fired, "".join(lines)[-3000:]
    os.killpg(proc.pid, signal.SIGKILL)  # Slurm's KillWait is over, mid-save
    proc.wait()
    root = run / "stage15" / "checkpoints"
    assert ck.read_latest(root) == "global_step50"
    newest = ck.newest_complete(root, deep=True)
    assert newest is not None and newest.tag_dir.name == "global_step50"
    partial = [p for _, p in ck.tags(root) if ck.read_meta(p) is None]
    assert partial and partial[0].name != "global_step50"  # the stop's, never completed
    status = json.loads(wonderland("status", str(run), "--json").stdout)["stages"]["15"]
    assert status["state"] == "interrupted" and status["step"] >= 60
    assert status["latest_complete_checkpoint"].endswith("global_step50")
    again = wonderland(
        "train", "--stage", "15", "--config", config, "--run-dir", str(run), "--resume",
        "auto", "--steps", "70",
    )  # fmt: skip
    assert again.returncode == 0, again.stderr[-3000:]
    assert "global_step50" in again.stdout
