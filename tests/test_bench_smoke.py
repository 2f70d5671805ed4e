"""The benchmarks in bench/ keep working: each runs once, tiny, and its JSON is checked
(the `bench` family, which CI runs; the quickest stay in the default suite).

The figures themselves come from full runs (docs/performance.md); these only prove the scripts run
end to end and measure every side they claim to.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
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


@pytest.mark.bench  # a full engine start per side; the other benches' smokes stay default
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


@pytest.mark.bench
def test_loader_bench_one_tiny_repetition():
    cmd = [sys.executable, "bench/bench_loader.py", "--reps", "1", "--samples", "256"]
    r = subprocess.run(cmd, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    assert "samples/s" in r.stdout, r.stdout[-2000:]


@pytest.mark.bench
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


@pytest.mark.bench
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
        from resume_timeline import GC_TIMER, gc_seconds, spawned
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
    t0 = time.time()
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr
    log = next(logs.glob("*.log")).read_text().splitlines()
    rank, started, argv0 = log[0].split(" ", 2)
    assert (rank, argv0) == ("1", str(script)) and len(log) >= 4  # three forced collections
    assert t0 <= float(started) == spawned(logs) <= time.time()  # the interpreter's start
    spent = gc_seconds(logs, until=float("inf"))
    assert set(spent) == {"rank1"} and spent["rank1"] > 0
    assert gc_seconds(logs, until=0.0) == {"rank1": 0.0}


@pytest.mark.bench
def test_reshard_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "reshard.json"
    cmd = [sys.executable, "bench/bench_reshard.py", "--dim", "64", "--layers", "1"]
    got = run_bench(cmd + ["--reps", "1", "--out", str(out)], out, timeout=600)
    s = got["summary"]
    assert len(got["runs"]["same"]) == len(got["runs"]["resharded"]) == 1
    assert s["universal_folders"] == 0 and s["bytes_read_per_rank_max"] == s["share_bytes_per_rank"]
    assert all(r["resume"]["load"] == "resharded" for r in got["runs"]["resharded"])
    assert s["ratio_median"] > 0 and s["cold_read_vs_disk_read_paired_median"] > 0


@pytest.mark.bench  # six launches and two lm-eval runs: about 2 minutes
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


@pytest.mark.bench  # ten launches at a tiny size and four timed ones: about 3.5 minutes
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


@pytest.mark.bench  # eight tiny launches and a resume: about 1.5 minutes
def test_gpu_script_runs_its_whole_path_at_a_tiny_size(tmp_path):
    """bench/gpu.sh as the GPU host will run it, at ``GPU_BENCH_SIZE=tiny`` on this CPU: the
    gpu tests (they skip here, said in the record), both ZeRO stages' paired sides, the save
    and the resume; the JSON and the table carry every figure."""
    out = tmp_path / "gpu"
    env = dict(ENV, GPU_BENCH_SIZE="tiny")
    r = subprocess.run(["bash", "bench/gpu.sh", str(out)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    got = json.loads((out / "gpu.json").read_text())
    assert got["size"] == "tiny" and got["not_run"] == [] and got["seconds"] < 540, got
    assert got["tests"]["rc"] == 0 and "skipped" in got["tests"]["summary"], got["tests"]
    assert (out / "gpu_tests.xml").exists()
    for zero in ("2", "3"):
        row = got["zero"][zero]
        assert len(row["sides"]["wonderland"]) == len(row["sides"]["plain"]) == 2, row
        assert row["wonderland_tokens_s"] > 0 and row["plain_tokens_s"] > 0
        assert 0.5 < row["ratio_paired"] < 2, row  # both sides trained the same model
        assert row["mfu_wonderland"] is None  # no bf16 peak for a CPU: not made up
    sr = got["save_resume"]
    assert sr["checkpoint_bytes"] > got["setup"]["params"] * 12  # weights and Adam's moments
    assert sr["save_s"] > 0 and sr["launch_to_first_step_s"] > 0 and sr["disk_write_Bps"] > 0
    table = (out / "gpu_table.md").read_text()
    assert "| 2 | " in table and "| 3 | " in table and "Save: " in table, table


@pytest.mark.bench
def test_gpu_bench_names_what_its_time_budget_left_out(tmp_path):
    """The budget's control: with none left, no launch starts and the record says what did
    not run, rather than a table of made-up figures."""
    out = tmp_path / "gpu"
    cmd = [sys.executable, "bench/bench_gpu.py", "--size", "tiny", "--budget-s", "0"]
    got = run_bench([*cmd, "--out", str(out)], out / "gpu.json", 300)
    assert len(got["not_run"]) == 9, got["not_run"]  # 2 x 4 sides, then save and resume
    assert "save_resume" not in got
    assert "| 2 | not run |" in (out / "gpu_table.md").read_text()


@pytest.mark.bench  # four sides of a tiny GPT-2 and the front's check: about a minute
def test_causal_lm_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/bench_causal_lm.py", "--reps", "1", "--steps", "6"]
    cmd += ["--warm", "2", "--vocab", "512", "--seq-len", "32", "--work", str(tmp_path / "w")]
    got = run_bench([*cmd, "--out", str(out)], out, 600)
    assert set(got["sides"]) == {"wonderland", "plain", "wonderland_4GB", "plain_again"}
    assert all(len(v) == 1 and v[0]["step_s"] > 0 for v in got["sides"].values()), got["sides"]
    step = got["step"]
    assert step["ratio_paired"] > 0 and step["noise_floor_plain_again"] > 0, step
    mem = got["memory"]
    assert mem["rank_peak_rss_mb_4GB_median"] > 0 and mem["run_dir_data_bytes_4GB"] == 0, mem
    assert got["front_check"]["big"]["samples"] > got["front_check"]["small"]["samples"] > 0


@pytest.mark.bench  # a stage 15, then four resumes of a small GPT: under a minute
def test_resume_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/bench_resume.py", "--dim", "64", "--layers", "2"]
    got = run_bench([*cmd, "--reps", "1", "--out", str(out)], out, 600)
    summary = got["summary"]
    for side in ("wonderland_same", "deepspeed_same", "wonderland_changed", "deepspeed_changed"):
        assert summary[side]["median_s"] > 0, summary
    assert summary["ratio_same"]["paired_median"] > 0 and summary["ratio_changed"]["median"] > 0
    assert got["checkpoint_bytes"] > 0 and got["disk"]["write_Bps"] > 0


@pytest.mark.bench  # a stage 15, then one resume of each side, its output lines stamped
def test_resume_timeline_one_tiny_repetition(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/resume_timeline.py", "--dim", "64", "--layers", "2"]
    got = run_bench([*cmd, "--reps", "1", "--out", str(out)], out, 600)
    (wl,) = got["wonderland"]
    (ds,) = got["deepspeed"]
    marks = ("front_done", "spawned", "resumed", "start_check_done", "first_step")
    assert [wl[m] for m in marks] == sorted(wl[m] for m in marks) and wl["front_done"] > 0, wl
    assert 0 < ds["spawned"] < ds["first_step"], ds
    assert {"front", "rank0", "rank1"} <= set(wl["gc_s"]), wl["gc_s"]
    assert {"runner", "rank0", "rank1"} <= set(ds["gc_s"]), ds["gc_s"]


@pytest.mark.bench  # every part at a tiny size: ten launches and two exports
def test_zero3_bench_quick(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/bench_zero3.py", "--quick", "--out", str(out)]
    got = run_bench([*cmd, "--work", str(tmp_path / "work")], out, 900)
    assert got["quick"] and set(got["memory_vs_world"]) == {"tiny@2", "big@2", "tiny@3", "big@3"}
    assert got["fall_4_to_8"] > 0 and set(got["model_states_mb_per_rank_expected"]) == {"2", "3"}
    ck = got["checkpointing"]
    assert ck["cut"] != 0 and "activation_peak_mb_ckpt_True" in ck, ck
    step = got["step"]
    assert all(len(v) == 1 and v[0] > 0 for v in step["sides_s"].values()), step
    assert step["ratio_paired"] > 0 and step["noise_floor_plain_again"] > 0
    for name in ("tiny", "big"):
        assert got["export"][name]["export_bytes"] > 0 and got["export"][name]["peak_mb"] > 0


@pytest.mark.bench  # a stage-15 checkpoint of a small GPT, then each converter once
def test_convert_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/bench_convert.py", "--dim", "64", "--layers", "2"]
    got = run_bench([*cmd, "--reps", "1", "--out", str(out)], out, 600)
    assert len(got["runs"]["stock"]) == len(got["runs"]["wonderland"]) == 1
    s = got["summary"]
    assert s["speedup_median"] > 0 and s["wonderland"]["vs_disk_median"] > 0, s
    assert got["checkpoint_bytes"] > 0 and got["disk"]["write_Bps"] > 0


@pytest.mark.bench  # the three sides of the stop agreement on a tiny GPT-2, 2 ranks
def test_stop_bench_one_tiny_repetition(tmp_path):
    out = tmp_path / "r.json"
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--no_ssh_check", "--master_addr"]
    cmd += ["127.0.0.1", "--master_port", str(free_port()), "bench/bench_stop.py"]
    cmd += ["--steps", "4", "--warm", "1", "--reps", "1", "--vocab", "512", "--seq-len", "32"]
    got = run_bench([*cmd, "--out", str(out)], out, 600)
    assert set(got["mean_step_s"]) == {"wonderland", "no-agreement", "wonderland-again"}
    assert all(len(v) == 1 and v[0] > 0 for v in got["mean_step_s"].values()), got
    assert got["ratio_to_no_agreement"]["no-agreement"]["paired"] == 1.0
    assert got["agreement_in_loop_s_per_step"]["median"] > 0
    assert got["token_check_s_per_step"]["median"] >= 0


@pytest.mark.bench  # two widths of a tiny GPT-2, each stopped by SIGTERM after its steps
def test_signal_exit_bench_two_tiny_widths(tmp_path):
    out = tmp_path / "r.json"
    cmd = [sys.executable, "bench/bench_signal_exit.py", "--widths", "32,64", "--layers", "1"]
    cmd += ["--vocab", "512", "--seq-len", "16", "--work", str(tmp_path / "w")]
    got = run_bench([*cmd, "--out", str(out)], out, 600)
    rows = got["runs"]
    assert [r["width"] for r in rows] == [32, 64], rows
    assert rows[1]["checkpoint_bytes"] > rows[0]["checkpoint_bytes"] > 0, rows
    assert all(r["exit_code"] == 4 and r["step"] and r["request_to_saved_s"] for r in rows), rows
    assert all(r["signal_to_exit_s"] > 0 for r in rows) and got["disk_write_Bps"] > 0


@pytest.mark.bench  # the scaling script at two tiny sizes and 1 and 3 ranks: four launches
def test_scaling_script_quick_draws_its_table(tmp_path):
    out, png = tmp_path / "scaling", tmp_path / "scaling.png"
    env = dict(ENV, SCALING_QUICK="1")
    r = subprocess.run(["bash", "bench/bench_scaling.sh", str(out), str(png)], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=600)  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    rows = [line for line in r.stdout.splitlines() if line.startswith("| ") and "M |" in line]
    assert [row.split("|")[2].strip() for row in rows] == ["1", "2", "2", "3"], r.stdout
    assert png.stat().st_size > 0 and len(list(out.glob("pylm_*.json"))) == 4
