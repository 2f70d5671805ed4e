"""A run that tells the truth and restarts itself: live state from processes and heartbeats,
stale stages from checkpoint lineage, refused reruns, in-job restarts, ports, per-environment
JIT ops, filtered harmless warnings."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest

from tests.conftest import TINY32
from tests.helpers.util import REPO, snapshot, wonderland
from wonderland_ds.cli import main as cli
from wonderland_ds.core import quiet
from wonderland_ds.launch import command as launch
from wonderland_ds.run import liveness as runstate


def beat(stage_dir: Path, rank: int, pid: int, host: str, age: float) -> None:
    (stage_dir / "heartbeat").mkdir(parents=True, exist_ok=True)
    body = {"rank": rank, "pid": pid, "host": host, "step": 3, "time": time.time() - age}
    (stage_dir / "heartbeat" / f"rank{rank}.json").write_text(json.dumps(body))


def dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_live_state_from_processes_and_heartbeats(tmp_path):
    here = runstate.host()
    stage = tmp_path / "stage16"
    beat(stage, 0, dead_pid(), here, age=1.0)
    entry = {"status": "running", "front": {"pid": dead_pid(), "host": here}}
    got = runstate.live(stage, entry)
    assert got["state"] == "interrupted" and got["heartbeat_age_s"] >= 1.0  # all dead
    beat(stage, 1, os.getpid(), here, age=60.0)  # a live rank here, however old its beat
    assert runstate.live(stage, entry)["state"] == "running"
    beat(stage, 1, 12345, "elsewhere", age=1.0)  # another host: a fresh beat is alive
    assert runstate.live(stage, entry)["state"] == "running"
    beat(stage, 1, 12345, "elsewhere", age=runstate.STALE_AFTER_S + 1)
    assert runstate.live(stage, entry)["state"] == "interrupted"


def test_heartbeat_thread_rewrites_its_file(tmp_path):
    hb = runstate.Heartbeat(tmp_path, rank=2, interval=0.05).start()
    first = json.loads(hb.path.read_text())["time"]
    hb.step = 7
    time.sleep(0.3)
    hb.stop()
    body = json.loads(hb.path.read_text())
    assert body["time"] > first and body["step"] == 7 and body["pid"] == os.getpid()


def test_harmless_warnings_are_filtered_and_others_shown():
    import logging

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        quiet.install()
        warnings.warn(
            "`torch.distributed.all_gather_into_tensor` is deprecated. Please use x",
            FutureWarning,
            stacklevel=1,
        )
        warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else is deprecated"]
    records: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    log = logging.getLogger("DeepSpeed")
    handler = Keep()
    log.addHandler(handler)
    try:
        log.warning("Attempting to get learning rate from scheduler before it has started")
        log.warning("a real warning")
    finally:
        log.removeHandler(handler)
    assert records == ["a real warning"]


def test_jit_ops_are_built_per_environment(monkeypatch, tmp_path):
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    a = launch.extensions_dir(os.environ)
    monkeypatch.setattr(sys, "prefix", "/opt/other-venv")
    b = launch.extensions_dir(os.environ)
    assert a != b and a.parent == b.parent == tmp_path / "wonderland" / "torch_extensions"
    monkeypatch.setattr(sys, "prefix", sys.base_prefix)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", "/mine")  # the user's choice wins
    assert launch.extensions_dir(os.environ) == Path("/mine")
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    from wonderland_ds.config.hostfile import parse

    hf, _ = parse(str(REPO / "hostfiles" / "localhost"))
    assert hf is not None
    _, env, _ = launch.build(hf, None, [], tmp_path)
    assert env["TORCH_EXTENSIONS_DIR"] == str(launch.extensions_dir(os.environ))
    assert "TORCH_EXTENSIONS_DIR" in launch.carried_keys(env)  # to every node


def test_a_taken_port_is_never_handed_to_the_launcher(monkeypatch):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([port, port])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or real())
    try:
        got = launch.pick_port()
    finally:
        taken.close()
    assert got != port and launch.port_free(got)


def test_an_automatic_port_lies_outside_the_ephemeral_range(monkeypatch):
    lo, hi = launch.ephemeral_range()
    picks = {launch.pick_port() for _ in range(20)}
    assert all(not lo <= p <= hi and launch.port_free(p) for p in picks), (lo, hi, picks)
    assert len(picks) > 10  # drawn at random: two jobs starting together draw apart
    # Control: where the ephemeral range covers the whole range, bind(0)'s port, from it.
    monkeypatch.setattr(launch, "ephemeral_range", lambda: (1, 65535))
    assert lo <= launch.free_port() <= hi


def test_optimizer_names_deepspeed_resolves_late_are_checked_now(tmp_path):
    from wonderland_ds.config import ds_config

    raw = json.loads(Path(TINY32).read_text())
    for name, ok in (("AdamW", True), ("adamw", True), ("SGD", True), ("AdamWW", False)):
        raw["optimizer"]["type"] = name
        *_, found = ds_config.validate(raw, "c.json")
        bad = [f for f in found if f.rule == "optimizer-type"]
        assert (not bad) is ok, (name, bad)
    assert "did you mean" in bad[0].fix.lower() and bad[0].path == "optimizer.type"
    raw["optimizer"]["type"] = "AdamW"
    raw["scheduler"]["params"].update(warmup_min_lr=0.01, warmup_max_lr=0.005)
    *_, found = ds_config.validate(raw, "c.json")
    assert any(f.rule == "scheduler-params" and "warmup_min_lr" in f.message for f in found)


def test_optimizer_names_match_the_installed_deepspeed_and_torch():
    import torch
    from deepspeed.runtime import config as ds_cfg

    from wonderland_ds.config.ds_models import DEEPSPEED_OPTIMIZERS, torch_optimizers

    assert set(DEEPSPEED_OPTIMIZERS) == set(ds_cfg.DEEPSPEED_OPTIMIZERS)
    real = {
        n
        for n in dir(torch.optim)
        if isinstance(getattr(torch.optim, n), type)
        and issubclass(getattr(torch.optim, n), torch.optim.Optimizer)
        and n != "Optimizer"
    }
    assert torch_optimizers() == real


# ------------------------------------------------------------------ multi-process


def _copy(run: Path, dest: Path) -> Path:
    shutil.copytree(run, dest)
    for f in dest.rglob(".verified-*.json"):
        f.unlink()
    return dest


@pytest.mark.nightly
def test_a_stage_starts_when_the_first_port_chosen_is_taken(monkeypatch, tmp_path, capsys):
    taken = socket.socket()
    taken.bind(("", 0))
    taken.listen()
    port = taken.getsockname()[1]
    picks = iter([port])
    real = launch.free_port
    monkeypatch.setattr(launch, "free_port", lambda: next(picks, None) or real())
    run = tmp_path / "run"
    try:
        rc = cli.main(
            ["train", "--stage", "15", "--config", TINY32, "--run-dir", str(run), "--steps", "2"]
        )
    finally:
        taken.close()
    out = capsys.readouterr().out
    assert rc == 0 and next(picks, "used") == "used"  # the taken port was offered first...
    assert "--master_port" in out and f"--master_port {port} " not in out  # ...and passed over
    assert json.loads((run / "run.json").read_text())["stages"]["15"]["status"] == "ok"


@pytest.mark.slow
def test_a_completed_stage_is_not_rerun_without_rerun(stage15_fp32, tmp_path, capsys):
    run = _copy(stage15_fp32, tmp_path / "run")
    before = snapshot(run)
    rc = cli.main(["train", "--stage", "15", "--config", TINY32, "--run-dir", str(run)])
    err = capsys.readouterr().err
    assert rc == 2 and "--rerun" in err and "global_step40" in err, err
    assert snapshot(run) == before


@pytest.mark.slow
@pytest.mark.proofs
def test_restart_after_a_killed_rank_finishes_the_stage(stage15_fp32, tmp_path):
    run = _copy(stage15_fp32, tmp_path / "run")
    stage16 = ["train", "--stage", "16", "--config", TINY32, "--run-dir", str(run)]
    stage16 += ["--resume", "auto", "--optimizer-state", "--scheduler-state"]
    result = wonderland(
        *stage16, "--max-restarts", "2", "--fault", "kill@step:step=55:rank=1", timeout=400
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stderr.count("FAULT INJECTED: kill") == 1  # once per stage, across restarts
    entry = json.loads((run / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "ok" and entry["global_step"] == 80  # a clean run's end
    (restart,) = entry["restarts"]
    assert restart["resumed_from_step"] == 50 and restart["exit_code"] != 0
    assert restart["seconds_lost"] >= 0 and restart["cause"]
    assert "stage16/checkpoints/global_step50" in result.stdout  # resumed where it was


@pytest.mark.proofs
def test_a_fault_on_every_attempt_stops_after_max_restarts(stage15_fp32, tmp_path):
    run = _copy(stage15_fp32, tmp_path / "run")
    result = wonderland(
        "train", "--stage", "16", "--config", TINY32, "--run-dir", str(run), "--resume",
        "auto", "--optimizer-state", "--scheduler-state", "--max-restarts", "1",
        "--fault", "kill@step:step=45:rank=1:repeat=1", timeout=400,
    )  # fmt: skip
    assert result.returncode not in (0, 2, 3), result.stderr[-2000:]
    assert result.stderr.count("FAULT INJECTED: kill") == 2
    assert "after 1 restart" in result.stderr and "exit code" in result.stderr
    entry = json.loads((run / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "failed" and len(entry["restarts"]) == 1


def _stage16_until(run: Path, step: int, *extra: str) -> subprocess.Popen:
    """`wonderland train --stage 16` in its own process group, once it passed ``step``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "wonderland_ds.cli.main", "train", "--stage", "16", "--config",
         TINY32, "--run-dir", str(run), "--resume", "auto", "--optimizer-state",
         "--scheduler-state", "--steps", "3000", *extra],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    launched = time.time()
    deadline = launched + 180
    while time.time() < deadline:
        beats = runstate.heartbeats(run / "stage16")
        if any((b.get("step") or 0) >= step and b["time"] >= launched for b in beats):
            return proc
        time.sleep(0.5)
    os.killpg(proc.pid, signal.SIGKILL)
    pytest.fail(f"stage 16 did not reach step {step}")


@pytest.mark.slow
@pytest.mark.nightly
def test_sigkill_of_the_whole_group_reads_interrupted_at_once(stage15_fp32, tmp_path):
    run = _copy(stage15_fp32, tmp_path / "run")
    proc = _stage16_until(run, 45)
    status = json.loads(wonderland("status", str(run), "--json").stdout)
    assert status["stages"]["16"]["state"] == "running"
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.time()
    proc.wait()
    status = json.loads(wonderland("status", str(run), "--json").stdout)
    assert time.time() - killed < 5
    entry = status["stages"]["16"]
    # One state: run.json still says "running" (nobody will update it); status does not.
    assert (
        "status" not in entry
        and json.loads((run / "run.json").read_text())["stages"]["16"]["status"] == "running"
    )
    assert entry["state"] == "interrupted" and entry["heartbeat_age_s"] is not None
    assert entry["step"] >= 45 and entry["latest_complete_checkpoint"]  # the step it reached
    assert entry["next"].endswith(f"--resume auto --run-dir {run}")
    text = wonderland("status", str(run)).stdout
    assert "interrupted at step" in text and "no process of it is alive" in text
    assert "continue with: wonderland train --stage 16" in text


def test_stale_stages_follow_the_lineage(tmp_path):
    from wonderland_ds.checkpoint import contract as ck

    def tag(stage: int, step: int) -> str:
        d = tmp_path / f"stage{stage}" / "checkpoints" / f"global_step{step}"
        d.mkdir(parents=True)
        (d / "f.pt").write_bytes(os.urandom(8))  # each save's own contents
        ck.write_meta(d, {"global_step": step})
        return str(d)

    s15, s16 = tag(15, 40), tag(16, 80)
    stages = {
        "15": {"status": "ok", "input_checkpoint": None},
        "16": {"status": "ok", "input_checkpoint": s15},
        "17": {"status": "ok", "input_checkpoint": s16},
        "18": {"status": "ok", "input_checkpoint": s16},
    }
    assert runstate.stale(tmp_path, stages) == {}
    tag(16, 120)  # stage 16 trained further: what 17 and 18 measured is not the newest
    why = runstate.stale(tmp_path, stages)
    assert set(why) == {"17", "18"} and "global_step120" in why["17"]
    tag(15, 60)  # and stage 15 too: 16 is stale, and everything after it
    assert set(runstate.stale(tmp_path, stages)) == {"16", "17", "18"}
    # Same path, another save (a rerun reached the same step): its identity differs.
    stages["16"]["input_checkpoint"] = str(tmp_path / "stage15/checkpoints/global_step60")
    stages["16"]["input_checkpoint_id"] = runstate.checkpoint_id(
        Path(stages["16"]["input_checkpoint"])
    )
    assert "16" not in runstate.stale(tmp_path, stages)
    shutil.rmtree(tmp_path / "stage15/checkpoints/global_step60")
    tag(15, 60)
    assert "saved again" in runstate.stale(tmp_path, stages)["16"]
    states = runstate.true_states(tmp_path, {"stages": stages})
    assert states["15"]["state"] == "done" and states["16"]["state"] == "stale"


@pytest.mark.nightly
def test_a_killed_stage_reads_interrupted_and_the_pipeline_mends_it(tmp_path):
    run = tmp_path / "run"
    port = launch.pick_port()
    first = wonderland(
        "pipeline", "--from", "15", "--to", "17", "--config", TINY32, "--run-dir", str(run),
        "--master-port", str(port), timeout=500,
    )  # fmt: skip
    assert first.returncode == 0, first.stderr[-3000:]
    assert first.stdout.count(f"--master_port {port} ") == 3  # honoured by every stage
    # Stage 16 again, as a new attempt, killed mid-stage with its whole process group.
    proc = _stage16_until(run, 45, "--rerun")
    os.killpg(proc.pid, signal.SIGKILL)
    killed = time.time()
    proc.wait()
    status = json.loads(wonderland("status", str(run), "--json").stdout)
    assert time.time() - killed < 5
    assert status["stages"]["16"]["state"] == "interrupted"
    assert status["stages"]["17"]["state"] == "stale"  # its checkpoint is the old attempt's
    attempts = status["stages"]["16"]["attempts"]
    assert attempts and Path(attempts[0]["folder"]).name == "stage16.attempt1"
    mended = wonderland(
        "pipeline", "--from", "16", "--to", "17", "--config", TINY32, "--run-dir", str(run),
        timeout=600,
    )  # fmt: skip
    assert mended.returncode == 0, mended.stderr[-3000:]
    assert "already done" not in mended.stdout and "stage 17 summary" in mended.stdout
    status = json.loads(wonderland("status", str(run), "--json").stdout)
    assert {k: v["state"] for k, v in status["stages"].items()} == {
        "15": "done",
        "16": "done",
        "17": "done",
    }
    assert status["stages"]["16"]["global_step"] > 45  # continued, not started over


def test_hosts_a_timeout_names_are_excluded_from_the_next_launch(tmp_path):
    from wonderland_ds.config.hostfile import parse
    from wonderland_ds.launch.rank import _named_hosts

    hung = (
        "a collective timed out after the 60 s process-group timeout on rank 0; rank 2"
        " (node-b), 3 (node-b) did not answer within 15 s: hung or dead (RuntimeError: x)"
    )
    assert _named_hosts(hung) == ["node-b"]
    assert _named_hosts("... rank 0 on node-a (it holds the rendezvous store) does not answer") == [
        "node-a"
    ]
    assert _named_hosts(None) == [] and _named_hosts("every rank answers afterwards") == []
    path = tmp_path / "hosts"
    path.write_text("node-a slots=2\nnode-b slots=2\n")
    hf, _ = parse(str(path))
    assert hf is not None
    cmd, _, _ = launch.build(hf, None, [], tmp_path, 29500, exclude=["node-b"])
    assert cmd[cmd.index("--exclude") + 1] == "node-b"


def test_only_training_stages_refuse_a_rerun(tmp_path):
    import argparse

    from wonderland_ds.cli.attempts import refuse_rerun as _refuse_rerun
    from wonderland_ds.core.findings import Refused
    from wonderland_ds.run import manifest

    for n in (15, 16, 17, 18):
        manifest.update_stage(tmp_path, n, status="ok")
    for n, refused in ((15, True), (16, True), (17, False), (18, False)):
        args = argparse.Namespace(stage=n, rerun=False)
        try:
            _refuse_rerun(args, tmp_path)
            got = False
        except Refused:
            got = True
        assert got is refused, n
        _refuse_rerun(argparse.Namespace(stage=n, rerun=True), tmp_path)  # --rerun: never
