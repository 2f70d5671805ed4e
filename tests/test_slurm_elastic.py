"""A node lost inside a Slurm job: a 3-node ``sbatch --no-kill`` stage 16 whose third node
loses power (its link down, its processes SIGKILLed, slurmd with them) finishes on the two
nodes left, in the same job, from its newest checkpoint, with the losses of an uninterrupted
3-node stage 16 (tests/slurm/cluster.sh, three nodes).

Root only; deselected by default (about 4 minutes), `.ci/run` runs it with the slurm family:

    .venv/bin/pytest -m slurm tests/test_slurm_elastic.py -v
"""

from __future__ import annotations

import json
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import TINY32
from tests.helpers.netns import kill_all
from tests.helpers.slurm import SlurmCluster, cluster_of
from tests.helpers.util import losses
from tests.test_slurm import _copy_stage15, _stage16_script, _until_step

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
STEPS = 160
NODES = ["wls-node0", "wls-node1", "wls-node2"]


@pytest.fixture(scope="module")
def slurm():
    yield from cluster_of(3)


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> str:
    cfg = json.loads(Path(TINY32).read_text())
    # 8 x 2 x 3 nodes = stage 15's global batch of 48; on 2 nodes: 8 x 3 x 2.
    cfg["gradient_accumulation_steps"] = 2
    cfg["wonderland"].update(
        {
            "save_interval": 20,
            "log_interval": 20,
            "keep_last": 3,
            "process_group_timeout_s": 600,  # the loss is found without it
            "max_restarts": 1,
            "elastic": {"min_nodes": 2},
        }
    )
    path = tmp_path_factory.mktemp("slurm_elastic") / "config.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _job(slurm: SlurmCluster, script: str, out: Path) -> int:
    return slurm.sbatch(
        script,
        "--nodes=3",
        "--ntasks-per-node=1",
        "--no-kill",
        f"--output={out}",
        "--open-mode=append",
    )


def _power_off(node: str) -> list[int]:
    """Node's link down and every process in its namespace SIGKILLed (slurmd included)."""
    subprocess.run(["ip", "-n", node, "link", "set", "eth0", "down"], check=True)
    return kill_all(node)


def test_a_lost_node_the_job_finishes_on_the_two_left(slurm, stage15_fp32, config, tmp_path):
    ref = _copy_stage15(stage15_fp32, tmp_path / "ref")
    job = _job(slurm, _stage16_script(config, ref, STEPS), tmp_path / "ref.out")
    info = slurm.wait_state(job, "COMPLETED", timeout=400)
    assert info["JobState"] == "COMPLETED", (tmp_path / "ref.out").read_text()[-3000:]
    assert (
        sorted(r["host"] for r in json.loads((ref / "stage16" / "ranks.json").read_text())) == NODES
    )

    run = _copy_stage15(stage15_fp32, tmp_path / "run")
    out = tmp_path / "out"
    # The stage runs its 160 steps in a few seconds, faster than heartbeats (every 2 s) show
    # them: rank 0's save of step 100 waits 30 s, a window in which the node is surely lost.
    hold = "slow@save-before-meta:step=100:until=100:factor=30"
    job = _job(slurm, _stage16_script(config, run, STEPS, "--fault", hold), out)
    reached = _until_step(run, 100)
    killed = _power_off("wls-node2")
    t_loss = time.time()
    assert killed, "nothing ran on wls-node2"
    assert reached < 40 + STEPS, f"the stage had finished (step {reached}) before the loss"
    info = slurm.wait_state(job, "COMPLETED", timeout=400)
    log = out.read_text()
    assert info["JobState"] == "COMPLETED", log[-5000:]
    assert "FAULT INJECTED: slow at save-before-meta" in log, log[-5000:]
    took = time.time() - t_loss
    assert "lost wls-node2" in log and "continuing on 2 node(s) (wls-node0, wls-node1)" in log, log
    assert "global batch 48 kept: 8 x 2 x 3 becomes 8 x 3 x 2" in log, log[-5000:]
    entry = json.loads((run / "run.json").read_text())["stages"]["16"]
    assert entry["status"] == "ok" and entry["world_size"] == 2 and entry["grad_acc"] == 3, entry
    assert entry["resume"]["load"] == "resharded" and entry["resume"]["from_world_size"] == 3
    hosts = sorted(r["host"] for r in json.loads((run / "stage16" / "ranks.json").read_text()))
    assert hosts == NODES[:2]
    (event,) = entry["elastic"]
    assert event["kind"] == "shrink" and event["lost_hosts"] == ["wls-node2"], event
    # Saves run in the background: the held save of step 100 is still in flight when the node
    # goes (training waits for it at step 120), so the newest complete checkpoint is step 80.
    assert event["resumed_from_step"] == 80 and event["grad_acc"] == [2, 3], event
    assert event["steps_lost"] == event["last_heartbeat_step"] - 80 <= 40, event
    # The bar: training again within 60 s of the loss (from the node's last heartbeat).
    assert event["training_again_s"] is not None and event["training_again_s"] < 60, event
    got, want = losses(run / "stage16"), losses(ref / "stage16")
    assert sorted(got) == sorted(want)
    worst = max(abs(got[s] - want[s]) for s in want)
    assert worst < 1e-3, worst
    print(
        f"slurm lost node: detected {event['detect_s']} s, relaunched {event['relaunch_s']} s,"
        f" training again {event['training_again_s']} s after its last heartbeat;"
        f" {event['steps_lost']} steps lost; worst loss difference {worst:.1e}; job done"
        f" {took:.0f} s after the loss"
    )
