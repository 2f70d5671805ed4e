"""Faults the rest of the suite only injects in one place, through real stages.

* Rank 0's gradients dropped and its weights perturbed: every other drop/perturb test targets
  rank 1, so a guard that skips rank 0 (the rank that also judges and writes) goes unseen.
  Three ranks, so that the divergent replica can be told from the majority.
* Rank 0 killed inside the production save path (async save, held copies serialized by the
  writer thread while training goes on) with ``--fault kill@save-...``: the crash matrix
  drives its own copy of the save protocol; here DeepSpeed's save, the snapshot engine and
  the deferred serialization are the real ones.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.conftest import REPO, TINY32
from tests.helpers.util import digests, losses, wonderland
from wonderland_ds.checkpoint import contract as ck

pytestmark = pytest.mark.slow
GUARDS_WARN = str(REPO / "tests" / "configs" / "tiny_guards_warn.json")


def events(stage_dir: Path) -> list[dict]:
    path = stage_dir / "guards.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


# ------------------------------------------------------------ rank 0's faults are caught


def test_rank0_dropped_gradients_and_perturbed_weights_are_caught(tmp_path):
    run = tmp_path / "run"
    r = wonderland(
        "train",
        "--stage",
        "15",
        "--config",
        GUARDS_WARN,
        "--run-dir",
        str(run),
        "--nproc",
        "3",
        "--steps",
        "12",
        "--fault",
        "drop@grad:rank=0:step=3:until=4,perturb@step:rank=0:step=6",
    )
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-3000:]
    assert "FAULT INJECTED: drop at grad step 3 rank 0" in out  # the faults really happened
    assert "FAULT INJECTED: perturb at step step 6 rank 0" in out
    evts = events(run / "stage15")
    drops = [(e["step"], e["rank"]) for e in evts if e["guard"] == "grad-drop"]
    assert drops == [(3, 0), (4, 0)], evts  # each dropped step, on rank 0 and no other
    div = [e for e in evts if e["guard"] == "replica-divergence"]
    assert div, evts
    # The next fingerprint after step 6 (every 5 steps) names rank 0, the odd one of three.
    assert div[0]["step"] == 10 and div[0]["rank"] == 0, div
    assert {e["rank"] for e in div} == {0}
    assert "body.0.weight" in div[0]["message"]


# ------------------------------------------------------------ killed inside a real async save


def async_config(tmp_path: Path) -> Path:
    """The reference config with the production save path spelled out."""
    cfg = json.loads(Path(TINY32).read_text())
    cfg["wonderland"].update(async_save=True, async_save_copy=True)
    path = tmp_path / "async_held.json"
    path.write_text(json.dumps(cfg, indent=2))
    return path


def killed_in_a_save(stage15_fp32: Path, tmp_path: Path, point: str) -> None:
    run, config = tmp_path / "run", async_config(tmp_path)
    common = ["--stage", "15", "--config", str(config), "--run-dir", str(run)]
    killed = wonderland("train", *common, "--steps", "30", "--fault", f"kill@{point}:step=20")
    out = killed.stdout + killed.stderr
    assert killed.returncode not in (0, 2, 3), out[-3000:]  # a SIGKILL, not a refusal or guard
    # The fault really happened, inside the save of step 20 (rank 0's writer thread).
    assert f"FAULT INJECTED: kill at {point} step 20 rank 0" in out, out[-3000:]
    assert (run / "stage15" / "faults" / f"kill@{point}-step20-rank0.fired").exists()
    assert "Traceback" not in "\n".join(
        line for line in out.splitlines() if not line.startswith("[rank")
    )

    root = run / "stage15" / "checkpoints"
    named = ck.read_latest(root)
    assert named is not None
    latest = ck.verify(root / named)
    assert latest.complete, latest.findings  # latest names a checkpoint that verifies
    for _, tag_dir in ck.tags(root):
        v = ck.verify(tag_dir)
        # Every folder is complete and verified, or has no metadata and is not a checkpoint.
        assert v.complete or ck.read_meta(tag_dir) is None, v.findings
    newest = ck.newest_complete(root)
    assert newest is not None
    newer_than_latest = (ck.step_of(newest.tag_dir.name) or 0) > (ck.step_of(named) or 0)

    resumed = wonderland("train", *common, "--resume", "auto")
    text = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, text[-3000:]
    record = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert record["status"] == "ok" and record["global_step"] == 30
    # Resumed from the checkpoint latest named, a complete one; the killed save is redone.
    assert record["resumed_from"] == str(root / named), record["resumed_from"]
    if newer_than_latest:
        assert "WARN" in text  # a complete checkpoint newer than latest is told about
    for step in (20, 30):
        assert ck.verify(root / ck.tag_for(step)).complete
    assert ck.read_latest(root) == "global_step30"
    # The same losses and the same samples as the run that was never killed.
    ref, got = losses(stage15_fp32 / "stage15"), losses(run / "stage15")
    assert sorted(got) == list(range(1, 31))
    assert max(abs(ref[s] - got[s]) for s in got) < 1e-6
    ref_digests = digests(stage15_fp32 / "stage15")
    assert digests(run / "stage15") == {s: ref_digests[s] for s in range(1, 31)}


@pytest.mark.proofs
def test_killed_before_the_metadata_of_an_async_save_resumes_from_the_previous(
    stage15_fp32, tmp_path
):
    """Shards written, metadata not: global_step20 is no checkpoint, latest stays on
    global_step10, and --resume auto continues from there."""
    killed_in_a_save(stage15_fp32, tmp_path, "save-before-meta")
    root = tmp_path / "run" / "stage15" / "checkpoints"
    assert json.loads((tmp_path / "run" / "run.json").read_text())["stages"]["15"][
        "resumed_from"
    ] == str(root / "global_step10")


@pytest.mark.nightly
@pytest.mark.parametrize("point", ["save-after-shards", "save-before-latest", "save-after-latest"])
def test_killed_at_every_save_point_of_an_async_save(stage15_fp32, tmp_path, point):
    killed_in_a_save(stage15_fp32, tmp_path, point)
