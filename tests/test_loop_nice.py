"""wonderland.loop_nice (CPU-only tuning, off by default): switched on, the step loop's thread
runs nicer while a stage trains (cpu.tuned around trainer.fit), so the threads that complete a
collective get its core as soon as they wake.

Each test runs in a thread of its own: a nice value that could not be lowered back would
otherwise stay on pytest's main thread."""

from __future__ import annotations

import os
import sys
import threading
import types

import pytest

from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.training import cpu, trainer

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread nice values are Linux only"
)


def nice_of(tid: int | None = None) -> int:
    return os.getpriority(os.PRIO_PROCESS, threading.get_native_id() if tid is None else tid)


def in_thread(fn):
    """fn() in a fresh thread; its result, or its exception re-raised here."""
    out: dict = {}

    def body():
        try:
            out["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised below
            out["error"] = exc

    t = threading.Thread(target=body)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


def test_only_the_calling_thread_and_what_it_starts_get_nicer_and_it_is_restored():
    def body():
        start = nice_of()
        other_tid: list[int] = []
        release = threading.Event()
        ready = threading.Event()

        def bystander():  # started before the block: a thread such as gloo's
            other_tid.append(threading.get_native_id())
            ready.set()
            release.wait()

        peer = threading.Thread(target=bystander)
        peer.start()
        ready.wait()
        inside: dict = {}
        with cpu.nicer_thread(10) as why_not:
            inside["why_not"] = why_not
            inside["own"] = nice_of()
            inside["bystander"] = nice_of(other_tid[0])
            child: list[int] = []
            t = threading.Thread(target=lambda: child.append(nice_of()))
            t.start()
            t.join()
            inside["child"] = child[0]
        release.set()
        peer.join()
        return start, inside, nice_of()

    start, inside, after = in_thread(body)
    assert inside["why_not"] is None
    assert inside["own"] == min(19, start + 10)
    assert inside["bystander"] == start  # another thread of the process: untouched
    assert inside["child"] == inside["own"]  # the metrics and checkpoint writers inherit it
    assert after == start


def test_restored_after_a_failure_and_clamped_at_19():
    def body():
        start = nice_of()
        with pytest.raises(RuntimeError):
            with cpu.nicer_thread(5):
                assert nice_of() == start + 5
                raise RuntimeError("a rank died")
        restored = nice_of()
        with cpu.nicer_thread(100):
            clamped = nice_of()
        return start, restored, clamped

    start, restored, clamped = in_thread(body)
    assert restored == start and clamped == 19


def test_zero_changes_nothing(monkeypatch):
    calls: list[tuple] = []
    monkeypatch.setattr(os, "setpriority", lambda *a: calls.append(a))

    def body():
        with cpu.nicer_thread(0) as why_not:
            return why_not

    assert in_thread(body) is None and calls == []


def test_a_refused_setpriority_is_reported_and_changes_nothing(monkeypatch):
    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)

    def body():
        start = nice_of()
        with cpu.nicer_thread(10) as why_not:
            return start, why_not, nice_of()

    start, why_not, inside = in_thread(body)
    assert "setpriority refused" in why_not and "not permitted" in why_not
    assert inside == start


def test_a_refused_restore_leaves_the_thread_nicer_without_an_error(monkeypatch):
    """Unprivileged, a nice value cannot be lowered (no CAP_SYS_NICE, RLIMIT_NICE 0): the
    block still ends normally and the thread keeps the nicer value."""
    real = os.setpriority
    calls: list[int] = []

    def raise_then_refuse(which, who, value):
        calls.append(value)
        if len(calls) > 1:
            raise PermissionError(13, "Permission denied")
        real(which, who, value)

    monkeypatch.setattr(os, "setpriority", raise_then_refuse)

    def body():
        start = nice_of()
        with cpu.nicer_thread(3):
            pass
        return start, nice_of()

    start, after = in_thread(body)
    assert calls == [start + 3, start] and after == start + 3


def test_off_by_default():
    assert WonderlandSettings().loop_nice == 0


def test_fit_trains_in_the_nicer_thread_and_notes_when_it_could_not(monkeypatch, capsys):
    seen: list[int] = []

    class FakeTrainer:
        def __init__(self, run, engine_, prog, report, verify=False):
            pass

        def train(self):
            seen.append(nice_of())
            return {"ok": True}

    monkeypatch.setattr(trainer, "Trainer", FakeTrainer)

    def body(nice: int):
        run = types.SimpleNamespace(settings=WonderlandSettings(loop_nice=nice))
        start = nice_of()
        assert trainer.fit(run, None, None, None) == {"ok": True}
        return start, nice_of()

    start, after = in_thread(lambda: body(7))
    assert seen[-1] == min(19, start + 7) and after == start
    assert in_thread(lambda: body(0))[0] == seen[-1]  # 0: the loop at the usual priority
    assert "loop_nice" not in capsys.readouterr().err

    def refuse(*a):
        raise PermissionError(1, "Operation not permitted")

    monkeypatch.setattr(os, "setpriority", refuse)
    in_thread(lambda: body(7))
    err = capsys.readouterr().err
    assert "loop_nice 7 not applied" in err and "usual priority" in err
