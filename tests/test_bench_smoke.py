"""The benchmarks in bench/ keep working: each runs once, tiny, and its JSON is checked.

The figures themselves come from full runs (docs/performance.md); these only prove the scripts run
end to end and measure every side they claim to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.util import REPO
from wonderland_ds.launch.command import free_port

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
ENV = dict(os.environ, OMP_NUM_THREADS="1")


def run_bench(cmd: list[str], out: Path, timeout: int) -> dict:
    """Run one benchmark command from the repository root; its JSON result from ``out``."""
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return json.loads(out.read_text())


SIDES = (
    "raw",
    "wonderland",
    "guards-off",
    "check-every-step",
    "check-blocking",
    "reads-1",
)


@pytest.mark.nightly  # a full engine start per side; the other benches' smokes stay default
def test_engine_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "r.json"
    cmd = [
        str(BIN / "deepspeed"),
        "--num_gpus",
        "2",
        "--no_ssh_check",
        "--master_addr",
        "127.0.0.1",
        "--master_port",
        str(free_port()),
        "bench/bench_engine.py",
        "--task",
        "digits",
        "--zero",
        "2",
        "--steps",
        "12",
        "--reps",
        "1",
        "--save",
        "1",
        "--sides",
        ",".join(SIDES),
        "--out",
        str(out),
    ]
    res = run_bench(cmd, out, 300)
    assert res["world"] == 2
    for side in SIDES:
        (t,) = res["mean_step_s"][side]
        assert 0 < t < 5, (side, t)
        (b,) = res["block_q25_step_s"][side]
        (c,) = res["cpu_step_s"][side]
        assert 0 < b < 5 and 0 < c < 10, (side, b, c)
        if side != "raw":
            assert res["ratio_to_raw"][side]["min"] > 0, side
            assert res["block_ratio_to_raw"][side]["min"] > 0, side
            assert res["cpu_ratio_to_raw"][side]["min"] > 0, side
    save = res["save"]
    assert res["disk_write_Bps"] > 0 and save["checkpoint_bytes"] > 0
    for key in ("ds_sync_s", "ds_sync_durable_s", "wl_blocked_s", "wl_complete_s"):
        assert len(save[key]) == 1 and save[key][0] > 0, key
    # The background save cannot be complete before the loop got control back.
    assert save["wl_complete_s"][0] >= save["wl_blocked_s"][0]


@pytest.mark.nightly
def test_loader_bench_one_tiny_repetition():
    cmd = [sys.executable, "bench/bench_loader.py", "--reps", "1", "--samples", "256"]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "samples/s" in r.stdout, r.stdout[-2000:]


@pytest.mark.nightly
def test_check_allreduce_bench_one_tiny_run(tmp_path):
    out = tmp_path / "ar.json"
    cmd = [
        str(BIN / "torchrun"),
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        "bench/bench_check_allreduce.py",
        "--reps",
        "10",
        "--work",
        "sleep",
        "--out",
        str(out),
    ]
    got = run_bench(cmd, out, 120)
    assert got["world"] == 2 and got["bytes"] == 10 * 9 * 8 and len(got["ranks"]) == 2
    for rank in got["ranks"]:
        assert set(rank) == {"blocking", "overlapped"}
        assert all(v["median_us"] > 0 and v["mean_us"] > 0 for v in rank.values())


@pytest.mark.nightly
def test_parts_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "parts.json"
    cmd = [
        sys.executable,
        "bench/bench_parts.py",
        "--steps",
        "20",
        "--reps",
        "1",
        "--out",
        str(out),
    ]
    got = run_bench(cmd, out, 120)
    m, h = got["metrics"], got["hooks"]
    sides = ("ds_write_events_ms", "write_batch_reopen_ms", "write_batch_ms")
    assert m["tags_per_step"] == 14 and [len(m[k]) for k in sides] == [1, 1, 1]
    assert min(m[k][0] for k in sides) > 0
    assert h["hooked_grads_per_step"] == 16
    assert len(h["plain_ms"]) == len(h["hooked_ms"]) == len(h["hooked_fp32_ms"]) == 1
    assert min(h["plain_ms"] + h["hooked_ms"] + h["hooked_fp32_ms"]) > 0


def test_resume_timeline_gc_timer_counts_collections_by_role_up_to_the_first_step(tmp_path):
    """The collector timer resume_timeline.py installs (as sitecustomize) in a process named
    like a rank: its collections are counted for that rank, and none after the cut-off."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from resume_timeline import GC_TIMER, gc_seconds
    finally:
        sys.path.remove(str(REPO / "bench"))
    site, logs = tmp_path / "site", tmp_path / "logs"
    site.mkdir()
    logs.mkdir()
    (site / "sitecustomize.py").write_text(GC_TIMER)
    script = tmp_path / "train.py"  # a rank runs a .py script with RANK set
    # 300 thousand tracked lists: each forced full collection takes milliseconds to scan them
    script.write_text(
        "import gc\nkeep = [[i] for i in range(300000)]\nfor _ in range(3):\n    gc.collect()\n"
    )
    env = dict(ENV, PYTHONPATH=str(site), GCLOG_DIR=str(logs), RANK="1")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    log = next(logs.glob("*.log")).read_text().splitlines()
    assert log[0] == f"1 {script}" and len(log) >= 4  # the three forced collections at least
    spent = gc_seconds(logs, until=float("inf"))
    assert set(spent) == {"rank1"} and spent["rank1"] > 0
    assert gc_seconds(logs, until=0.0) == {"rank1": 0.0}


@pytest.mark.nightly
def test_reshard_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "reshard.json"
    cmd = [sys.executable, "bench/bench_reshard.py", "--dim", "64", "--layers", "1"]
    got = run_bench(cmd + ["--reps", "1", "--out", str(out)], out, timeout=600)
    s = got["summary"]
    assert len(got["runs"]["same"]) == len(got["runs"]["resharded"]) == 1
    assert s["universal_folders"] == 0 and s["bytes_read_per_rank_max"] == s["share_bytes_per_rank"]
    assert all(r["resume"]["load"] == "resharded" for r in got["runs"]["resharded"])
    assert s["ratio_median"] > 0 and s["cold_read_vs_disk_read_paired_median"] > 0


@pytest.mark.nightly  # six launches and two lm-eval runs: about 2 minutes
def test_lm_eval_bench_quick(tmp_path):
    out = tmp_path / "r.json"
    got = run_bench(
        [sys.executable, "bench/bench_lm_eval.py", "--quick", "--out", str(out)], out, 900
    )
    rates = got["requests_per_s"]
    assert rates["wonderland_2_ranks_zero3"] > 0 and rates["lm_eval_hf_export"] > 0
    assert (
        got["requests_per_s_ratio"]
        == rates["wonderland_2_ranks_zero3"] / rates["lm_eval_hf_export"]
    )
    whole = got["whole_s"]
    assert whole["stage17_both_checkpoints"] > 0 and whole["export_and_lm_eval_both"] > 0
    assert len(got["samples"]["rates"]["wonderland"]) == 2  # both checkpoints timed


def test_tokenize_bench_small(tmp_path):
    out = tmp_path / "r.json"
    got = run_bench(
        [sys.executable, "bench/bench_tokenize.py", "--mb", "1", "--reps", "1", "--out", str(out)],
        out,
        300,
    )
    assert got["same_bytes"] and got["tokens"] > 100_000
    wall = got["wall_s"]  # rounded to 10 ms; the ratio is of the unrounded times
    assert got["time_ratio"] == pytest.approx(wall["tokenize"] / wall["plain"], abs=0.01)
    assert got["peak_rss_mib"]["tokenize"] > 0 and got["peak_rss_mib"]["plain"] > 0


@pytest.mark.nightly  # ten launches at a tiny size and four timed ones: about 3.5 minutes
def test_zero3_defaults_bench_quick(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/bench_zero3_defaults.py", "--quick", "--out", str(out)]
    got = run_bench(cmd + ["--work", str(tmp_path / "work")], out, 900)
    mem = got["memory"]
    assert got["quick"] and set(mem["buckets"]) == {
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
    }
    for side in ("single", "shards", "shards_fixed"):
        assert mem[f"fall_{side}"] > 0 and len(mem[f"above_baseline_{side}"]) == 2
    assert mem["allocator"]["big_shards@2"]["mmap_threshold"] is None
    assert mem["allocator"]["big_shards_fixed@2"]["mmap_threshold"] == 131072
    assert len(got["step"]["sides_s"]["fixed"]) == len(got["step"]["sides_s"]["glibc"]) == 2
    assert got["step"]["ratio_paired"] > 0
