"""Slurm's facts, stop signals and the stop agreement, without Slurm or a launch."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest

from wonderland_ds.core import slurm
from wonderland_ds.core.findings import Refused, Stopped
from wonderland_ds.core.signals import StopRequest, StopSignals

ALLOC_ENV = {
    "SLURM_JOB_ID": "4242",
    "SLURM_JOB_NODELIST": "n1,n2",
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_NTASKS_PER_NODE": "4",
    "SLURM_CPUS_ON_NODE": "16",
    "SLURM_RESTART_COUNT": "2",
}


def test_allocation_from_env_and_ranks_per_node():
    assert slurm.Allocation.from_env({}) is None
    alloc = slurm.Allocation.from_env(ALLOC_ENV)
    assert alloc is not None
    assert (alloc.job_id, alloc.num_nodes, alloc.restart_count) == ("4242", 2, 2)
    assert alloc.ranks_per_node(3) == (3, "--nproc")
    assert alloc.ranks_per_node()[0] == 4  # the tasks per node Slurm granted
    gpus = slurm.Allocation.from_env({**ALLOC_ENV, "SLURM_GPUS_ON_NODE": "8"})
    assert gpus is not None and gpus.ranks_per_node() == (8, "the GPUs on each node")
    bare = slurm.Allocation.from_env({"SLURM_JOB_ID": "1", "SLURM_JOB_NODELIST": "a"})
    assert bare is not None and bare.ranks_per_node()[0] == 1
    # Slurm's compressed per-node counts: the first node's
    weird = slurm.Allocation.from_env(
        {**ALLOC_ENV, "SLURM_NTASKS_PER_NODE": "", "SLURM_TASKS_PER_NODE": "2(x2)"}
    )
    assert weird is not None and weird.tasks_per_node == 2


def test_host_list_without_scontrol(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    assert slurm.expand_hostlist("a,b") == ["a", "b"]
    with pytest.raises(RuntimeError, match="scontrol"):
        slurm.expand_hostlist("node[1-3]")


def test_task_rank_only_for_srun_tasks():
    task = {
        "SLURM_JOB_ID": "77",
        "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "3",
        "SLURM_LOCALID": "1",
        "SLURM_STEP_NUM_TASKS": "4",
        "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
        "MASTER_ADDR": "n1",
    }
    got = slurm.task_rank(task)
    assert got is not None
    assert (got.rank, got.local_rank, got.world_size, got.local_size) == (3, 1, 4, 2)
    assert got.master_addr == "n1" and got.master_port == slurm.default_port("77")
    assert slurm.task_rank({**task, "RANK": "0"}) is None  # DeepSpeed's launcher, torchrun
    assert slurm.task_rank({**task, "OMPI_COMM_WORLD_RANK": "0"}) is None  # mpirun: mpi4py's
    batch = {k: v for k, v in task.items() if not k.startswith("SLURM_STEP")}
    assert slurm.task_rank(batch) is None  # the batch script itself is no task
    env = dict(task)
    slurm.export_task_rank(env)
    assert {k: env[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_PORT")} == {
        "RANK": "3",
        "LOCAL_RANK": "1",
        "WORLD_SIZE": "4",
        "MASTER_PORT": str(slurm.default_port("77")),
    }
    assert 20000 <= slurm.default_port("123456") < 40000


def test_slurm_times():
    end = slurm.parse_time("2026-12-03T09:10:00")
    assert end is not None and time.localtime(end).tm_min == 10
    assert slurm.parse_time("Unknown") is None and slurm.parse_time("NONE") is None


def test_stop_signals_keep_the_first_and_count_the_rest():
    signals = StopSignals().install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGTERM)
        assert signals.first is not None and signals.first.signal == "SIGUSR1"
        assert signals.first.requeue_wanted and signals.repeats == 2
    finally:
        signals.restore()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    term = StopSignals()
    term.request(StopRequest("signal", "SIGTERM", time.time()))
    assert term.first is not None and not term.first.requeue_wanted  # a scancel
    assert StopRequest("time-limit", None, 0.0).requeue_wanted


def test_stop_agreement_in_one_process(tmp_path):
    from wonderland_ds.config.settings import Preemption
    from wonderland_ds.training.stopping import StopAgreement, write_request

    signals = StopSignals()
    agree = StopAgreement(signals, Preemption(), tmp_path, lambda: None, 400_000_000)
    agree.on_start()
    try:
        assert agree.at_start(0) is None
        agree.pre_step(0)
        assert agree.agreed() is None
        write_request(tmp_path, StopRequest("signal", "SIGTERM", time.time(), "SIGTERM"))
        deadline = time.time() + 5
        while not signals.requested and time.time() < deadline:
            time.sleep(0.05)  # rank 0's watcher reads the front's request file
        assert signals.first is not None and signals.first.reason == "front"
        agree.pre_step(1)
        got = agree.agreed()
        assert got is not None and "sent to the front" in got.describe()
    finally:
        agree.on_close()
    # No save measured yet: the state at 100 MB/s, twice the slowest step, 15 s to exit.
    agree.recent = [0.5, 2.0]
    assert agree.margin_s() == pytest.approx(2 * 2.0 + 4.0 + 15.0)
    fixed = StopAgreement(signals, Preemption(stop_margin_s=90.0), tmp_path, lambda: 1.0, 0)
    assert fixed.margin_s() == 90.0


def test_time_limit_raises_the_flag_on_rank0(tmp_path):
    from wonderland_ds.config.settings import Preemption
    from wonderland_ds.training.stopping import StopAgreement, StopWatch

    signals = StopSignals()
    agree = StopAgreement(signals, Preemption(), tmp_path, lambda: 5.0, 0)
    agree.watch = StopWatch(signals, tmp_path, None, 60.0)
    agree.watch.end_time = time.time() + 3600
    agree.pre_step(0)
    agree.agreed()
    assert not signals.requested  # an hour left
    agree.watch.end_time = time.time() + 10  # less than a save (5 s) and the exit (15 s)
    agree.pre_step(1)
    got = agree.agreed()
    assert got is not None and got.reason == "time-limit" and "time limit" in got.describe()


def test_supervisor_stops_before_a_launch_and_passes_on_during_one(tmp_path):
    from wonderland_ds.launch.supervise import Supervisor
    from wonderland_ds.training.stopping import request_path

    with Supervisor() as sup:
        with pytest.raises(Stopped):
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.1)
    with Supervisor() as sup:
        sup.launching(tmp_path, srun=False)
        os.kill(os.getpid(), signal.SIGUSR1)  # remembered, not raised: a launch starts
        proc = subprocess.Popen(["sleep", "5"])
        try:
            sup.attach(proc)
            assert request_path(tmp_path).exists()  # rank 0 reads it
            assert proc.poll() is None  # DeepSpeed's runner is never signalled
        finally:
            proc.kill()
            proc.wait()
        with pytest.raises(Stopped):
            sup.arm()  # the next launch does not start
    with Supervisor() as sup:
        sup.launching(tmp_path, srun=True)
        proc = subprocess.Popen(["sleep", "5"])
        sup.attach(proc)
        os.kill(os.getpid(), signal.SIGUSR1)
        assert proc.wait(5) == -signal.SIGUSR1  # srun gets it: it forwards to every task


def test_launch_target(monkeypatch, tmp_path):
    from wonderland_ds.launch.target import decide

    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    with pytest.raises(Refused, match="needs a Slurm allocation"):
        decide(None, "slurm", None)
    assert decide(None, "auto", None).launcher == "pdsh"
    monkeypatch.setenv("PATH", "/nonexistent" + os.pathsep + os.environ["PATH"])
    for key, value in ALLOC_ENV.items():
        monkeypatch.setenv(key, value)
    inside = decide(None, "auto", None)
    assert inside.srun and inside.hosts == ["n1", "n2"] and inside.world(None, []) == 8
    assert inside.world(None, ["n2"]) == 4
    hostfile = tmp_path / "hosts"
    hostfile.write_text("localhost slots=2\n")
    given = decide(str(hostfile), "auto", None)
    assert not given.srun and "wins" in given.notes[0]
    with pytest.raises(Refused, match="not from --hostfile"):
        decide(str(hostfile), "slurm", None)


def test_srun_command(monkeypatch):
    from wonderland_ds.launch import srun

    alloc = slurm.Allocation.from_env(ALLOC_ENV)
    assert alloc is not None
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cmd, env, notes = srun.build(alloc, ["n1", "n2"], 4, ["--stage", "16"], 29500, ["n2"])
    assert cmd[0] == "srun" and "--ntasks=4" in cmd and "--nodelist=n1" in cmd
    assert cmd[-4:] == ["-m", "wonderland_ds.train", "--stage", "16"]
    assert env["MASTER_ADDR"] == "n1" and env["MASTER_PORT"] == "29500"
    assert env["OMP_NUM_THREADS"] == "4" and "RANK" not in env


def test_status_takes_run_dir_as_a_flag(tmp_path):
    from tests.helpers.util import wonderland
    from wonderland_ds.run import manifest

    manifest.update_stage(tmp_path, 15, status="ok", name="pre-normalization pass")
    flag = wonderland("status", "--run-dir", str(tmp_path), "--json")
    positional = wonderland("status", str(tmp_path), "--json")
    assert flag.returncode == positional.returncode == 0, flag.stderr
    assert flag.stdout == positional.stdout
    none = wonderland("status")
    assert none.returncode == 2 and "RUN_DIR" in none.stderr


def test_stage_record_reads_the_stop(tmp_path):
    from wonderland_ds.run import manifest

    manifest.update_stage(
        tmp_path,
        16,
        status="preempted",
        stop={"reason": "signal", "signal": "SIGTERM", "step": 300, "saved": True},
    )
    rec = manifest.stage_record(tmp_path, 16)
    assert rec.stop is not None and rec.stop.step == 300 and Path(tmp_path).exists()
