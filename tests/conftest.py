from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "corpus" / "public_ds_configs"
TINY32 = str(REPO / "tests" / "configs" / "tiny_zero2_fp32.json")


def gpu_skip_reason() -> str | None:
    """Why the ``gpu`` tests cannot run here (None: a CUDA device is visible)."""
    import torch

    if not torch.cuda.is_available():
        return (
            f"needs a CUDA GPU: torch {torch.__version__} sees none"
            f" (CUDA build: {torch.version.cuda or 'none'})"
        )
    if torch.cuda.device_count() < 1:
        return "needs a CUDA GPU: no device is visible (CUDA_VISIBLE_DEVICES?)"
    return None


def pytest_collection_modifyitems(config, items) -> None:
    """Skip every ``gpu``-marked test, with the reason, on a machine without CUDA."""
    marked = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not marked:
        return  # torch is not imported for a run that selects no gpu test
    reason = gpu_skip_reason()
    if reason is not None:
        for item in marked:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture(scope="session", autouse=True)
def _clean_dev_shm():
    """Test helpers launch plain DeepSpeed too; DeepSpeed never removes its /dev/shm buffers."""
    import glob
    import time

    start = time.time()
    yield
    for path in glob.glob(f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_*"):
        try:
            if os.stat(path).st_mtime >= start - 1:
                os.unlink(path)
        except OSError:
            pass


@pytest.fixture
def repo() -> Path:
    return REPO


@pytest.fixture(scope="session")
def stage15_fp32(tmp_path_factory) -> Path:
    """A real stage-15 run: 2 gloo ranks, ZeRO-2, fp32, 40 steps, a save every 10."""
    from tests.helpers.util import wonderland

    run = tmp_path_factory.mktemp("reference") / "run"
    result = wonderland("train", "--stage", "15", "--config", TINY32, "--run-dir", str(run))
    assert result.returncode == 0, (result.stdout + result.stderr)[-4000:]
    return run


@pytest.fixture(scope="session")
def plain_ds_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """Checkpoints written by a plain DeepSpeed script (no wonderland), with and without an
    LR scheduler: what other teams hand over."""
    from wonderland_ds.launch.command import free_port

    out = {}
    for name, extra in (("plain", []), ("no_scheduler", ["--no-scheduler"])):
        target = tmp_path_factory.mktemp(name)
        env = dict(
            os.environ,
            RANK="0",
            WORLD_SIZE="1",
            LOCAL_RANK="0",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(free_port()),
        )
        result = subprocess.run(
            [
                sys.executable,
                str(REPO / "tests" / "helpers" / "plain_ds_save.py"),
                str(target),
                *extra,
            ],
            capture_output=True,
            text=True,
            timeout=180,
            env=env,
            cwd=REPO,
        )
        assert result.returncode == 0, result.stderr[-3000:]
        out[name] = target
    return out
