"""Stage 17, the final evaluation sweep.

One stage-15 run (100 steps: long enough that the minority classes 3 and 8 are learned) is
copied and continued twice: a healthy stage 16, and a broken one whose training data lost
classes 3 and 8 (``tests/helpers/broken_tasks.py``). Stage 17 must pass the first and fail the
second naming exactly 3 and 8.

Sharding: the healthy run is evaluated with ``wonderland eval`` on 2 ranks, the broken one with
``wonderland train --stage 17`` on 3. Both compare against the same stage-15 checkpoint (the same
bytes, copied), so that checkpoint is evaluated on 2 and on 3 ranks; every number either run
reports must equal the one computed here, in a single process with no process group. (Five
deepspeed launches in all: each costs 15-25 s on 2 cores, so none is spent twice.)

The held-out split has 5 samples of each minority class, so one sample is 0.2 of recall: the
test config's margin (0.25) tolerates one sample, its floor (0.5) needs 3 of 5.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from tests.helpers.util import REPO, snapshot, wonderland

GATE = str(REPO / "tests" / "configs" / "tiny_zero2_fp32_gate.json")
BROKEN = "tests.helpers.broken_tasks:digits_without_minority"
STAGE16 = ["--stage", "16", "--resume", "auto", "--optimizer-state", "--scheduler-state"]
PLOTS = ["recall_per_class.png", "confusion_matrix.png", "training_curves.png"]


def out(result) -> str:
    return result.stdout + result.stderr


def ok(result) -> str:
    assert result.returncode == 0, out(result)[-4000:]
    return out(result)


def recall(metrics: dict, c: int) -> float:
    return next(r["recall"] for r in metrics["per_class"] if r["class"] == c)


def png_size(path: Path) -> tuple[int, int]:
    head = path.read_bytes()[:24]
    assert head[:8] == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


@pytest.fixture(scope="module")
def stage15(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("eval15") / "run"
    ok(wonderland("train", "--stage", "15", "--config", GATE, "--run-dir", str(run)))
    return run


@pytest.fixture(scope="module")
def healthy(stage15, tmp_path_factory) -> SimpleNamespace:
    """Stage 16 on the same data, then `wonderland eval --out DIR --json` (2 ranks)."""
    base = tmp_path_factory.mktemp("healthy")
    run, report_dir = base / "run", base / "eval"
    shutil.copytree(stage15, run)
    ok(wonderland("train", *STAGE16, "--config", GATE, "--run-dir", str(run)))
    before = snapshot(run)
    ckpt = str(run / "stage16" / "checkpoints")
    result = wonderland("eval", "--checkpoint", ckpt, "--out", str(report_dir), "--json")
    return SimpleNamespace(
        run=run, out=report_dir, result=result, run_unchanged=snapshot(run) == before
    )


@pytest.fixture(scope="module")
def broken(stage15, tmp_path_factory) -> SimpleNamespace:
    """Stage 16 on data without classes 3 and 8: refused, then allowed; then stage 17 through
    `wonderland train` on 3 ranks, as the pipeline runs it (in the run directory)."""
    run = tmp_path_factory.mktemp("broken") / "run"
    shutil.copytree(stage15, run)
    common = ["--config", GATE, "--run-dir", str(run), "--task", BROKEN]
    before = snapshot(run)
    refused = wonderland("train", *STAGE16, *common)
    unchanged = snapshot(run) == before
    # 100 steps without classes 3 and 8: both fall under the minority floor (at 60 steps of
    # the position-based order class 3 still kept 0.6).
    ok(wonderland("train", *STAGE16, *common, "--allow-data-change", "--steps", "100"))
    stage17 = wonderland("train", "--stage", "17", "--resume", "auto", "--nproc", "3", *common)
    return SimpleNamespace(
        run=run, refused=refused, refusal_wrote_nothing=unchanged, stage17=stage17
    )


# -- fast: the pieces, no processes ---------------------------------------------------------


@pytest.mark.parametrize("n", [0, 1, 63, 64, 65, 367, 1000])
def test_shards_count_every_sample_once_in_the_same_blocks(n):
    from wonderland_ds.eval.sweep import shard

    blocks = {}
    for world in (1, 2, 3, 4):
        parts = [b for r in range(world) for b in shard(n, r, world)]
        flat = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        assert sorted(flat.tolist()) == list(range(n)), world  # each sample exactly once
        blocks[world] = sorted(tuple(b.tolist()) for b in parts)
    assert blocks[1] == blocks[2] == blocks[3] == blocks[4]  # same batches for any world size


def _metrics(recalls: list[float]) -> dict:
    return {"per_class": [{"class": c, "recall": r} for c, r in enumerate(recalls)]}


def test_gate_names_dropped_and_collapsed_classes():
    from wonderland_ds.data.builtin import digits
    from wonderland_ds.eval.evaluate import gate

    task = digits()
    base = _metrics([1.0] * 10)
    findings, failed = gate(task, _metrics([1.0] * 10), base, 0.25, 0.5)
    assert failed == [] and [f.severity for f in findings] == ["ok"]
    new = _metrics([1.0, 0.7, 1.0, 0.4, 1.0, 1.0, 1.0, 1.0, 0.8, 1.0])
    findings, failed = gate(task, new, base, 0.25, 0.5)
    assert failed == [1, 3]
    assert {(f.rule, f.message.split(":")[0]) for f in findings} == {
        ("gate-recall-drop", "class 1"),
        ("gate-recall-drop", "class 3"),
        ("gate-minority-floor", "minority class 3"),
    }


def test_plots_without_training_metrics(tmp_path):
    from wonderland_ds.eval.plots import write_plots

    rows = [
        {"class": c, "recall": 0.5, "support": 4, "minority": c == 1, "f1": 0.5} for c in range(3)
    ]
    metrics = {"per_class": rows, "confusion_matrix": [[2, 2, 0], [0, 2, 2], [2, 0, 2]]}
    report = {
        "checkpoint": "/r/stage16/checkpoints/global_step9",
        "baseline": "/r/stage15/checkpoints/global_step5",
        "stage16": metrics,
        "stage15": metrics,
        "gate": {"verdict": "pass", "minority_recall_floor": 0.5, "failed_classes": []},
    }
    missing = {15: tmp_path / "none.csv"}
    assert write_plots(tmp_path, report, missing) == PLOTS[:2]
    assert all(png_size(tmp_path / name)[0] > 300 for name in PLOTS[:2])
    assert not (tmp_path / PLOTS[2]).exists()


def test_gate_config_passes_check():
    from wonderland_ds.config.ds_config import check_file

    for world in (1, 2, 3):
        assert check_file(GATE, world, {15, 16, 17}) == [], world


def test_eval_refuses_bad_input_before_launching(tmp_path, capsys):
    from wonderland_ds.cli.main import main

    assert main(["eval", "--checkpoint", str(tmp_path / "nope")]) == 2
    assert "checkpoint path does not exist" in capsys.readouterr().err
    lone = tmp_path / "global_step3"  # in no run directory, so no default baseline
    lone.mkdir()
    assert main(["eval", "--checkpoint", str(lone)]) == 2
    assert "pass --baseline PATH" in capsys.readouterr().err
    assert main(["eval", "--checkpoint", str(lone), "--baseline", str(tmp_path)]) == 2
    assert "ckpt-" in capsys.readouterr().err  # an incomplete baseline is named as such
    with pytest.raises(SystemExit) as exc:
        main(["eval", "--checkpoint", str(lone), "--nproc", "0"])
    assert exc.value.code == 2 and "must be >= 1" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["global_step3"]  # nothing written


# -- slow: real gloo ranks through the deepspeed launcher -----------------------------------


@pytest.mark.slow
@pytest.mark.nightly
def test_broken_stage16_needs_allow_data_change(broken):
    refused = broken.refused
    assert refused.returncode == 2, out(refused)[-3000:]
    assert "[data-fingerprint]" in refused.stderr and "--allow-data-change" in refused.stderr
    assert "launch:" not in refused.stdout and broken.refusal_wrote_nothing
    manifest = json.loads((broken.run / "run.json").read_text())
    assert manifest["stages"]["16"]["overrides"] == ["allow-data-change"]


@pytest.mark.slow
def test_healthy_run_passes_the_gate(healthy):
    result = healthy.result
    assert result.returncode == 0, out(result)[-4000:]
    report = json.loads(result.stdout)  # --json: stdout is one JSON object, the rest on stderr
    assert report["exit_code"] == 0 and report["report"] == str(healthy.out / "report.json")
    assert report == {**json.loads((healthy.out / "report.json").read_text()), **report}
    assert report["gate"]["verdict"] == "pass" and report["gate"]["failed_classes"] == []
    assert report["checkpoint"].endswith("stage16/checkpoints/global_step160")
    assert report["baseline"].endswith("stage15/checkpoints/global_step100")
    for c in (3, 8):  # stage 15 really learned the minority classes, and stage 16 kept them
        assert recall(report["stage15"], c) >= 0.8 and recall(report["stage16"], c) >= 0.8
    assert report["stage16"]["samples"] == 367
    assert "gate pass" in result.stderr and "| 3 | yes | 5 |" in result.stderr
    assert healthy.run_unchanged  # --out: the checkpoint's own run is only read
    # Each of the 2 ranks evaluated its blocks on its accelerator from the engine's module
    # weights: the numbers of one CPU process on DeepSpeed's consolidated fp32 weights.
    from wonderland_ds.data import builtin
    from wonderland_ds.eval import evaluate

    task = builtin.load("digits").materialize()
    for key in ("stage16", "stage15"):
        ckpt = Path(report["checkpoint" if key == "stage16" else "baseline"])
        assert report[key] == evaluate.metrics(task, evaluate.reference_predictions(task, ckpt))
    assert report["plots"] == PLOTS and all((healthy.out / p).is_file() for p in PLOTS)
    status = ok(wonderland("status", str(healthy.out)))
    assert "final evaluation sweep" in status and " done " in status


@pytest.mark.slow
@pytest.mark.proofs
def test_broken_stage16_fails_the_gate_naming_the_minority_classes(broken):
    stage17, run = broken.stage17, broken.run
    assert stage17.returncode == 3, out(stage17)[-4000:]
    report = json.loads((run / "stage17" / "report.json").read_text())
    assert report["gate"]["verdict"] == "fail"
    assert report["gate"]["failed_classes"] == [3, 8]
    for c in (3, 8):  # learned by stage 15, forgotten by the broken stage 16
        assert recall(report["stage15"], c) >= 0.8 and recall(report["stage16"], c) <= 0.4
    rules = {(f["rule"], f["message"].split(":")[0]) for f in report["gate"]["findings"]}
    assert rules == {
        ("gate-recall-drop", "class 3"),
        ("gate-minority-floor", "minority class 3"),
        ("gate-recall-drop", "class 8"),
        ("gate-minority-floor", "minority class 8"),
    }
    # The table on stdout marks exactly those rows; the findings reach stderr.
    failed_rows = [r for r in stage17.stdout.splitlines() if r.endswith("| FAIL |")]
    assert [r.split("|")[1].strip() for r in failed_rows] == ["3", "8"]
    assert "ERROR [gate-minority-floor] minority class 8: recall 0.200 < floor 0.5" in (
        stage17.stderr
    )
    manifest = json.loads((run / "run.json").read_text())["stages"]["17"]
    assert manifest["status"] == "gate-failed" and "class 3" in manifest["error"]
    assert manifest["world_size"] == 3
    status = ok(wonderland("status", str(run)))
    assert "gate-failed" in status and "stage-17 gate: fail" in status
    assert report["plots"] == PLOTS
    md = (run / "stage17" / "report.md").read_text()
    assert "Gate: **fail**" in md and all(f"![{p}]({p})" in md for p in PLOTS)
    sizes = [png_size(run / "stage17" / p) for p in PLOTS]
    assert all(w > 500 and h > 400 for w, h in sizes), sizes


@pytest.mark.slow
@pytest.mark.nightly
def test_sharded_evaluation_equals_the_single_process_numbers(healthy, broken):
    from wonderland_ds.data import builtin
    from wonderland_ds.eval import evaluate

    two = json.loads((healthy.out / "report.json").read_text())  # 2 ranks
    three = json.loads((broken.run / "stage17" / "report.json").read_text())  # 3 ranks
    assert json.loads((healthy.out / "run.json").read_text())["stages"]["17"]["world_size"] == 2
    # The same stage-15 checkpoint: the same files, byte for byte.
    base2, base3 = Path(two["baseline"]), Path(three["baseline"])
    assert base2 != base3
    meta = [json.loads((b / "wonderland_meta.json").read_text())["files"] for b in (base2, base3)]
    assert meta[0] == meta[1]

    task = builtin.load("digits").materialize()

    def single(ckpt: str) -> dict:
        return evaluate.metrics(task, evaluate.reference_predictions(task, Path(ckpt)))

    base = single(two["baseline"])
    assert two["stage15"] == three["stage15"] == base  # exact: counts, matrix, every float
    assert two["stage16"] == single(two["checkpoint"])
    assert three["stage16"] == single(three["checkpoint"])
    assert base["confusion_matrix"] != three["stage16"]["confusion_matrix"]  # not vacuous


def test_lm_metrics_per_source_and_gate():
    import math

    from wonderland_ds.eval.lm_loss import lm_gate, lm_metrics

    totals = {"os": (128 * 5.0, 256), "json": (128 * 4.0, 128)}  # (summed loss, tokens)
    m = lm_metrics(totals)
    assert m["tokens"] == 384 and abs(m["loss"] - 3.0) < 1e-12
    per = {r["source"]: r for r in m["per_source"]}
    assert per["os"]["loss"] == 2.5 and per["json"]["tokens"] == 128
    assert abs(per["json"]["perplexity"] - math.exp(4.0)) < 1e-9
    worse = lm_metrics({"os": (128 * 5.0, 256), "json": (128 * 5.0, 128)})
    (f,) = lm_gate(worse, m, 0.10)
    assert f.rule == "gate-loss-rise" and f.path == "json"
    assert lm_gate(m, m, 0.10)[0].severity == "ok"
