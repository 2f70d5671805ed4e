"""The first failure named: a rank's own error before the peers' lost connections, a rank
killed without a record found from its heartbeat, and the stage summary and run.json telling
it after a real SIGKILL of one rank."""

from __future__ import annotations

import json
import shutil
import socket
import time

import pytest

from tests.conftest import TINY32
from tests.helpers.util import wonderland
from wonderland_ds.run import failures


def test_the_cause_comes_before_the_consequences(tmp_path):
    since = time.time() - 1
    failures.record(tmp_path, 0, RuntimeError("Connection closed by peer"))
    time.sleep(0.01)
    failures.record(tmp_path, 1, IndexError("index out of range in self"))
    first = failures.first_failure(tmp_path, since, [], tmp_path / "logs")
    assert first is not None and first.rank == 1 and first.host == socket.gethostname()
    assert first.summary.startswith(f"rank 1 on {first.host} failed first: IndexError")
    assert "consequence (rank 0: RuntimeError: Connection closed by peer)" in first.summary
    assert failures.first_failure(tmp_path, time.time() + 5, [], tmp_path) is None  # older


def test_a_rank_gone_without_a_record_is_named(tmp_path):
    failures.record(tmp_path, 0, TimeoutError("timed out waiting for rank 1"))
    first = failures.first_failure(tmp_path, 0.0, [(1, "node7")], tmp_path / "logs")
    assert first is not None and (first.rank, first.host) == (1, "node7")
    assert "died without reporting an error" in first.summary and "consequence" in first.summary


@pytest.mark.slow
def test_a_killed_rank_is_named_first_in_the_summary_and_run_json(stage15_fp32, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    stage16 = ["train", "--stage", "16", "--config", TINY32, "--run-dir", str(run)]
    stage16 += ["--resume", "auto", "--optimizer-state", "--scheduler-state"]
    result = wonderland(*stage16, "--fault", "kill@step:step=45:rank=1", timeout=400)
    err = result.stderr
    assert result.returncode != 0 and "FAULT INJECTED: kill" in err, err[-3000:]
    assert "rank 1 on " in err and "died without reporting an error" in err, err[-3000:]
    assert "Traceback" not in err + result.stdout  # each rank's traceback is in its log file
    entry = json.loads((run / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "failed" and entry["failed_rank"] == 1
    assert "died without reporting an error" in entry["error"]
