"""Stages under a real Slurm: a cluster of two nodes in network namespaces
(tests/slurm/cluster.sh: Debian's slurmctld, slurmd and munge), jobs submitted with sbatch.

Root only; deselected by default (about 8 minutes). Run it with:

    .venv/bin/pytest -m slurm -v

What is shown: a 2-node sbatch of stage 16 with a rank on each node started through srun;
``scontrol requeue`` mid-stage and the requeued run continuing to per-step losses equal to an
uninterrupted job's; ``scancel`` mid-stage (saved, not requeued); Slurm's warning signal
(``--signal=B:USR1@...``) saving and requeueing; the job's time limit met without a warning
signal; the per-rank entry under a plain ``srun``.
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import TINY32
from tests.helpers.slurm import SlurmCluster, cluster_of
from tests.helpers.util import REPO, losses
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.run import liveness

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
BIN = Path(sys.executable).parent
STEPS = 400


@pytest.fixture(scope="module")
def slurm():
    yield from cluster_of(2)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    cfg = json.loads(Path(TINY32).read_text())
    cfg["wonderland"].update({"save_interval": 100, "log_interval": 50, "keep_last": 3})
    path = tmp_path_factory.mktemp("slurm_config") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _stage16_script(config: str, run: Path, steps: int, *extra: str) -> str:
    flags = ["--config", config, "--run-dir", str(run), "--resume", "auto"]
    flags += ["--optimizer-state", "--scheduler-state", "--steps", str(steps), *extra]
    return (
        'echo "run ${SLURM_RESTART_COUNT:-0} on $(hostname)"\n'
        f"cd {shlex.quote(str(REPO))}\n"
        f"exec {BIN / 'wonderland'} train --stage 16 {shlex.join(flags)}\n"
    )


def _copy_stage15(stage15_fp32: Path, run: Path) -> Path:
    shutil.copytree(stage15_fp32, run)
    shutil.rmtree(run / "stage16", ignore_errors=True)
    return run


def _until_step(run: Path, step: int, timeout: float = 240, since: float = 0.0) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        beats = [b for b in liveness.heartbeats(run / "stage16") if b.get("time", 0) >= since]
        reached = max((b.get("step") or 0 for b in beats), default=0)
        if reached >= step:
            return reached
        time.sleep(0.2)
    pytest.fail(f"stage 16 did not reach step {step}")


def _entry(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())["stages"]["16"]


def _job(slurm: SlurmCluster, script: str, out: Path, *args: str) -> int:
    return slurm.sbatch(
        script, "--nodes=2", "--ntasks-per-node=1", f"--output={out}", "--open-mode=append", *args
    )


@pytest.fixture(scope="module")
def uninterrupted(slurm, stage15_fp32, config, tmp_path_factory) -> dict[int, float]:
    tmp = tmp_path_factory.mktemp("slurm_reference")
    run = _copy_stage15(stage15_fp32, tmp / "run")
    job = _job(slurm, _stage16_script(config, run, STEPS), tmp / "out")
    info = slurm.wait_state(job, "COMPLETED", timeout=300)
    assert info["JobState"] == "COMPLETED", (tmp / "out").read_text()[-3000:]
    ranks = json.loads((run / "stage16" / "ranks.json").read_text())
    assert sorted(r["host"] for r in ranks) == ["wls-node0", "wls-node1"]  # a rank on each node
    entry = _entry(run)
    assert entry["status"] == "ok" and entry["world_size"] == 2
    (alloc,) = entry["allocations"]
    assert alloc["job_id"] == str(job) and alloc["restart_count"] == 0 and alloc["outcome"] == "ok"
    return losses(run / "stage16")


def test_requeue_mid_stage_continues_to_the_uninterrupted_losses(
    slurm, stage15_fp32, config, uninterrupted, tmp_path
):
    run = _copy_stage15(stage15_fp32, tmp_path / "run")
    out = tmp_path / "out"
    job = _job(slurm, _stage16_script(config, run, STEPS), out, "--requeue")
    seen = _until_step(run, 150)
    slurm.requeue(job)  # SIGTERM to every process of the job, then it runs again
    info = slurm.wait_state(job, "COMPLETED", timeout=400)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED" and info["RestartCnt"] == "1", log[-3000:]
    assert "run 0 on wls-node0" in log and "run 1 on wls-node0" in log
    entry = _entry(run)
    assert entry["status"] == "ok" and entry["global_step"] == 40 + STEPS
    first, second = entry["allocations"]
    assert first["outcome"] == "preempted" and first["restart_count"] == 0
    assert first["last_step"] >= seen - 1  # nothing lost: the stop saved the step it reached
    assert second["restart_count"] == 1 and second["first_step"] == first["last_step"]
    assert second["outcome"] == "ok" and second["last_step"] == 40 + STEPS
    assert f"resumed {run}/stage16/checkpoints/global_step{first['last_step']}" in log
    assert losses(run / "stage16") == uninterrupted


def test_scancel_saves_and_is_not_requeued(slurm, stage15_fp32, config, tmp_path):
    run = _copy_stage15(stage15_fp32, tmp_path / "run")
    out = tmp_path / "out"
    job = _job(slurm, _stage16_script(config, run, 100_000, "--requeue"), out, "--requeue")
    seen = _until_step(run, 80)
    slurm.scancel(job)
    info = slurm.wait_state(job, "CANCELLED", timeout=120)
    assert info["RestartCnt"] == "0"
    entry = _entry(run)
    stop = entry["stop"]
    assert entry["status"] == "preempted" and stop["saved"] and stop["signal"] == "SIGTERM"
    assert stop["step"] >= seen and not stop["requeued"]
    root = run / "stage16" / "checkpoints"
    assert ck.read_latest(root) == f"global_step{stop['step']}"
    assert ck.verify(root / f"global_step{stop['step']}", deep=True).complete
    assert "not requeued" in out.read_text()


def test_the_warning_signal_saves_and_requeues(slurm, stage15_fp32, config, tmp_path):
    run = _copy_stage15(stage15_fp32, tmp_path / "run")
    out = tmp_path / "out"
    script = _stage16_script(config, run, 100_000, "--requeue")
    # USR1 to the batch shell (the front, exec'd) 60-90 s before the 2-minute limit.
    job = _job(slurm, script, out, "--requeue", "--time=2", "--signal=B:USR1@60")
    first_run = time.time()
    slurm.wait_state(job, "RUNNING", timeout=60)
    deadline = time.time() + 200
    while slurm.job_info(job).get("Restarts") != "1" and time.time() < deadline:
        time.sleep(1)  # requeued after the save
    entry = _entry(run)
    stop = entry["stop"]
    assert entry["status"] == "preempted" and stop["signal"] == "SIGUSR1", out.read_text()[-3000:]
    assert stop["saved"] and stop["requeued"]
    saved = stop["step"]
    # The requeued job continues the stage from that checkpoint.
    slurm.wait_state(job, "RUNNING", timeout=120)
    _until_step(run, saved + 20, since=first_run + 1)
    slurm.scancel(job)
    slurm.wait_state(job, "CANCELLED", timeout=120)
    log = out.read_text()
    assert f"resumed {run}/stage16/checkpoints/global_step{saved}" in log, log[-3000:]
    allocs = _entry(run)["allocations"]
    assert [a["restart_count"] for a in allocs] == [0, 1]
    assert allocs[1]["first_step"] == saved


def test_the_time_limit_is_met_without_a_warning_signal(slurm, stage15_fp32, config, tmp_path):
    run = _copy_stage15(stage15_fp32, tmp_path / "run")
    out = tmp_path / "out"
    job = _job(slurm, _stage16_script(config, run, 100_000), out, "--time=1")
    info = slurm.wait_state(job, "FAILED", timeout=200)  # exit 4 before Slurm's own limit
    end = info["EndTime"]
    entry = _entry(run)
    stop = entry["stop"]
    assert entry["status"] == "preempted" and stop["reason"] == "time-limit", out.read_text()
    assert stop["saved"] and info["ExitCode"].startswith("4:")
    root = run / "stage16" / "checkpoints"
    assert ck.read_latest(root) == f"global_step{stop['step']}"
    assert "time limit" in stop["detail"] and info["JobState"] != "TIMEOUT", end
    assert "not requeued" in out.read_text()  # no --requeue was asked for


def test_the_rank_entry_under_a_plain_srun(slurm, config, tmp_path):
    run = tmp_path / "run"
    out = tmp_path / "out"
    script = (
        f"cd {shlex.quote(str(REPO))}\n"
        f"srun {sys.executable} -m wonderland_ds.train --stage 15 --config {config}"
        f" --run-dir {run} --steps 20\n"
    )
    job = _job(slurm, script, out)
    info = slurm.wait_state(job, "COMPLETED", timeout=200)
    assert info["JobState"] == "COMPLETED", out.read_text()[-3000:]
    ranks = json.loads((run / "stage15" / "ranks.json").read_text())
    assert [(r["rank"], r["host"]) for r in ranks] == [(0, "wls-node0"), (1, "wls-node1")]
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert entry["status"] == "ok" and entry["world_size"] == 2 and entry["global_step"] == 20
