from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

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


#: Families whose skip in CI would hide that they never ran.
CI_FAMILIES = ("slurm", "matrix", "multinode", "downstream", "examples", "bench", "proofs")


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def ci_failure(node: Any, reason: str) -> str | None:
    """Why a skip fails under CI=true (None: an honest skip). A marked family that did not run,
    a test whose dependency would not import (``importorskip``), a GPU test on a host with an
    NVIDIA device that torch cannot use: each is a broken setup there, not a pass."""
    if not in_ci():
        return None
    marks = {m.name for m in node.iter_markers()}
    family = next((f for f in CI_FAMILIES if f in marks), None)
    if family is not None:
        return f"the {family} family was skipped in CI: {reason}"
    if reason.startswith("could not import"):
        return f"a dependency did not import in CI: {reason}"
    if "gpu" in marks and Path("/dev/nvidia0").exists() and reason.startswith("needs a CUDA GPU"):
        return f"an NVIDIA device is here but the gpu test was skipped: {reason}"
    return None


def _skip_reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        why = ci_failure(item, _skip_reason(report))
        if why is not None:
            report.outcome, report.longrepr = "failed", why


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector):
    """A module skipped at import (``importorskip`` at its top) fails too, under CI=true."""
    outcome = yield
    report = outcome.get_result()
    if report.skipped:
        why = ci_failure(collector, _skip_reason(report))
        if why is not None:
            report.outcome, report.longrepr = "failed", why


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
