"""Stage 15/16 across three hosts made of network namespaces (tests/multinode/cluster.sh).

Root only; deselected by default (about 3 minutes), `.ci/run` runs it. Run it with:

    .venv/bin/pytest -m multinode -v   # the fixture installs the deps and builds the hosts

What runs, through DeepSpeed's own multi-node launchers from the head node wl-node0:
``wonderland train`` over pdsh/ssh, ``wonderland train --launcher openmpi`` (mpirun, mpi4py
discovery), and the plain ``deepspeed --hostfile hostfiles/netns3 wonderland_ds/train.py``.
Network faults are real: one host's packets delayed 50 ms, then its link cut mid-stage and the
stage resumed on the two remaining hosts, resharded at load time.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.util import REPO

pytestmark = [pytest.mark.multinode, pytest.mark.slow]
CLUSTER = REPO / "tests" / "multinode" / "cluster.sh"
CONFIG = str(REPO / "tests" / "configs" / "multinode.json")
BIN = Path(sys.executable).parent
HOSTS = ["wl-node0", "wl-node1", "wl-node2"]
PG_TIMEOUT = json.loads(Path(CONFIG).read_text())["wonderland"]["process_group_timeout_s"]


def cluster(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(CLUSTER), *args], capture_output=True, text=True, check=check, timeout=300
    )


def head_cmd(cmd: list[str]) -> list[str]:
    """CMD on the head node, with the interface gloo must use on these hosts."""
    return ["bash", str(CLUSTER), "exec", "wl-node0", "env", "GLOO_SOCKET_IFNAME=eth0", *cmd]


def on_head(cmd: list[str], timeout: int = 400) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)  # let `wonderland train` derive it per host
    return subprocess.run(
        head_cmd(cmd), capture_output=True, text=True, timeout=timeout, cwd=REPO, env=env
    )


def train(run_dir: Path, *flags: str, timeout: int = 400) -> subprocess.CompletedProcess:
    cmd = [str(BIN / "wonderland"), "train", "--config", CONFIG, "--run-dir", str(run_dir)]
    return on_head([*cmd, *flags], timeout)


def out(r: subprocess.CompletedProcess) -> str:
    return (r.stdout + r.stderr)[-6000:]


@pytest.fixture(scope="module")
def hosts():
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("the namespace cluster needs root and iproute2")
    cluster("deps")
    cluster("up", "3")
    yield HOSTS
    cluster("down")


@pytest.fixture(scope="module")
def stage15(hosts, tmp_path_factory):
    """Stage 15 on three hosts through `wonderland train` (pdsh over ssh)."""
    run_dir = tmp_path_factory.mktemp("mn") / "run"
    r = train(run_dir, "--stage", "15", "--hostfile", "hostfiles/netns3")
    assert r.returncode == 0, out(r)
    return run_dir, r


def ranks(run_dir: Path, stage: int) -> list[dict]:
    return json.loads((run_dir / f"stage{stage}" / "ranks.json").read_text())


def test_pdsh_three_hosts_and_the_environment_reaches_every_host(stage15):
    run_dir, r = stage15
    table = ranks(run_dir, 15)
    assert [x["host"] for x in table] == HOSTS, table
    # What the ranks recorded, not DeepSpeed's log line: pdsh started DeepSpeed's per-node
    # launch.py on each of the three hosts, which numbered its node.
    launched = [x["launched_by"] for x in table]
    assert launched == [
        {"CROSS_RANK": str(n), "CROSS_SIZE": "3", "LOCAL_SIZE": "1"} for n in range(3)
    ], launched
    carried = (run_dir / ".deepspeed_env").read_text()
    assert "TORCH_NCCL_ASYNC_ERROR_HANDLING=1" in carried and "GLOO_SOCKET_IFNAME=eth0" in carried
    for x in table:
        # The process-group timeout the groups really got, and .deepspeed_env's variables, on
        # every host (only wl-node0's shell had GLOO_SOCKET_IFNAME; pdsh exported the rest).
        assert x["process_group_timeout_s"] == PG_TIMEOUT, x
        assert x["env"]["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1", x
        assert x["env"]["GLOO_SOCKET_IFNAME"] == "eth0", x
        assert x["env"]["MASTER_ADDR"] == "10.77.0.11", x  # DeepSpeed asked `hostname -I`
    check = json.loads((run_dir / "stage15" / "allreduce_check.json").read_text())
    assert [x["host"] for x in check["ranks"]] == HOSTS
    assert all(x["allreduce_ok"] for x in check["ranks"])
    tag = (run_dir / "stage15" / "checkpoints" / "latest").read_text().strip()
    meta = json.loads(
        (run_dir / "stage15" / "checkpoints" / tag / "wonderland_meta.json").read_text()
    )
    assert meta["world_size"] == 3 and meta["global_step"] == 24


def test_openmpi_launcher_with_mpi4py_discovery(hosts, tmp_path):
    run_dir = tmp_path / "run"
    r = train(run_dir, "--stage", "15", "--hostfile", "hostfiles/netns3", "--launcher", "openmpi")
    assert r.returncode == 0, out(r)
    table = ranks(run_dir, 15)
    assert [x["host"] for x in table] == HOSTS, table
    # mpirun started all three ranks itself: Open MPI's numbering, no per-node launch.py.
    launched = [x["launched_by"] for x in table]
    assert launched == [
        {"OMPI_COMM_WORLD_RANK": str(n), "OMPI_COMM_WORLD_SIZE": "3"} for n in range(3)
    ], launched
    # No LOCAL_RANK/RANK from a DeepSpeed per-node launcher: mpi4py told each rank who it is.
    assert all(x["env"]["MASTER_ADDR"] == "10.77.0.11" for x in table), table


def test_slow_host_is_named_at_stage_start_and_while_training(stage15, tmp_path):
    """50 ms on every packet wl-node2 sends; the plain deepspeed command (design card)."""
    src, _ = stage15
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir, symlinks=True)
    cluster("netem", "wl-node2", "delay", "50ms")
    try:
        cmd = [str(BIN / "deepspeed"), "--hostfile", "hostfiles/netns3", "wonderland_ds/train.py"]
        cmd += ["--stage", "16", "--config", CONFIG, "--run-dir", str(run_dir)]
        cmd += ["--resume", "auto", "--steps", "8"]
        t0 = time.time()
        r = subprocess.run(
            head_cmd([f"DS_ENV_FILE={run_dir / '.deepspeed_env'}", *cmd]),
            capture_output=True,
            text=True,
            timeout=400,
            cwd=REPO,
        )
        took = time.time() - t0
    finally:
        cluster("netem", "wl-node2", "clear")
    assert r.returncode == 0, out(r)  # slow is a warning by default
    check = json.loads((run_dir / "stage16" / "allreduce_check.json").read_text())
    slow = [e for e in check["events"] if e["guard"] == "slow-rank"]
    assert slow and {e["host"] for e in slow} == {"wl-node2"}, check
    events = [json.loads(line) for line in (run_dir / "stage16" / "guards.jsonl").open()]
    comm = [e for e in events if e["guard"] == "slow-comm"]
    assert comm and {e["host"] for e in comm} == {"wl-node2"}, events
    print(f"slow host: named at stage start, in training at step {comm[0]['step']}; {took:.0f} s")


def test_cut_host_fails_within_the_timeout_and_resumes_on_two_hosts(stage15, tmp_path):
    src, _ = stage15
    run_dir = tmp_path / "run"
    shutil.copytree(src, run_dir, symlinks=True)
    cmd = [str(BIN / "wonderland"), "train", "--config", CONFIG, "--run-dir", str(run_dir)]
    cmd += ["--stage", "16", "--resume", "auto", "--hostfile", "hostfiles/netns3"]
    cmd += ["--steps", "300"]
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    log = (tmp_path / "cut.log").open("w")
    proc = subprocess.Popen(head_cmd(cmd), stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    ckpts = run_dir / "stage16" / "checkpoints"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            latest = ckpts / "latest"
            if (
                latest.exists()
                and int(latest.read_text().strip().removeprefix("global_step")) >= 48
            ):
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the stage ended before the cut"
        cluster("link", "wl-node2", "down")
        t_cut = time.time()
        rc = proc.wait(timeout=PG_TIMEOUT + 120)
        t_fail = time.time() - t_cut
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster("link", "wl-node2", "up")
    text = (tmp_path / "cut.log").read_text()
    assert rc not in (0, 2), text[-4000:]
    entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "failed" and "wl-node2" in entry["error"], entry
    assert "wl-node2" in text
    # Failed within the timeout (plus ssh keep-alive and teardown), not after DeepSpeed's 30 min.
    assert t_fail < PG_TIMEOUT + 60, t_fail
    # "stage 16 failed at step N of M": how far the run got; the newest complete checkpoint
    # is where the resume starts. Lost work is at most the save interval.
    reached = int(re.search(r"stage 16 failed at step (\d+) of", text).group(1))
    saved = int((ckpts / "latest").read_text().strip().removeprefix("global_step"))
    lost = reached - saved
    assert 0 <= lost <= json.loads(Path(CONFIG).read_text())["wonderland"]["save_interval"]
    # The remaining two hosts continue, the 3 saved partitions resharded at load time.
    r = train(run_dir, "--stage", "16", "--resume", "auto", "--hostfile", "hostfiles/netns2")
    assert r.returncode == 0, out(r)
    assert "resharding at load time" in r.stdout and "(resharded)" in r.stdout, out(r)
    assert [x["host"] for x in ranks(run_dir, 16)] == HOSTS[:2]
    entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "ok" and entry["world_size"] == 2, entry
    assert entry["resume"]["load"] == "resharded" and entry["resume"]["from_world_size"] == 3
    done = (ckpts / "latest").read_text().strip()
    meta = json.loads((ckpts / done / "wonderland_meta.json").read_text())
    assert meta["world_size"] == 2 and meta["global_step"] > saved
    print(
        f"cut host: failed {t_fail:.1f} s after the cut (timeout {PG_TIMEOUT} s); {lost} steps lost"
    )
