"""The garbage collector while a rank starts (wonderland_ds/startup.py): off from train.py's
start, the imports frozen, one collection and back on at the first step; and the GIL switch
interval while trainer.fit trains (when switched on)."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref

import pytest

from tests.helpers.util import REPO
from wonderland_ds.training import startup


class Node:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


@pytest.fixture
def collector():
    """Leave the test process's collector as it was, whatever the test did."""
    assert gc.isenabled()
    yield
    startup._held = False
    gc.unfreeze()
    gc.enable()


def test_hold_then_release_collects_the_start_garbage_and_turns_the_collector_on(collector):
    startup.hold()
    assert not gc.isenabled()
    gc.collect()  # whatever the test process had pending: not this test's business
    cycle = Node()
    dead = weakref.ref(cycle)
    del cycle
    assert dead() is not None  # with the collector off, the cycle outlives its last name
    found = startup.release()
    assert dead() is None and found >= 1
    assert gc.isenabled()
    assert startup.release() == 0  # once only


def test_a_collector_the_caller_turned_off_stays_off(collector):
    gc.disable()
    startup.hold()
    startup.freeze_imports()
    assert gc.get_freeze_count() == 0  # not held: nothing frozen
    assert startup.release() == 0
    assert not gc.isenabled()


def test_freeze_imports_hides_what_exists_and_release_still_frees_what_came_after(collector):
    startup.hold()
    before = Node()
    startup.freeze_imports()
    assert gc.get_freeze_count() > 0
    assert not any(o is before for o in gc.get_objects())  # out of the collector's sight
    after = Node()
    dead = weakref.ref(after)
    del after
    startup.release()
    assert dead() is None and gc.isenabled()


def test_release_without_collecting_only_turns_the_collector_on(collector):
    startup.hold()
    cycle = Node()
    dead = weakref.ref(cycle)
    del cycle
    assert startup.release(collect=False) == 0
    assert gc.isenabled() and dead() is not None
    gc.collect()
    assert dead() is None


def test_train_py_holds_the_collector_for_the_stage_and_releases_it_on_the_way_out():
    """train.py's main turns the collector off before torch is imported and, when the stage
    ends before a first step released it (a refusal), turns it back on."""
    code = """
import gc, sys, types
# No process group here: a stand-in for the distributed module (it would import torch).
fake = types.ModuleType("wonderland_ds.core.distributed")
fake.teardown = lambda agreed: None
fake.is_main = lambda: True
fake.log = lambda msg: None
sys.modules["wonderland_ds.core.distributed"] = fake
import wonderland_ds.train as train
from wonderland_ds.launch import rank
from wonderland_ds.training import startup
seen = {}
hold = startup.hold
def spy_hold():
    seen["torch_at_hold"] = "torch" in sys.modules
    hold()
startup.hold = spy_hold
def fake_run(args, signals=None):
    seen["on_during"] = gc.isenabled()
    return 0
rank.run = fake_run
rc = train.main(["--stage", "16"])
print(rc, seen["torch_at_hold"], seen["on_during"], gc.isenabled())
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0", "False", "False", "True"]


def test_collecting_turns_a_held_collector_on_for_the_block_only(collector):
    with startup.collecting():  # not held: nothing changes
        assert gc.isenabled()
    assert gc.isenabled()
    startup.hold()
    with startup.collecting():
        assert gc.isenabled()
    assert not gc.isenabled()
    with pytest.raises(RuntimeError), startup.collecting():
        raise RuntimeError("a task failed")
    assert not gc.isenabled()  # held again after an error too


def test_a_task_builds_its_data_with_the_collector_on_while_the_rank_holds_it(
    collector, tmp_path, monkeypatch
):
    """User code (a task's materialize) may make cyclic garbage in bulk: a rank that holds the
    collector through its start runs it with the collector on."""
    from wonderland_ds.config.settings import WonderlandSettings
    from wonderland_ds.data import builtin
    from wonderland_ds.launch import stage
    from wonderland_ds.launch.plan import StageOptions

    seen: list[bool] = []

    class Task:
        name = "probe"
        train = None

        def materialize(self):
            seen.append(gc.isenabled())
            return self

    monkeypatch.setattr(builtin, "load", lambda spec, settings=None: Task())
    startup.hold()
    args = StageOptions(stage=15, config="c.json", run_dir=str(tmp_path), task="anything")
    got, _ = stage._task_data(args, WonderlandSettings(), tmp_path, check_stale=True)
    assert isinstance(got, Task) and seen == [True]
    assert not gc.isenabled()  # and held again for the rest of the start
