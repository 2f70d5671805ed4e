"""CI proves what it claims: ``.ci/run`` stops at its first failing step, and under CI=true a
skipped family or an import that failed is a failure, not a pass."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tests.helpers.util import REPO

FAKE_PYTHON = """#!/usr/bin/env bash
# 'python3 -m venv .venv': a venv whose tools record their call; ruff exits $RUFF_RC.
mkdir -p .venv/bin
for tool in pip ruff mypy pytest; do
    rc=0
    [ "$tool" = ruff ] && rc="${RUFF_RC:-0}"
    printf '#!/usr/bin/env bash\\necho "%s $*" >> "%s/ran"\\nexit %s\\n' "$tool" "$PWD" "$rc" \\
        > ".venv/bin/$tool"
    chmod +x ".venv/bin/$tool"
done
"""


def ci_run(tmp: Path, ruff_rc: int) -> tuple[int, list[str]]:
    """``.ci/run`` as committed, in a copy with a stand-in ``python3`` first on PATH."""
    (tmp / ".ci").mkdir(parents=True)
    shutil.copy(REPO / ".ci" / "run", tmp / ".ci" / "run")
    fake = tmp / "fakebin"
    fake.mkdir()
    (fake / "python3").write_text(FAKE_PYTHON)
    (fake / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", RUFF_RC=str(ruff_rc))
    r = subprocess.run(["bash", str(tmp / ".ci" / "run")], env=env, capture_output=True, text=True)
    ran = (tmp / "ran").read_text().splitlines() if (tmp / "ran").exists() else []
    return r.returncode, ran


def test_ci_stops_at_a_failing_lint_step(tmp_path):
    rc, ran = ci_run(tmp_path / "red", ruff_rc=1)
    assert rc == 1, ran
    assert ran[-1] == "ruff check ." and not any(line.startswith("pytest") for line in ran)
    # The control: with lint green, every step runs, the default suite and every family.
    rc, ran = ci_run(tmp_path / "green", ruff_rc=0)
    assert rc == 0, ran
    assert [line for line in ran if line.startswith("pytest")] == [
        "pytest ",
        "pytest -m proofs",
        "pytest -m multinode",
        "pytest -m slurm",
        "pytest -m matrix or downstream or examples or bench -n 2 --dist loadgroup",
    ]


def run_pytest(folder: Path, ci: bool, *args: str) -> subprocess.CompletedProcess:
    shutil.copy(REPO / "tests" / "conftest.py", folder / "conftest.py")
    env = dict(os.environ, CI="true" if ci else "")
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(folder), *args],
        env=env, capture_output=True, text=True, cwd=folder,
    )  # fmt: skip


def test_a_skipped_family_or_a_failed_import_fails_in_ci(tmp_path):
    (tmp_path / "test_family.py").write_text(
        "import pytest\npytestmark = pytest.mark.slurm\n"
        "def test_cluster():\n    pytest.skip('needs root and network namespaces')\n"
    )
    (tmp_path / "test_dependency.py").write_text(
        "import pytest\npytest.importorskip('no_such_module_here')\ndef test_x():\n    pass\n"
    )
    (tmp_path / "test_honest.py").write_text(
        "import pytest\ndef test_y():\n    pytest.skip('this machine has a GPU')\n"
    )
    outside = run_pytest(tmp_path, False)
    assert outside.returncode == 0, outside.stdout  # outside CI: skips, said in the summary
    assert "3 skipped" in outside.stdout
    # (A module that fails to collect stops a plain run at once, exit 2; here the rest runs too.)
    inside = run_pytest(tmp_path, True, "-rA", "--continue-on-collection-errors")
    assert inside.returncode == 1, inside.stdout
    assert "the slurm family was skipped in CI: needs root" in inside.stdout
    assert "a dependency did not import in CI: could not import 'no_such_module_here'" in (
        inside.stdout
    )
    assert "1 skipped" in inside.stdout  # an honest skip stays one
    # The same on CI's two workers (pytest-xdist): a worker's skipped family fails too.
    workers = run_pytest(tmp_path, True, "-rA", "--continue-on-collection-errors", "-n", "2")
    assert workers.returncode == 1, workers.stdout
    assert "the slurm family was skipped in CI: needs root" in workers.stdout
