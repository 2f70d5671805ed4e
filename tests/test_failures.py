"""The first failure named: a rank's own error before the peers' lost connections, a rank
killed without a record found from its heartbeat, and the stage summary and run.json telling
it after a real SIGKILL of one rank."""

from __future__ import annotations

import json
import shutil
import signal
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


def test_a_rank_a_peer_found_hung_is_named_by_that_peers_report(tmp_path):
    """Frozen, then killed (the launcher kills a stopped rank 30 s after the others fail): the
    peer's timeout that named it tells what happened, not "died without reporting"."""
    text = (
        "a collective timed out after 20 s; rank 1 (node7) did not answer within 5 s: hung or"
        " dead (DistBackendError: wait timeout)"
    )
    failures.record(tmp_path, 0, RuntimeError(text))
    first = failures.first_failure(tmp_path, 0.0, [(1, "node7")], tmp_path / "logs")
    assert first is not None and (first.rank, first.host) == (1, "node7")
    assert first.summary.startswith("rank 0 reported: RuntimeError: a collective timed out")
    assert "died without reporting" not in first.summary and "consequence" not in first.summary
    # The control: a rank that died while the peer's report names another one is still silent.
    other = failures.first_failure(tmp_path, 0.0, [(2, "node8")], tmp_path / "logs")
    assert other is not None and "rank 2 on node8 died without reporting" in other.summary


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


def test_a_rank_that_fails_starting_its_process_group_is_named(tmp_path, monkeypatch):
    """An error before the stage's own record (here the process group's start) still leaves
    the rank's record, so the front names it rather than guessing at the port."""
    from wonderland_ds import train
    from wonderland_ds.core import distributed

    def broken(timeout_s: int) -> None:
        raise RuntimeError("CUDA error: invalid device ordinal")

    monkeypatch.setattr(distributed, "init", broken)
    monkeypatch.setattr(failures, "_recorded", False)
    monkeypatch.setenv("RANK", "1")
    run = tmp_path / "run"
    argv = ["--stage", "15", "--config", TINY32, "--run-dir", str(run)]
    since = time.time() - 1
    kept = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT)}
    try:
        with pytest.raises(RuntimeError, match="invalid device ordinal"):
            train.main(argv)
    finally:  # the rank entry installs its stop signals for the process: not for the suite's
        for s, handler in kept.items():
            signal.signal(s, handler)
    (got,) = failures.read(run / "stage15", since)
    assert got.rank == 1 and got.error == "RuntimeError: CUDA error: invalid device ordinal"
    first = failures.first_failure(run / "stage15", since, [], run / "stage15" / "logs")
    assert first is not None and first.summary.startswith(f"rank 1 on {got.host} failed first")


def test_a_port_left_in_time_wait_is_free_and_a_listened_one_is_not():
    """torch's TCPStore binds with SO_REUSEADDR: connections of a launch that just ended,
    lingering in TIME_WAIT, do not make its port taken."""
    from wonderland_ds.launch import command

    server = socket.socket()
    server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    server.bind(("127.0.0.1", 0))
    server.listen()
    port = server.getsockname()[1]
    assert not command.port_free(port)  # listened on
    client = socket.create_connection(("127.0.0.1", port))
    conn, _ = server.accept()
    conn.close()  # the server's side closes first: its end of the connection is in TIME_WAIT
    client.close()
    server.close()
    time.sleep(0.1)
    plain = socket.socket()
    with pytest.raises(OSError):  # the TIME_WAIT really is there: a plain bind is refused
        plain.bind(("", port))
    plain.close()
    assert command.port_free(port)
