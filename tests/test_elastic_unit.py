"""A lost node, in pieces that need no cluster: the peers' heartbeat watch, the failure it
records and how the front reads it, the global batch kept on a new world size, the event
record. The real node loss is in test_multinode.py (hostfile) and test_slurm.py (Slurm)."""

from __future__ import annotations

import json
import time

import pytest

from wonderland_ds.checkpoint.metadata import CheckpointMeta
from wonderland_ds.core.findings import Refused
from wonderland_ds.launch import elastic
from wonderland_ds.run import failures
from wonderland_ds.run.liveness import Heartbeat, PeerWatch


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def beat(folder, rank, t, host="h", step=5, left=None):
    body = {"rank": rank, "pid": 1, "host": host, "step": step, "time": t}
    if left:
        body["left"] = left
    (folder / f"rank{rank}.json").write_text(json.dumps(body))


def test_a_peer_whose_heartbeat_stops_is_lost_after_the_timeout(tmp_path):
    clock, got = Clock(), []
    watch = PeerWatch(tmp_path, rank=0, world=3, timeout_s=15, on_lost=got.append, clock=clock)
    for i in range(4):  # every peer beats while rank 0 watches
        beat(tmp_path, 1, 1000 + 2 * i, host="a")
        beat(tmp_path, 2, 1000 + 2 * i, host="b", step=40 + i)
        assert watch.look() == []
        clock.t += 2
    for _ in range(6):  # rank 2 stops at its beat of t=1006 (seen at 106); rank 1 goes on
        clock.t += 2
        beat(tmp_path, 1, clock.t + 900, host="a")
        assert watch.look() == [], clock.t
    clock.t += 2  # 16 s unchanged
    beat(tmp_path, 1, clock.t + 900, host="a")
    lost = watch.look()
    assert [(b["rank"], b["host"], b["step"]) for b in lost] == [(2, "b", 43)]
    assert lost[0]["silent_s"] > 15 and got == [lost]
    watch.look()
    assert len(got) == 1  # said once


def test_not_judged_a_stale_file_a_peer_that_left_and_a_gap_in_looking(tmp_path):
    clock, got = Clock(), []
    watch = PeerWatch(tmp_path, rank=1, world=4, timeout_s=10, on_lost=got.append, clock=clock)
    beat(tmp_path, 0, 500.0)  # an earlier launch's file: never changes while watched
    beat(tmp_path, 2, 500.0)
    beat(tmp_path, 3, 500.0)
    watch.look()
    for _ in range(3):
        clock.t += 2
        beat(tmp_path, 2, clock.t)  # rank 2 beats, then leaves normally
        beat(tmp_path, 3, clock.t)  # rank 3 beats, then goes silent
        watch.look()
    beat(tmp_path, 2, clock.t + 1, left="ok")
    clock.t += 2
    watch.look()
    clock.t += 4
    watch.look()
    clock.t += 4
    watch.look()
    clock.t += 7  # a gap longer than half the timeout: this rank was not looking
    assert watch.look() == [] and got == []
    for _ in range(6):
        clock.t += 2
        watch.look()
    # Only rank 3: rank 0's file never changed, rank 2 said it left.
    assert [b["rank"] for b in got[0]] == [3]


def test_nobody_is_lost_while_this_ranks_own_beats_fail(tmp_path):
    clock, got = Clock(), []
    watch = PeerWatch(tmp_path, rank=0, world=2, timeout_s=5, on_lost=got.append, clock=clock)
    for i in range(3):
        beat(tmp_path, 1, 10.0 + i)
        watch.look()
        clock.t += 1
    for _ in range(10):  # the shared folder stalls for everyone
        clock.t += 1
        watch.look(own_written=False)
    assert got == []
    for _ in range(6):
        clock.t += 1
        watch.look()
    assert [b["rank"] for b in got[0]] == [1]  # still silent once this rank writes again


def test_the_heartbeat_says_it_left(tmp_path):
    hb = Heartbeat(tmp_path, rank=0, interval=0.05).start()
    time.sleep(0.1)
    hb.stop("failed")
    assert json.loads(hb.path.read_text())["left"] == "failed"


def test_a_lost_peer_is_the_first_failure_and_names_its_host(tmp_path):
    peer = {"rank": 2, "host": "node2", "step": 57, "time": time.time() - 20, "silent_s": 16.2}
    failures.record_lost(tmp_path, 0, [peer])
    failures.record_lost(tmp_path, 1, [{**peer, "silent_s": 15.1}])
    # A survivor's own error after the loss is a consequence, even one that reads as a cause.
    failures.record(tmp_path, 3, ValueError("something odd"), None)
    first = failures.first_failure(tmp_path, 0.0, [], tmp_path / "logs")
    assert first is not None and first.rank == 2 and first.host == "node2", first
    assert "rank 2 on node2 stopped: no heartbeat for 16 s (seen by ranks 0, 1" in first.summary
    assert [p.host for p in first.lost] == ["node2"] and first.lost[0].step == 57
    # Control: without the watch records the survivor's error is the cause.
    failures.clear(tmp_path)
    failures.record(tmp_path, 3, ValueError("something odd"), None)
    other = failures.first_failure(tmp_path, 0.0, [], tmp_path / "logs")
    assert other is not None and other.rank == 3 and other.lost == []


def test_the_global_batch_is_kept_or_the_relaunch_refused():
    meta = CheckpointMeta(train_batch=96, micro_batch=8, grad_acc=4, world_size=3)
    assert elastic.grad_acc_for(meta, 2, "c.json") == 6  # 8 x 4 x 3 -> 8 x 6 x 2
    assert elastic.grad_acc_for(meta, 4, "c.json") == 3
    assert elastic.grad_acc_for(meta, 12, "c.json") == 1
    with pytest.raises(Refused) as exc:
        elastic.grad_acc_for(meta, 5, "c.json")
    f = exc.value.findings[0]
    assert f.rule == "elastic-batch" and "96 is not a multiple of 8 x 5" in f.message
    assert "1, 2, 3, 4, 6, 12 ranks" in f.fix
    with pytest.raises(Refused):
        elastic.grad_acc_for(CheckpointMeta(world_size=3), 2, "c.json")


def test_the_first_step_after_the_resume_is_read_from_metrics(tmp_path):
    (tmp_path / "metrics.csv").write_text(
        "step,loss,wall\n47,1.0,100.0\n48,1.0,101.0\n49,1.0,130.5\n"
    )
    assert elastic.first_step_wall(tmp_path, 48) == 130.5
    assert elastic.first_step_wall(tmp_path, 49) is None
    assert elastic.first_step_wall(tmp_path / "none", 0) is None


def _checkpoint(run_dir, step, world, grad_acc):
    from wonderland_ds.checkpoint import contract as ck

    root = run_dir / "stage16" / "checkpoints"
    tag = root / ck.tag_for(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"model")
    meta = {"global_step": step, "world_size": world, "micro_batch": 8, "grad_acc": grad_acc}
    ck.write_meta(tag, {**meta, "train_batch": 8 * grad_acc * world})
    ck.set_latest(root, tag.name)


def _nodes(tmp_path, hosts, min_nodes, exclude):
    import argparse

    from tests.conftest import TINY32
    from wonderland_ds.config.hostfile import Hostfile
    from wonderland_ds.launch.target import Target

    hf = Hostfile(path="hf", hosts={h: 1 for h in hosts})
    target = Target(hf, None, "pdsh")
    args = argparse.Namespace(
        stage=16, config=TINY32, min_nodes=min_nodes, nproc=None, resume="auto", grad_acc_steps=None
    )
    return elastic.Nodes(args, tmp_path, target, exclude), args, target


def test_a_lost_host_is_left_out_and_the_batch_kept_then_grown_back(tmp_path, monkeypatch, capsys):
    from wonderland_ds.run import manifest
    from wonderland_ds.run.manifest import stage_record

    _checkpoint(tmp_path, 48, world=3, grad_acc=4)
    exclude: list[str] = []
    nodes, args, target = _nodes(tmp_path, ["n0", "n1", "n2"], 2, exclude)
    monkeypatch.setattr(elastic, "answers", lambda host, slurm: host != "n2")
    now = time.time()
    lost = [{"rank": 2, "host": "n2", "step": 50, "last_beat": now - 17, "silent_s": 16.0}]
    manifest.update_stage(tmp_path, 16, world_size=3, lost=lost)
    assert nodes.lost(stage_record(tmp_path, 16)) is True
    assert exclude == ["n2"] and target.world(None, exclude) == 2
    said = capsys.readouterr().err
    assert "global batch 96 kept: 8 x 4 x 3 becomes 8 x 6 x 2" in said, said
    relaunch = nodes.before_launch(args, 2)
    assert relaunch.grad_acc_steps == 6 and args.grad_acc_steps is None
    (event,) = stage_record(tmp_path, 16).elastic
    assert event["kind"] == "shrink" and event["lost_hosts"] == ["n2"] and event["steps_lost"] == 2
    assert event["relaunch_s"] >= 17 and event["training_again_s"] is None
    (tmp_path / "stage16" / "metrics.csv").write_text(
        f"step,loss,wall\n48,1,{now}\n49,1,{now + 9}\n"
    )
    nodes.after_launch()
    (event,) = stage_record(tmp_path, 16).elastic  # the same event, completed
    assert event["training_again_s"] == pytest.approx(26, abs=0.2), event
    # Grown back: the next command starts on three hosts from the 2-rank checkpoint.
    _checkpoint(tmp_path, 60, world=2, grad_acc=6)
    grown, args, _ = _nodes(tmp_path, ["n0", "n1", "n2"], 2, [])
    assert grown.before_launch(args, 3).grad_acc_steps == 4
    assert [e["kind"] for e in stage_record(tmp_path, 16).elastic] == ["shrink", "grow"]
    with pytest.raises(Refused, match="cannot be kept on 5 ranks"):
        grown.before_launch(args, 5)
    # Without --min-nodes nothing changes: a plain restart.
    plain, args, _ = _nodes(tmp_path, ["n0", "n1", "n2"], None, [])
    assert plain.before_launch(args, 2) is args


def test_too_few_hosts_left_or_a_host_that_answers(tmp_path, monkeypatch, capsys):
    from wonderland_ds.run import manifest
    from wonderland_ds.run.manifest import stage_record

    _checkpoint(tmp_path, 48, world=2, grad_acc=3)
    lost = [{"rank": 1, "host": "n1", "step": 50, "last_beat": time.time(), "silent_s": 16.0}]
    manifest.update_stage(tmp_path, 16, world_size=2, lost=lost)
    nodes, _, _ = _nodes(tmp_path, ["n0", "n1"], 2, [])
    monkeypatch.setattr(elastic, "answers", lambda host, slurm: False)
    assert nodes.lost(stage_record(tmp_path, 16)) is False
    assert (
        "1 node(s) left (n0), fewer than --min-nodes 2: not relaunched" in capsys.readouterr().err
    )
    exclude: list[str] = []
    nodes, _, _ = _nodes(tmp_path, ["n0", "n1"], 1, exclude)
    monkeypatch.setattr(elastic, "answers", lambda host, slurm: True)
    assert nodes.lost(stage_record(tmp_path, 16)) is None and exclude == []
    assert "answer (a process lost, not the host)" in capsys.readouterr().err
