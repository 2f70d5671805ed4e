"""wonderland_ds installed from its wheel (not editable), run from another folder: the shipped
configs and hostfiles come along as package data, and the ranks run the installed
``wonderland_ds.train`` as a module. Built without network and without reinstalling the
dependencies (they come from this environment)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest

from tests.helpers.util import REPO

#: What the wheel is built from: a copy, so the build writes nothing into the checkout.
SOURCES = ("pyproject.toml", "setup.py", "README.md", "wonderland_ds", "ds_configs", "hostfiles")


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """The folder the wheel was installed into (``pip install --target``)."""
    root = tmp_path_factory.mktemp("install")
    src = root / "src"
    src.mkdir()
    for name in SOURCES:
        if (REPO / name).is_dir():
            ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
            shutil.copytree(REPO / name, src / name, ignore=ignore)
        else:
            shutil.copy2(REPO / name, src / name)
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    offline = ["--no-deps", "--no-build-isolation", "--no-index"]
    wheels = root / "wheels"
    built = subprocess.run(
        [*pip, "wheel", *offline, "--wheel-dir", str(wheels), str(src)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = wheels.glob("wonderland_ds-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for folder, pattern in (("ds_configs", "*.json"), ("hostfiles", "*")):
        for path in (REPO / folder).glob(pattern):
            assert f"wonderland_ds/shipped/{folder}/{path.name}" in names, path.name
    assert "wonderland_ds/train.py" in names and "wonderland_ds/launch/plan.py" in names
    target = root / "site"
    done = subprocess.run(
        [*pip, "install", *offline, "--target", str(target), str(wheel)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return target


def _run(installed: Path, cwd: Path, *argv: str, timeout: int = 120):
    """``argv`` from ``cwd`` with only the installed copy of wonderland_ds importable."""
    env = dict(os.environ, PYTHONPATH=str(installed), OMP_NUM_THREADS="1")
    return subprocess.run(
        list(argv), capture_output=True, text=True, timeout=timeout, cwd=cwd, env=env
    )


def _wonderland(installed: Path, cwd: Path, *argv: str, timeout: int = 120):
    return _run(installed, cwd, str(installed / "bin" / "wonderland"), *argv, timeout=timeout)


def test_the_installed_copy_is_the_one_imported(installed, tmp_path):
    code = "import wonderland_ds.train, wonderland_ds.config.shipped as s; print(s.folder('ds_configs'))"
    got = _run(installed, tmp_path, sys.executable, "-c", code)
    assert got.returncode == 0, got.stderr[-2000:]
    assert Path(got.stdout.strip()) == installed / "wonderland_ds" / "shipped" / "ds_configs"
    entry = _run(installed, tmp_path, sys.executable, "-m", "wonderland_ds.train", "--help")
    assert entry.returncode == 0 and "--stage" in entry.stdout, entry.stderr[-2000:]


def test_configs_lists_the_shipped_files_of_the_installed_copy(installed, tmp_path):
    got = _wonderland(installed, tmp_path, "configs", "--json")
    assert got.returncode == 0, got.stderr[-2000:]
    listed = json.loads(got.stdout)
    configs = {c["name"]: c for c in listed["configs"]}
    assert set(configs) == {p.stem for p in (REPO / "ds_configs").glob("*.json")}
    a100 = configs["a100x8_zero2_fp16"]
    assert (a100["zero_stage"], a100["precision"], a100["world_size"]) == (2, "fp16", 8)
    assert configs["cpu_zero2_bf16"]["world_size"] is None  # derived from the world
    assert all(c["valid"] and c["path"].startswith(str(installed)) for c in configs.values())
    hostfiles = {h["name"]: h for h in listed["hostfiles"]}
    assert hostfiles["a100x8"]["world_size"] == 8 and hostfiles["localhost"]["hosts"] == 1
    text = _wonderland(installed, tmp_path, "configs")
    assert text.returncode == 0 and "a100x8_zero2_fp16" in text.stdout


def test_a_dry_run_by_shipped_names_from_the_installed_copy(installed, tmp_path):
    run = tmp_path / "run"
    got = _wonderland(
        installed,
        tmp_path,
        *("train", "--stage", "15", "--dry-run", "--json", "--run-dir", str(run)),
        *("--config", "a100x8_zero2_fp16", "--hostfile", "a100x8"),
    )
    assert got.returncode == 0, got.stderr[-3000:]
    report = json.loads(got.stdout)
    cmd = report["command"]
    assert report["world_size"] == 8 and report["deepspeed_config"]["train_batch_size"] == 256
    assert cmd[cmd.index("--module") + 1] == "wonderland_ds.train"
    shipped = installed / "wonderland_ds" / "shipped"
    assert cmd[cmd.index("--config") + 1] == str(shipped / "ds_configs" / "a100x8_zero2_fp16.json")
    assert cmd[cmd.index("--hostfile") + 1] == str(shipped / "hostfiles" / "a100x8")
    assert not [c for c in cmd[1:] if str(REPO) in c]  # nothing of this checkout (the venv is)
    assert not run.exists()  # a dry run writes nothing


@pytest.mark.nightly
def test_the_pipeline_runs_from_the_installed_copy(installed, tmp_path):
    run = tmp_path / "run"
    started = time.time()
    got = _wonderland(
        installed,
        tmp_path,
        *("pipeline", "--from", "15", "--to", "17", "--config", "cpu_zero2_fp32"),
        *("--run-dir", str(run)),
        timeout=1500,
    )
    assert got.returncode == 0, (got.stdout + got.stderr)[-4000:]
    stages = json.loads((run / "run.json").read_text())["stages"]
    assert [stages[k]["status"] for k in ("15", "16", "17")] == ["ok", "ok", "ok"]
    assert (run / "stage17" / "report.json").is_file()
    print(f"pipeline 15 -> 17 from the installed copy: {time.time() - started:.0f} s")
