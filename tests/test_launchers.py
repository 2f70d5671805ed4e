"""train.py runs under DeepSpeed's own launcher and under mpirun (mpi4py discovery)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import TINY32
from tests.helpers.util import REPO
from wonderland_ds.launch.command import free_port

pytestmark = pytest.mark.slow
BIN = Path(sys.executable).parent
TRAIN = str(REPO / "wonderland_ds" / "train.py")


def run(cmd: list[str]) -> subprocess.CompletedProcess:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        OMPI_ALLOW_RUN_AS_ROOT="1",
        OMPI_ALLOW_RUN_AS_ROOT_CONFIRM="1",
    )
    return subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)


def test_mpirun_with_mpi4py_discovery(tmp_path):
    r = run(
        [
            str(BIN / "mpirun"),
            "-np",
            "2",
            sys.executable,
            TRAIN,
            "--stage",
            "15",
            "--config",
            TINY32,
            "--run-dir",
            str(tmp_path / "run"),
            "--steps",
            "5",
        ]
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    meta = json.loads(
        (
            tmp_path / "run" / "stage15" / "checkpoints" / "global_step5" / "wonderland_meta.json"
        ).read_text()
    )
    assert meta["world_size"] == 2 and meta["data"]["samples_consumed"] == 5 * 48


def test_plain_deepspeed_launcher_and_a_refusal_exits_2(stage15_fp32, tmp_path):
    """`deepspeed --hostfile ... wonderland_ds/train.py` with the field notes' flags; the
    40-step checkpoint is refused for stage 16 (500 warmup steps needed) on every rank."""
    before = sorted(p.name for p in stage15_fp32.rglob("*"))
    r = run(
        [
            str(BIN / "deepspeed"),
            "--hostfile",
            str(REPO / "hostfiles" / "localhost"),
            "--no_ssh_check",
            "--master_addr",
            "127.0.0.1",
            "--master_port",
            str(free_port()),
            TRAIN,
            "--stage",
            "16",
            "--config",
            TINY32,
            "--run-dir",
            str(stage15_fp32),
            "--resume",
            str(stage15_fp32 / "stage15" / "checkpoints"),
            "--optimizer-state",
            "--scheduler-state",
            "--grad-acc-steps",
            "8",
            "--min-warmup-steps",
            "500",
        ]
    )
    out = r.stdout + r.stderr
    assert r.returncode == 2, out[-3000:]
    assert "only 40 LR-warmup steps are behind this checkpoint" in out
    assert "Traceback" not in out
    assert sorted(p.name for p in stage15_fp32.rglob("*")) == before
