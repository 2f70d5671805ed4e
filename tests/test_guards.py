"""Health guards on real gloo ranks: every injected fault is detected, with its
latency in steps; policies stop or roll back; a clean 2,000-step run raises no alarm."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.helpers.util import REPO, wonderland

pytestmark = pytest.mark.slow
GUARDS_WARN = str(REPO / "tests" / "configs" / "tiny_guards_warn.json")
CLEAN = str(REPO / "tests" / "configs" / "tiny_clean_2000.json")


def events(stage_dir: Path) -> list[dict]:
    path = stage_dir / "guards.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def first(evts: list[dict], guard: str) -> dict:
    return next(e for e in evts if e["guard"] == guard)


@pytest.fixture
def run16(stage15_fp32, tmp_path) -> Path:
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    return run


def with_guards(base: str | Path, out: Path, **guards) -> Path:
    """``base`` with ``wonderland.guards`` fields set, written to ``out``."""
    cfg = json.loads(Path(base).read_text())
    cfg["wonderland"].setdefault("guards", {}).update(guards)
    out.write_text(json.dumps(cfg))
    return out


def train16(run16: Path, config: str | Path, steps: int, fault: str):
    """Stage 16 resumed from the run's stage 15, with a fault injected."""
    return wonderland(
        "train",
        "--stage",
        "16",
        "--config",
        str(config),
        "--run-dir",
        str(run16),
        "--resume",
        "auto",
        "--steps",
        str(steps),
        "--fault",
        fault,
    )


def test_every_fault_is_detected_with_its_latency(run16):
    faults = (
        # factor 3: a 4 MB transfer takes ~1 ms on this host, so a 2x slower one is ~1 ms
        # slower, right at slow_min_ms (1 ms); once in a CI run no three probes in a row
        # stood out. 3x is ~2 ms slower.
        "slow@comm:rank=1:factor=3,drop@grad:rank=1:step=50:until=51,"
        "spike@step:step=60:factor=4,perturb@step:rank=1:step=66,nan@step:step=78"
    )
    r = wonderland(
        "train",
        "--stage",
        "16",
        "--config",
        GUARDS_WARN,
        "--run-dir",
        str(run16),
        "--resume",
        "auto",
        "--steps",
        "40",
        "--fault",
        faults,
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    for kind in (
        "slow at comm",
        "drop at grad step 50 rank 1",
        "spike at step step 60",
        "perturb at step step 66 rank 1",
        "nan at step step 78",
    ):
        assert f"FAULT INJECTED: {kind}" in out, kind  # each fault really happened
    evts = events(run16 / "stage16")
    slow = first(evts, "slow-rank")
    assert slow["step"] == 0 and slow["rank"] == 1  # named by the start check
    drop = first(evts, "grad-drop")
    assert (
        drop["step"] == 50 and drop["rank"] == 1
    )  # stamped at its step; acted on at the check (<= 9 steps later; target: 10)
    assert first(evts, "loss-spike")["step"] == 60  # at the step
    divs = [e for e in evts if e["guard"] == "replica-divergence"]
    # The next fingerprint (every 5 steps); two replicas that disagree are both named.
    assert {e["rank"] for e in divs if e["step"] == 70} == {0, 1}, divs
    assert all("body.0.weight" in e["message"] and "no majority" in e["message"] for e in divs)
    assert first(evts, "loss-nan")["step"] == 78  # at the step
    assert first(evts, "slow-comm")["rank"] == 1  # the in-training probe names it too
    # Judged 10 steps at a time (guards.check_interval), every step keeps its own row and
    # events: warnings do not end a check early.
    import csv

    with open(run16 / "stage16" / "metrics.csv") as fh:
        assert [int(row["step"]) for row in csv.DictReader(fh)] == list(range(41, 81))
    check = json.loads((run16 / "stage16" / "allreduce_check.json").read_text())
    assert all(row["allreduce_ok"] for row in check["ranks"])
    assert check["ranks"][1]["send_ratio"] > 1.25
    assert check["probe_s"] > 0  # places the first in-training probe


@pytest.mark.proofs
def test_stop_policy_exits_3_and_saves_nothing_after_the_fault(run16):
    r = wonderland(
        "train",
        "--stage",
        "16",
        "--config",
        str(REPO / "tests" / "configs" / "tiny_zero2_fp32.json"),
        "--run-dir",
        str(run16),
        "--resume",
        "auto",
        "--optimizer-state",
        "--scheduler-state",
        "--steps",
        "20",
        "--fault",
        "drop@grad:rank=1:step=45",
    )
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert "[grad-drop]" in out and "rank 1" in out and "Traceback" not in out
    assert not list((run16 / "stage16" / "checkpoints").glob("global_step*"))
    assert (run16 / "stage15" / "checkpoints" / "latest").read_text() == "global_step40"
    report = json.loads((run16 / "stage16" / "guard_report.json").read_text())
    # Judged by step 50's check, which a save waits for (never overlapped): nothing past it.
    assert report["stopped_at_step"] == 45 and report["trained_to_step"] == 50
    manifest = json.loads((run16 / "run.json").read_text())
    assert manifest["stages"]["16"]["status"] == "guard-stopped"


@pytest.mark.nightly
def test_overlapped_check_stops_one_step_later_and_writes_only_judged_steps(run16, tmp_path):
    """guards.overlap_check (the default): step 45's check (not a save's) runs its all-reduce
    while step 46 trains, and its verdict comes when step 46 ends. The fault at step 43 stops
    the run there: step 46 trained (the overlap really happened) and is discarded; the
    metrics hold only the steps judged fine; nothing was saved."""
    tiny = REPO / "tests" / "configs" / "tiny_zero2_fp32.json"
    config = with_guards(tiny, tmp_path / "check5.json", check_interval=5)
    r = train16(run16, config, 20, "drop@grad:rank=1:step=43")
    out = r.stdout + r.stderr
    assert r.returncode == 3, out[-3000:]
    assert "FAULT INJECTED: drop at grad step 43 rank 1" in out and "Traceback" not in out
    report = json.loads((run16 / "stage16" / "guard_report.json").read_text())
    assert report["stopped_at_step"] == 43 and report["trained_to_step"] == 46
    drop = first(report["events"], "grad-drop")
    assert drop["step"] == 43 and drop["rank"] == 1
    import csv

    with open(run16 / "stage16" / "metrics.csv") as fh:
        assert [int(row["step"]) for row in csv.DictReader(fh)] == [41, 42]
    assert not list((run16 / "stage16" / "checkpoints").glob("global_step*"))


@pytest.mark.proofs
@pytest.mark.parametrize("check_interval,overlap", [(1, False), (1, True), (10, True)])
def test_rollback_policy_reloads_and_skips_the_bad_batches(
    run16, tmp_path, check_interval, overlap
):
    config = with_guards(
        GUARDS_WARN,
        tmp_path / "rollback.json",
        spike_policy="rollback",
        allreduce_check=False,
        check_interval=check_interval,
        overlap_check=overlap,
    )
    r = train16(run16, config, 40, "spike@step:step=55:factor=8")
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    roll = first(events(run16 / "stage16"), "rollback")
    assert roll["step"] == 55 and "rolled back to global_step50" in roll["message"]
    manifest = json.loads((run16 / "run.json").read_text())["stages"]["16"]
    assert manifest["rollbacks"] == 1 and manifest["global_step"] == 80
    meta = json.loads(
        (run16 / "stage16" / "checkpoints" / "global_step80" / "wonderland_meta.json").read_text()
    )
    # 40 steps of 128 samples after stage 15's 1920, plus the skipped batches: those of the
    # steps from the checkpoint to the check that judged step 55 (51..55 when every step is
    # checked at once, 51..56 when step 55's check overlaps step 56, 51..60 when the check
    # comes every 10 steps, step 60's being a save's, which never overlaps: the steps after 55
    # were trained on the spiked weights and are rolled back with it).
    skipped = {(1, False): 5, (1, True): 6, (10, True): 10}[(check_interval, overlap)]
    assert meta["data"]["samples_consumed"] == 1920 + (40 + skipped) * 128
    import csv

    with open(run16 / "stage16" / "metrics.csv") as fh:
        steps = [int(row["step"]) for row in csv.DictReader(fh)]
    assert steps == list(range(41, 81))  # the rolled-back steps are not in the curve twice


@pytest.mark.proofs
def test_clean_2000_step_run_raises_no_alarm(tmp_path):
    run = tmp_path / "run"
    r = wonderland("train", "--stage", "15", "--config", CLEAN, "--run-dir", str(run), timeout=400)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    manifest = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert manifest["global_step"] == 2000
    assert events(run / "stage15") == [] and manifest["guard_events"] == {}
    assert (run / "stage15" / "allreduce_check.json").exists()  # the check did run
    # docs/performance.md's data-stall figure for this stage (measured 0.5-0.9%, bar 1%); the
    # assert catches a loader that stalls the loop, the figure comes from an idle machine.
    stall = manifest["data_stall_fraction"]
    print(f"data_stall_fraction {stall:.4%}")
    assert 0 < stall < 0.02, stall
