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
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.netns import kill_all
from tests.helpers.util import REPO, losses

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
    # (or, when the peers' heartbeat watch came first, "rank R leaving at step N")
    reached = max(int(n) for n in re.findall(r"(?:stage 16 failed at|leaving at) step (\d+)", text))
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


def _power_off(host: str) -> list[int]:
    """What a power loss does to HOST: its link down and its stage processes SIGKILLed (its
    sshd stays for the tests after this one). The pids killed."""
    cluster("link", host, "down")
    return kill_all(host, only=(b"wonderland", b"deepspeed"))


def test_lost_host_the_stage_continues_on_two_with_the_same_global_batch(stage15, tmp_path):
    """--min-nodes: wl-node2 loses power mid-stage 16 (link down, processes SIGKILLed) under a
    600 s process-group timeout; the stage goes on on wl-node0/1 in the same command, is
    stopped there, grows back to three hosts when started again, and its losses are those of
    an uninterrupted 3-host stage 16."""
    src, _ = stage15
    cfg = json.loads(Path(CONFIG).read_text())
    cfg["wonderland"]["process_group_timeout_s"] = 600  # detection must not wait for it
    config = tmp_path / "elastic.json"
    config.write_text(json.dumps(cfg))
    steps, save = 240, cfg["wonderland"]["save_interval"]

    def stage16(run_dir: Path, *flags: str, copy: bool = True) -> list[str]:
        if copy:
            shutil.copytree(src, run_dir, symlinks=True)
        cmd = [str(BIN / "wonderland"), "train", "--config", str(config)]
        cmd += ["--run-dir", str(run_dir), "--stage", "16", "--resume", "auto"]
        return head_cmd([*cmd, "--hostfile", "hostfiles/netns3", "--steps", str(steps), *flags])

    ref_dir = tmp_path / "ref"
    r = subprocess.run(stage16(ref_dir), capture_output=True, text=True, timeout=400, cwd=REPO)
    assert r.returncode == 0, out(r)  # the peers' watch names nobody on a healthy stage
    run_dir = tmp_path / "run"
    env = dict(os.environ)
    env.pop("OMP_NUM_THREADS", None)
    log = (tmp_path / "elastic.log").open("w")
    cmd = stage16(run_dir, "--max-restarts", "1", "--min-nodes", "2")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO, env=env)
    ckpts = run_dir / "stage16" / "checkpoints"
    try:
        deadline = time.time() + 300
        while time.time() < deadline and proc.poll() is None:
            tag = (ckpts / "latest").read_text().strip() if (ckpts / "latest").exists() else ""
            if tag and int(tag.removeprefix("global_step")) >= 48:
                break
            time.sleep(0.2)
        assert proc.poll() is None, "the stage ended before the power loss"
        killed = _power_off("wl-node2")
        t_loss = time.time()
        assert killed, "no stage process ran on wl-node2"
        # Training again on two hosts: the front is then stopped (SIGTERM, as a preemption
        # does), so the stage can be started again on three and grow back.
        heartbeat = run_dir / "stage16" / "heartbeat" / "rank0.json"
        while time.time() < deadline and proc.poll() is None:
            entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
            beat = json.loads(heartbeat.read_text()) if heartbeat.exists() else {}
            if entry.get("world_size") == 2 and (beat.get("step") or 0) >= 60:
                break
            time.sleep(0.1)
        assert proc.poll() is None, "the stage ended before the stop"
        os.kill(entry["front"]["pid"], signal.SIGTERM)
        rc = proc.wait(timeout=400)
    finally:
        if proc.poll() is None:
            proc.kill()
        cluster("link", "wl-node2", "up")
    text = (tmp_path / "elastic.log").read_text()
    assert rc == 4, text[-5000:]  # stopped, saved
    assert "lost wl-node2" in text and "continuing on 2 node(s) (wl-node0, wl-node1)" in text, text
    assert "global batch 96 kept: 8 x 4 x 3 becomes 8 x 6 x 2" in text, text
    entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "preempted" and entry["world_size"] == 2, entry
    assert entry["grad_acc"] == 6 and entry["stop"]["saved"], entry
    assert "resharding at load time" in text, text[-5000:]  # 3 saved partitions onto 2
    assert [x["host"] for x in ranks(run_dir, 16)] == HOSTS[:2]
    (event,) = entry["elastic"]
    assert event["kind"] == "shrink" and event["lost_hosts"] == ["wl-node2"], event
    assert (event["from_world"], event["to_world"], event["global_batch"]) == (3, 2, 96)
    assert event["grad_acc"] == [4, 6] and 0 <= event["steps_lost"] <= save, event
    assert event["training_again_s"] is not None and event["detect_s"] < 30, event
    (restart,) = entry["restarts"]
    assert restart["excluded_hosts"] == ["wl-node2"], restart
    status = subprocess.run(
        [str(BIN / "wonderland"), "status", "--run-dir", str(run_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "shrank 3 -> 2 ranks" in status.stdout, status.stdout
    # Grown back: started again on the three hosts, the stage reshards up, the batch the same.
    r = subprocess.run(
        stage16(run_dir, "--min-nodes", "2", copy=False),
        capture_output=True,
        text=True,
        timeout=400,
        cwd=REPO,
    )
    assert r.returncode == 0, out(r)
    assert "growing back from 2 to 3 ranks" in r.stdout and "accumulation 6 -> 4" in r.stdout
    entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
    grow = entry["elastic"][1]
    assert (grow["kind"], grow["from_world"], grow["to_world"]) == ("grow", 2, 3), grow
    assert grow["grad_acc"] == [6, 4] and grow["training_again_s"] is not None, grow
    assert entry["status"] == "ok" and entry["world_size"] == 3 and entry["grad_acc"] == 4
    assert entry["resume"]["load"] == "resharded" and entry["resume"]["from_world_size"] == 2
    config16 = json.loads((run_dir / "stage16" / "ds_config.json").read_text())
    assert config16["train_batch_size"] == 96
    assert [x["host"] for x in ranks(run_dir, 16)] == HOSTS
    # The same training, 3 -> 2 -> 3 hosts: every step's loss equals the uninterrupted run's.
    got, ref = losses(run_dir / "stage16"), losses(ref_dir / "stage16")
    assert sorted(got) == sorted(ref) and len(got) > 200
    worst = max(abs(got[s] - ref[s]) for s in ref)
    assert worst < 1e-3, worst
    print(
        f"lost host: training again {event['training_again_s']} s after its last heartbeat"
        f" (detected after {event['detect_s']} s), {event['steps_lost']} steps lost,"
        f" worst loss difference {worst:.2e}; {time.time() - t_loss:.0f} s to the end"
    )
