"""``wonderland doctor`` on this (CPU-only) machine, and its checks with plain inputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from wonderland_ds.cli import main as cli
from wonderland_ds.doctor import checkpoint, environment, hosts, ops, toolchain

REPO = Path(__file__).resolve().parents[1]
DS_MINOR_OK = {12: ["12.0", "12.1", "12.2", "12.3", "12.4", "12.5", "12.6", "12.8", "12.9"]}


@pytest.fixture(scope="module")
def report() -> dict:
    """The real command line, as an operator runs it: exit code and clean JSON on stdout."""
    env = {k: v for k, v in os.environ.items() if "NCCL" not in k}
    r = subprocess.run(
        [sys.executable, "-m", "wonderland_ds.cli.main", "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env=env,
    )
    data = json.loads(r.stdout)  # DeepSpeed's own log lines must not reach stdout
    data["returncode"] = r.returncode
    return data


def by_rule(checks: list[dict], rule: str) -> list[dict]:
    return [c for c in checks if c["rule"] == rule]


def test_doctor_json_on_this_machine(report):
    assert report["returncode"] == 0 == report["exit_code"]
    assert set(report) >= {"checks", "summary", "exit_code", "seconds"}
    assert report["summary"]["error"] == 0
    assert report["summary"]["ok"] == sum(c["severity"] == "ok" for c in report["checks"])
    for c in report["checks"]:
        assert set(c) == {"rule", "severity", "message", "fix", "file", "path"}
        assert c["severity"] in ("ok", "info", "warn", "error")
    rules = {c["rule"] for c in report["checks"]}
    for rule in (
        "doctor-python",
        "doctor-torch",
        "doctor-deepspeed",
        "doctor-ds-ops",
        "doctor-jit-cache",
        "doctor-pg-timeout",
        "doctor-async-errors",
        "doctor-ds-env",
        "doctor-disk",
    ):
        assert rule in rules, rule
    (ds,) = by_rule(report["checks"], "doctor-deepspeed")
    assert "deepspeed 0.19" in ds["message"] and "accelerator cpu" in ds["message"]
    op_report = by_rule(report["checks"], "doctor-ds-ops")[0]["message"]
    assert "deepspeed_shm_comm" in op_report


def test_gpu_items_are_not_applicable_here(report):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    for rule in ("doctor-gpu", "doctor-nvcc", "doctor-nccl"):
        (c,) = by_rule(report["checks"], rule)
        assert c["severity"] == "info" and c["message"].startswith("n/a"), c


def test_bad_hostfile_exits_2(tmp_path, capsys):
    bad = tmp_path / "hosts"
    bad.write_text("worker-1 slots = 8\n")
    assert cli.main(["doctor", "--hostfile", str(bad)]) == 2
    out = capsys.readouterr().out
    assert "ERROR [hostfile]" in out and "line 1" in out and "1 failure(s)" in out


def test_unreachable_host_is_a_failure_naming_it(tmp_path):
    hostfile = tmp_path / "hosts"
    hostfile.write_text("doctor-unreachable.invalid slots=8\n")
    found, multi = hosts.check_hosts(str(hostfile))
    assert multi
    bad = [f for f in found if f.rule == "doctor-ssh" and f.severity == "error"]
    assert len(bad) == 1 and "doctor-unreachable.invalid: not reachable by ssh" in bad[0].message
    assert "ssh-copy-id doctor-unreachable.invalid" in bad[0].fix


def test_localhost_only_hostfile_needs_no_ssh(repo):
    found, multi = hosts.check_hosts(str(repo / "hostfiles" / "localhost"))
    assert not multi
    assert [f.severity for f in found] == ["ok"] and "no ssh needed" in found[0].message


def test_nccl_timeout_and_env_file_problems_are_flagged(tmp_path):
    home, cwd = tmp_path / "home", tmp_path / "cwd"
    home.mkdir()
    cwd.mkdir()
    (cwd / ".deepspeed_env").write_text("NCCL_TIMEOUT=1800\n\nTORCH_NCCL_ASYNC_ERROR_HANDLING=1\n")
    env = {"NCCL_TIMEOUT": "1800", "NCCL_ASYNC_ERROR_HANDLING": "0", "DEEPSPEED_TIMEOUT": "600"}
    found = environment.check_env(env, True, home, cwd, None)
    rules = {(f.rule, f.severity) for f in found}
    timeouts = [f for f in found if f.rule == "doctor-nccl-timeout"]
    assert len(timeouts) == 2  # in the environment and in .deepspeed_env
    assert all(f.severity == "warn" and "not an NCCL variable" in f.message for f in timeouts)
    assert "process_group_timeout_s" in timeouts[0].fix
    # the blank line crashes DeepSpeed's launcher (it splits every line on '=')
    (blank,) = [f for f in found if f.rule == "doctor-ds-env" and f.severity == "error"]
    assert blank.path == "line 2"
    assert ("doctor-async-errors", "warn") in rules  # legacy name, and set to 0
    pg = [f for f in found if f.rule == "doctor-pg-timeout"]
    assert pg[0].severity == "warn" and "in minutes (10.0 h)" in pg[0].message


def test_nccl_timeout_in_the_environment_reaches_the_report(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("NCCL_TIMEOUT", "1800")
    assert cli.main(["doctor", "--run-dir", str(tmp_path)]) == 0  # a warning, not a failure
    out = capsys.readouterr().out
    assert "WARN  [doctor-nccl-timeout] NCCL_TIMEOUT=1800" in out


def test_bad_deepspeed_timeout_is_a_failure(tmp_path):
    found = environment.check_env({"DEEPSPEED_TIMEOUT": "10m"}, False, tmp_path, tmp_path, None)
    (pg,) = [f for f in found if f.rule == "doctor-pg-timeout"]
    assert pg.severity == "error" and "importing deepspeed fails" in pg.message


@pytest.mark.parametrize(
    "torch_cuda, release, severity",
    [
        (None, "13.0", "info"),
        ("12.8", "12.8", "ok"),
        ("12.8", "12.6", "ok"),  # DeepSpeed accepts these minor mismatches
        ("12.8", "13.0", "error"),  # the field notes' build failure
        ("12.8", None, "warn"),
    ],
)
def test_nvcc_against_torchs_cuda(torch_cuda, release, severity):
    nvcc = "/usr/local/cuda/bin/nvcc" if release else None
    f = toolchain.compare_cuda(torch_cuda, nvcc, release, False, DS_MINOR_OK)
    assert f.severity == severity, f
    if severity == "error":
        assert "CUDA_HOME=/usr/local/cuda-12.8" in f.fix
        skipped = toolchain.compare_cuda(torch_cuda, nvcc, release, True, DS_MINOR_OK)
        assert skipped.severity == "warn"


def test_stale_build_lock_hangs_starts(tmp_path):
    op = tmp_path / "deepspeed_shm_comm"
    op.mkdir()
    assert ops.check_build_dir(op, op.name).severity == "warn"  # not built yet
    (op / "deepspeed_shm_comm.so").write_bytes(b"")
    assert ops.check_build_dir(op, op.name).severity == "ok"
    (op / "lock").write_text("")
    assert ops.check_build_dir(op, op.name).severity == "warn"  # a build in progress
    f = ops.check_build_dir(op, op.name, now=time.time() + 3600)
    assert f.severity == "error" and "rm " in f.fix


def test_checkpoint_versions_against_installed(tmp_path, capsys):
    tag = tmp_path / "global_step5"
    tag.mkdir()
    meta = {
        "format": "wonderland-ckpt/1",
        "versions": {"deepspeed": "0.14.2", "torch": "2.13.0", "python": "3.10.12"},
    }
    (tag / "wonderland_meta.json").write_text(json.dumps(meta))
    found, size = checkpoint.check_checkpoint(tag)
    assert size > 0
    ds = [f for f in found if f.rule == "doctor-ckpt-versions" and "deepspeed" in f.message]
    assert ds[0].severity == "warn" and "saved with 0.14.2" in ds[0].message
    assert cli.main(["doctor", "--checkpoint", str(tmp_path / "missing")]) == 2
    assert "checkpoint does not exist" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    (f,), _ = checkpoint.check_checkpoint(empty)
    assert f.severity == "error" and "not a checkpoint folder" in f.message
    (empty / "mp_rank_00_model_states.pt").write_bytes(b"not a torch file")
    (f,), _ = checkpoint.check_checkpoint(empty)
    assert f.severity == "error" and "mp_rank_00_model_states.pt" in f.message


def test_needed_ops_follow_the_config():
    assert ops.needed_ops("cpu") == ["deepspeed_shm_comm"]
    adam = {"optimizer": {"type": "AdamW", "params": {}}}
    assert ops.needed_ops("cuda", adam) == ["fused_adam"]
    torch_adam = {"optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    assert ops.needed_ops("cpu", torch_adam) == ["deepspeed_shm_comm"]
    offload = {**adam, "zero_optimization": {"offload_optimizer": {"device": "cpu"}}}
    assert ops.needed_ops("cuda", offload) == ["cpu_adam"]


def test_disk_against_checkpoint_size(tmp_path):
    assert checkpoint.check_disk(tmp_path / "not" / "yet", 1).severity == "ok"
    assert checkpoint.check_disk(tmp_path, 1 << 60).severity == "error"


def test_prebuild_unknown_op_is_refused(tmp_path, capsys):
    assert cli.main(["doctor", "--prebuild", "no_such_op", "--run-dir", str(tmp_path)]) == 2
    out = capsys.readouterr().out
    assert "unknown op(s) ['no_such_op']" in out and "deepspeed_shm_comm" in out


def test_bf16_emulation_is_named_with_the_fp32_config(monkeypatch):
    from wonderland_ds.doctor import cpu

    avx2 = "processor : 0\nflags : fpu sse avx avx2 fma\n"
    sapphire = "processor : 0\nflags : avx2 avx512f avx512_bf16 amx_bf16\n"
    graviton = "processor : 0\nFeatures : fp asimd bf16 i8mm\n"
    assert cpu.bf16_emulated(cpu.cpu_flags(avx2)) is True
    assert cpu.bf16_emulated(cpu.cpu_flags(sapphire)) is False
    assert cpu.bf16_emulated(cpu.cpu_flags(graviton)) is False
    assert cpu.bf16_emulated(set()) is None  # no cpuinfo: cannot tell, no warning
    monkeypatch.setattr(cpu, "has_gpu", lambda: False)
    monkeypatch.setattr(cpu, "cpu_flags", lambda cpuinfo=None: {"avx2"})
    (found,) = cpu.check_bf16("bf16", "c.json")
    assert (
        found.severity == "warn" and "cpu_zero2_fp32" in found.fix and found.path == "bf16.enabled"
    )
    assert cpu.check_bf16("fp32", "c.json") == []
    monkeypatch.setattr(cpu, "has_gpu", lambda: True)  # the stage computes on the GPU
    assert cpu.check_bf16("bf16", "c.json") == []
