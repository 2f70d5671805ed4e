"""wonderland.gloo_slice_us (CPU-only tuning, off by default): switched on, gloo's threads run
with a short Linux time slice while a stage trains (cpu.tuned around trainer.fit), so they
preempt the computing step loop as soon as they wake.

The threads here are stand-ins named as gloo names its own (``pthread_setname_np``); one test
starts a real gloo process group in a child process and checks those names are what torch's
gloo really uses."""

from __future__ import annotations

import ctypes
import errno
import subprocess
import sys
import threading
import types
from pathlib import Path

import pytest

from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.training import cpu as comm_threads
from wonderland_ds.training import trainer

REPO = Path(__file__).resolve().parents[1]


def _sched():
    s = comm_threads._sched()
    return None if isinstance(s, str) else s


SCHED = _sched()
HAS_SLICES = SCHED is not None and SCHED.get(threading.get_native_id()).sched_runtime > 0
pytestmark = pytest.mark.skipif(
    not HAS_SLICES, reason="needs Linux 6.12+ (per-thread time slices) on x86_64 or aarch64"
)


def slice_of(tid: int) -> int:
    return SCHED.get(tid).sched_runtime


class Named:
    """A thread named ``name`` (as gloo names its threads), alive until ``stop``."""

    def __init__(self, name: str):
        self.ready, self.release = threading.Event(), threading.Event()
        self.tid = 0
        self.thread = threading.Thread(target=self._body, args=(name,), daemon=True)
        self.thread.start()
        self.ready.wait()

    def _body(self, name: str) -> None:
        ctypes.CDLL(None).prctl(15, name.encode())  # PR_SET_NAME: this thread's comm
        self.tid = threading.get_native_id()
        self.ready.set()
        self.release.wait()

    def stop(self) -> None:
        self.release.set()
        self.thread.join()


@pytest.fixture
def named():
    started: list[Named] = []

    def make(name: str) -> Named:
        started.append(Named(name))
        return started[-1]

    yield make
    for t in started:
        t.stop()


def test_only_gloo_threads_get_the_slice_and_get_theirs_back(named):
    tcp, work, other = named("gloo_tcp_loop"), named("pt_gloo_runloop"), named("wl-writer")
    found = comm_threads.gloo_threads()
    assert found[tcp.tid] == "gloo_tcp_loop" and found[work.tid] == "pt_gloo_runloop"
    assert other.tid not in found and threading.get_native_id() not in found
    before = {t.tid: slice_of(t.tid) for t in (tcp, work, other)}
    me_before = slice_of(threading.get_native_id())
    with comm_threads.short_gloo_slices(100) as why:
        assert why is None
        assert slice_of(tcp.tid) == slice_of(work.tid) == 100_000
        assert slice_of(other.tid) == before[other.tid]
        assert slice_of(threading.get_native_id()) == me_before  # the loop keeps its own
    assert {t.tid: slice_of(t.tid) for t in (tcp, work, other)} == before


def test_the_slice_is_put_back_after_a_failure_too(named):
    tcp = named("gloo_tcp_loop")
    before = slice_of(tcp.tid)
    with pytest.raises(RuntimeError):
        with comm_threads.short_gloo_slices(250):
            assert slice_of(tcp.tid) == 250_000
            raise RuntimeError("the stage failed")
    assert slice_of(tcp.tid) == before


def test_zero_changes_nothing(named):
    tcp = named("gloo_tcp_loop")
    before = slice_of(tcp.tid)
    with comm_threads.short_gloo_slices(0) as why:
        assert why is None and slice_of(tcp.tid) == before


def test_the_nice_value_and_policy_are_kept(named):
    import os

    tcp = named("gloo_tcp_loop")
    os.setpriority(os.PRIO_PROCESS, tcp.tid, 4)
    with comm_threads.short_gloo_slices(100):
        assert os.getpriority(os.PRIO_PROCESS, tcp.tid) == 4
        assert SCHED.get(tcp.tid).sched_policy == 0
    assert os.getpriority(os.PRIO_PROCESS, tcp.tid) == 4


def test_a_refusal_changes_nothing_and_says_why(named, monkeypatch):
    first, second = named("gloo_tcp_loop"), named("pt_gloo_runloop")
    before = {t.tid: slice_of(t.tid) for t in (first, second)}
    real_set = comm_threads._Sched.set
    calls: list[int] = []

    def refuse_second(self, tid, attr):
        if tid not in before:  # a real gloo thread of this process (another test's group)
            return real_set(self, tid, attr)
        calls.append(tid)
        if len(calls) == 2:
            raise OSError(errno.EPERM, "Operation not permitted")
        return real_set(self, tid, attr)

    monkeypatch.setattr(comm_threads._Sched, "set", refuse_second)
    with comm_threads.short_gloo_slices(100) as why:
        assert why is not None and "refused" in why and "Operation not permitted" in why
        # all or nothing: the thread changed before the refusal is back already
        assert {t.tid: slice_of(t.tid) for t in (first, second)} == before
    assert len(calls) == 3  # two tries, one put back


def test_a_kernel_without_slices_is_said_and_nothing_changes(named, monkeypatch):
    tcp = named("gloo_tcp_loop")
    before = slice_of(tcp.tid)
    real_get = comm_threads._Sched.get

    def old_kernel(self, tid):
        attr = real_get(self, tid)
        attr.sched_runtime = 0  # what Linux before 6.12 reports for a SCHED_OTHER thread
        return attr

    monkeypatch.setattr(comm_threads._Sched, "get", old_kernel)
    with comm_threads.short_gloo_slices(100) as why:
        assert why is not None and "no per-thread time slices" in why
        monkeypatch.setattr(comm_threads._Sched, "get", real_get)
        assert slice_of(tcp.tid) == before


def test_a_thread_that_ended_or_runs_real_time_is_left_alone(named, monkeypatch):
    gone, rt, fine = named("gloo_tcp_loop"), named("pt_gloo_runloop"), named("gloo_x")
    before_rt = slice_of(rt.tid)
    real_get = comm_threads._Sched.get

    def get(self, tid):
        if tid == gone.tid:
            raise OSError(errno.ESRCH, "No such process")
        attr = real_get(self, tid)
        if tid == rt.tid:
            attr.sched_policy = 1  # SCHED_FIFO: chosen by someone, not ours to change
        return attr

    monkeypatch.setattr(comm_threads._Sched, "get", get)
    with comm_threads.short_gloo_slices(100) as why:
        assert why is None
        assert real_get(SCHED, fine.tid).sched_runtime == 100_000
        assert real_get(SCHED, rt.tid).sched_runtime == before_rt


def test_fit_trains_with_short_gloo_slices_and_notes_when_it_could_not(named, monkeypatch, capsys):
    tcp = named("gloo_tcp_loop")
    before = slice_of(tcp.tid)
    seen: list[int] = []

    class FakeTrainer:
        def __init__(self, run, engine_, prog, report, verify=False):
            pass

        def train(self):
            seen.append(slice_of(tcp.tid))
            return {"ok": True}

    monkeypatch.setattr(trainer, "Trainer", FakeTrainer)

    def fit(**settings):
        run = types.SimpleNamespace(settings=WonderlandSettings(**settings))
        assert trainer.fit(run, None, None, None) == {"ok": True}

    fit()  # the default: off
    assert seen == [before]
    fit(gloo_slice_us=100)
    assert seen[-1] == 100_000 and slice_of(tcp.tid) == before
    fit(gloo_slice_us=0)
    assert seen[-1] == before
    assert "gloo_slice_us" not in capsys.readouterr().err

    def refuse(self, tid, attr):
        raise OSError(errno.EPERM, "Operation not permitted")

    monkeypatch.setattr(comm_threads._Sched, "set", refuse)
    fit(gloo_slice_us=300)
    assert seen[-1] == before
    err = capsys.readouterr().err
    assert "gloo_slice_us 300 not applied" in err and "keep their time slice" in err


CHILD = """
import tempfile, torch.distributed as dist
from wonderland_ds.training import cpu as comm_threads
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
names = sorted(set(comm_threads.gloo_threads().values()))
with comm_threads.short_gloo_slices(100) as why:
    inside = {comm_threads._sched().get(t).sched_runtime for t in comm_threads.gloo_threads()}
print(names, why, sorted(inside))
dist.destroy_process_group()
"""


def test_the_names_are_those_real_gloo_gives_its_threads():
    r = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    last = r.stdout.strip().splitlines()[-1]
    assert last == "['gloo_tcp_loop', 'pt_gloo_runloop'] None [100000]", last
