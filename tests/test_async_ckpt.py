"""Async checkpoint saves: the snapshot is immune to later steps; writer errors surface."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections import OrderedDict

import pytest
import torch

from wonderland_ds.checkpoint.async_save import Writer
from wonderland_ds.checkpoint.staging import snapshot


def test_snapshot_keeps_sharing_types_and_is_immune_to_later_updates():
    flat = torch.arange(10.0)
    state = {
        "a": flat[:5],
        "b": flat[5:],
        "shape": torch.Size([3, 4]),
        "od": OrderedDict(x=1),
        "nested": [flat, (flat[:2], "s")],
    }
    snap = snapshot(state)
    flat += 100  # the next optimizer step
    assert snap["a"].tolist() == [0, 1, 2, 3, 4] and snap["b"][0] == 5
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
    assert isinstance(snap["shape"], torch.Size) and snap["shape"].numel() == 12
    assert isinstance(snap["od"], OrderedDict) and snap["nested"][1][1] == "s"


def test_writer_writes_atomically(tmp_path):
    w = Writer()
    w.write({"x": torch.ones(3)}, str(tmp_path / "a.pt"), True)
    w.wait()
    w.close()
    assert torch.load(tmp_path / "a.pt")["x"].sum() == 3
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_error_surfaces_and_leaves_no_partial_file(tmp_path):
    w = Writer()
    w.write({"x": torch.ones(3)}, str(tmp_path / "missing-dir" / "a.pt"), True)
    w.write({"x": torch.ones(3)}, str(tmp_path / "b.pt"), True)  # skipped after the error
    with pytest.raises(OSError, match="could not write"):
        w.wait()
    w.close()
    assert not (tmp_path / "b.pt").exists() and not list(tmp_path.rglob("*.tmp"))


def test_disk_full_is_an_error_not_a_partial_file(tmp_path):
    """RLIMIT_FSIZE (the diskfull fault): the kernel refuses the write with EFBIG."""
    code = f"""
import resource, signal, torch
from wonderland_ds.checkpoint.async_save import Writer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
w = Writer()
w.write({{"x": torch.ones(1 << 20)}}, {str(tmp_path / "big.pt")!r}, True)
try:
    w.wait()
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    ).stdout
    assert "ERROR OSError could not write" in out and "disk full" in out, out
    assert list(tmp_path.iterdir()) == []  # no big.pt, no big.pt.tmp


def test_pooled_snapshot_reuses_buffers_only_after_the_write(tmp_path):
    """The second save copies into the first save's buffers (no fresh page faults), and the
    first file still holds the first save's values: a buffer goes back only once written."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    w = Writer()
    eng = SnapshotCheckpointEngine(object(), w)
    flat = torch.arange(1000.0)
    state = {"a": flat[:500], "b": flat[500:], "s": torch.ones(7)}
    eng.save(state, str(tmp_path / "one.pt"))
    w.wait()
    flat += 1000  # the next optimizer steps
    assert w.pool.reused == 0
    w.pool.start()  # engine.save: the previous save completed
    eng.save(state, str(tmp_path / "two.pt"))
    w.wait()
    assert w.pool.reused == 2  # both storages (flat's and the ones) came from the pool
    one, two = torch.load(tmp_path / "one.pt"), torch.load(tmp_path / "two.pt")
    assert one["a"][0] == 0 and one["b"][0] == 500 and two["a"][0] == 1000
    assert two["a"].untyped_storage().nbytes() == 4000  # views still share one storage
    w.pool.start()
    w.pool.trim()  # the third save takes nothing: the previous save's buffers are dropped
    eng.save({"c": torch.zeros(3)}, str(tmp_path / "three.pt"))
    w.wait()
    assert w.pool.reused == 2
    w.pool.start()  # only the third save's buffer is left to reuse
    eng.save({"c": torch.zeros(3)}, str(tmp_path / "four.pt"))
    eng.save({"d": torch.zeros(5)}, str(tmp_path / "five.pt"))  # a new shape allocates
    w.wait()
    w.close()
    assert w.pool.reused == 3 and torch.load(tmp_path / "four.pt")["c"].sum() == 0


def test_trim_keeps_buffers_this_saves_finished_files_gave_back():
    """The writer may finish this save's first file while the snapshot of the next is still
    being taken: trim() must not drop that file's buffers (the next save reuses them)."""
    from wonderland_ds.checkpoint.staging import BufferPool

    pool = BufferPool()
    pool.start()
    a = pool.copy(torch.ones(4).untyped_storage())
    pool.give([a])  # written and handed back before this save's snapshot ended
    pool.trim()
    pool.start()
    assert pool.copy(torch.zeros(4).untyped_storage()).data_ptr() == a.data_ptr()
    assert pool.reused == 1


def test_markers_carry_each_ranks_rng_states_into_the_rng_file(tmp_path):
    import numpy as np

    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint import markers

    root = tmp_path / "checkpoints"
    tag_dir = root / ck.tag_for(5)
    tag_dir.mkdir(parents=True)
    torch.save({"w": torch.ones(2)}, tag_dir / "mp_rank_00_model_states.pt")
    states = []
    for rank in range(2):
        torch.manual_seed(rank)
        np.random.seed(100 + rank)
        states.append(markers.rng_states())
        markers.mark_done(tag_dir, rank, states[-1])
    ck.finalize(root, tag_dir, 2, {"global_step": 5, "stage": 15}, 1, 5.0)
    saved = torch.load(tag_dir / ck.RNG_FILE, weights_only=True)["ranks"]  # tensors only
    for rank in range(2):
        assert torch.equal(saved[rank]["torch"], states[rank]["torch"])
        assert np.array_equal(saved[rank]["numpy"].numpy(), states[rank]["numpy"])
        assert saved[rank]["python"] == states[rank]["python"]
    assert not torch.equal(saved[0]["torch"], saved[1]["torch"])
    assert not list(tag_dir.glob(".done-rank*"))  # markers removed once complete


def _slow_writer(gate: threading.Event) -> Writer:
    """A writer whose every file waits for ``gate`` before it is serialized."""
    return Writer(lambda point: gate.wait(30) if point == "before-file" else None)


def test_held_file_reads_the_live_tensor_so_the_fence_must_wait(tmp_path):
    """Negative control: a held tensor is not copied, so a change before it is written
    reaches the file. This is the hazard the fence exists for."""
    gate = threading.Event()
    w = _slow_writer(gate)
    live = torch.zeros(4)
    w.write({"p": live}, str(tmp_path / "a.pt"), True, held=True)
    live += 7  # an optimizer step without the fence
    gate.set()
    w.wait()
    w.close()
    assert torch.load(tmp_path / "a.pt")["p"].tolist() == [7, 7, 7, 7]


def test_fence_waits_until_held_files_are_serialized(tmp_path):
    gate = threading.Event()
    w = _slow_writer(gate)
    live = torch.zeros(4)
    w.write({"p": live}, str(tmp_path / "a.pt"), True, held=True)
    w.write({"q": torch.ones(2)}, str(tmp_path / "b.pt"), True)  # a copied file: not held
    threading.Timer(0.3, gate.set).start()
    waited = w.fence()
    live += 7  # the optimizer step, after the fence
    w.wait()
    w.close()
    assert waited >= 0.25
    assert torch.load(tmp_path / "a.pt")["p"].tolist() == [0, 0, 0, 0]
    assert w.fence() == 0.0  # nothing held any more: the per-step call costs nothing


def test_a_failed_held_file_releases_the_fence(tmp_path):
    """A write that fails (and the later ones it makes the writer skip) must not leave the
    training loop waiting forever: the error surfaces at the next wait instead."""
    w = Writer()
    w.write({"p": torch.zeros(2)}, str(tmp_path / "missing" / "a.pt"), True, held=True)
    w.write({"p": torch.zeros(2)}, str(tmp_path / "b.pt"), True, held=True)  # skipped
    done = threading.Event()
    threading.Thread(target=lambda: (w.fence(), done.set()), daemon=True).start()
    assert done.wait(10), "fence never returned after a failed write"
    with pytest.raises(OSError, match="could not write"):
        w.wait()
    w.close()


def test_engine_holds_step_only_storages_and_copies_the_rest(tmp_path):
    """Parameters and optimizer state (views included) are held; a buffer, which a forward
    may update, is copied: changing both before the write shows which is which."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    gate = threading.Event()
    w = _slow_writer(gate)
    flat = torch.zeros(6)  # e.g. DeepSpeed's flat fp32 partition, saved as views
    buffer = torch.zeros(3)
    eng = SnapshotCheckpointEngine(object(), w, lambda: frozenset({flat.data_ptr()}))
    eng.save({"w": flat[:3], "b": flat[3:], "running": buffer}, str(tmp_path / "s.pt"))
    assert w._held == 1  # the file is marked held
    buffer += 1  # a forward updates the buffer before the file is written
    flat += 5  # the optimizer step: only after the fence in a real loop
    gate.set()
    w.wait()
    w.close()
    saved = torch.load(tmp_path / "s.pt")
    assert saved["running"].tolist() == [0, 0, 0]  # copied at the save
    assert saved["w"].tolist() == [5, 5, 5]  # held: the live tensor, as the control shows
    assert saved["w"].untyped_storage().data_ptr() == saved["b"].untyped_storage().data_ptr()


def test_copied_held_tensors_free_the_fence_before_the_file_is_serialized(tmp_path):
    """async_save_copy (the default): the writer copies the held storages first and the
    fence returns then, while the file is not serialized yet (the writer is stopped after the
    copy); an optimizer step after the fence does not reach the file. Views keep sharing one
    copied storage, and the copies are pooled: the next save reuses them."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    copied, go_on = threading.Event(), threading.Event()

    def hook(point: str) -> None:
        if point == "held-copied":
            copied.set()
            go_on.wait(30)

    w = Writer(hook)
    flat = torch.zeros(6)
    eng = SnapshotCheckpointEngine(object(), w, lambda: frozenset({flat.data_ptr()}))
    for i, name in enumerate(("s1.pt", "s2.pt")):
        w.pool.start()
        eng.save({"w": flat[:3], "b": flat[3:]}, str(tmp_path / name))
        waited = w.fence(timeout=10)
        assert copied.is_set() and not (tmp_path / name).exists()  # not serialized yet
        flat += 5  # the optimizer step, after the fence
        go_on.set()
        w.wait()
        copied.clear(), go_on.clear()
        saved = torch.load(tmp_path / name)
        assert saved["w"].tolist() == [5.0 * i] * 3 and saved["b"].tolist() == [5.0 * i] * 3
        assert saved["w"].untyped_storage().data_ptr() == saved["b"].untyped_storage().data_ptr()
        assert waited < 10
    assert w.pool.reused == 1  # the second save copied into the first save's buffer
    w.close()


def test_every_file_of_a_save_is_copied_before_any_is_serialized(tmp_path):
    """DeepSpeed hands a save's files over one after the other (model states, then optimizer
    states). The copies of all of them run first: the fence returns while the writer is
    stuck inside the first file's write (after its torch.save, before its rename), which it
    could not if the second file's copy waited behind the first file's write."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    gate = threading.Event()
    w = Writer(lambda point: gate.wait(30) if point == "mid-file" else None)
    a, b = torch.zeros(4), torch.ones(4)
    eng = SnapshotCheckpointEngine(object(), w, lambda: frozenset({a.data_ptr(), b.data_ptr()}))
    eng.save({"a": a}, str(tmp_path / "a.pt"))
    eng.save({"b": b}, str(tmp_path / "b.pt"))
    w.submit(lambda: None)  # what engine.save queues next (the rank's marker)
    w.fence(timeout=10)  # the old order times out here: b's copy behind a's stuck write
    assert not (tmp_path / "a.pt").exists()  # a's write really was stuck
    a += 5
    b += 5  # the optimizer step after the fence
    gate.set()
    w.wait()
    w.close()
    assert torch.load(tmp_path / "a.pt")["a"].tolist() == [0.0] * 4
    assert torch.load(tmp_path / "b.pt")["b"].tolist() == [1.0] * 4


def test_serialized_held_tensors_hold_the_fence_until_written(tmp_path):
    """async_save_copy false: nothing is copied, the fence waits for torch.save itself (the
    writer stopped before the file: the fence must time out)."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    gate = threading.Event()
    w = _slow_writer(gate)
    flat = torch.zeros(4)
    eng = SnapshotCheckpointEngine(object(), w, lambda: frozenset({flat.data_ptr()}), False)
    eng.save({"w": flat}, str(tmp_path / "s.pt"))
    with pytest.raises(TimeoutError):
        w.fence(timeout=0.2)
    gate.set()
    w.fence(timeout=10)
    w.wait()
    w.close()
    assert w.pool.reused == 0 and not w.pool._free  # no buffer: the live tensor was written


@pytest.mark.slow
@pytest.mark.proofs
def test_held_save_writes_what_deepspeeds_own_save_writes(tmp_path):
    """Real DeepSpeed, 2 gloo ranks, ZeRO-1/2/3, bf16: wonderland's save at step 2 holds the
    live parameters and optimizer state while 3 more steps run (the writer made slow, so the
    fence really waits), and every file equals DeepSpeed's own synchronous save at step 2.
    Without the fence (ZeRO-2) the optimizer files differ: the check can fail."""
    import json
    import os

    from tests.helpers.util import REPO
    from wonderland_ds.launch.command import free_port

    def run(out, *flags):
        port, procs = str(free_port()), []
        for r in range(2):
            env = dict(os.environ, RANK=str(r), WORLD_SIZE="2", LOCAL_RANK=str(r))
            env |= dict(LOCAL_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=port)
            env["OMP_NUM_THREADS"] = "1"
            cmd = [sys.executable, str(REPO / "tests/helpers/held_save_check.py"), str(out)]
            procs.append(
                subprocess.Popen(
                    cmd + list(flags),
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    cwd=REPO,
                )
            )
        outs = [p.communicate(timeout=300)[0] for p in procs]
        assert all(p.returncode == 0 for p in procs), outs[0][-3000:] + outs[1][-3000:]
        lines = [ln for ln in outs[0].splitlines() if ln.startswith("HELD-SAVE ")]
        return [json.loads(ln[len("HELD-SAVE ") :]) for ln in lines]

    fenced = run(tmp_path / "fenced")  # the default: the writer copies the held tensors
    assert [ranks[0]["zero"] for ranks in fenced] == [1, 2, 3]
    # async_save_copy false: serialized from the live tensors (ZeRO-2 only, for time).
    serialized = run(tmp_path / "serialized", "--serialize-held", "--zero", "2")
    assert [ranks[0]["zero"] for ranks in serialized] == [2]
    for ranks in fenced + serialized:
        for rep in ranks:
            assert rep["held_files"] and rep["files"] >= 3
            assert all(rep["equal"].values()), rep
            assert rep["fence_waited_s"] > 0.2, rep  # the steps really overlapped the writer
    # The control, on one ZeRO stage (ZeRO-1 and -2 share DeepSpeed's optimizer class; the
    # suite's time budget does not pay for all three): without the fence the files differ.
    unfenced = run(tmp_path / "unfenced", "--no-fence", "--zero", "2")
    assert [ranks[0]["zero"] for ranks in unfenced] == [2]
    for ranks in unfenced:
        optim = {f: ok for f, ok in ranks[0]["equal"].items() if "optim_states" in f}
        assert optim and not any(optim.values()), ranks[0]  # the hazard is real


def test_busy_until_written_and_while_an_error_is_unraised(tmp_path):
    """The stage loop all-reduces ``busy``: a save skips waiting and agreeing only when no
    rank's writer is busy, so a writer with an unraised error must read busy."""
    gate = threading.Event()
    w = _slow_writer(gate)
    assert not w.busy
    w.write({"x": torch.ones(1)}, str(tmp_path / "a.pt"), True)
    assert w.busy
    gate.set()
    w.wait()
    assert not w.busy
    w.write({"x": torch.ones(1)}, str(tmp_path / "missing" / "b.pt"), True)
    while w.pending:
        time.sleep(0.01)
    assert w.busy  # idle, but the failure is not raised yet: the next save must agree on it
    with pytest.raises(OSError):
        w.wait()
    assert not w.busy
    w.close()


def test_a_stuck_writer_times_the_fence_out(tmp_path):
    """A hung disk must end the run with an error, not hang the optimizer update forever."""
    gate = threading.Event()
    w = _slow_writer(gate)
    w.write({"p": torch.zeros(2)}, str(tmp_path / "a.pt"), True, held=True)
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError, match="did not serialize the held tensors"):
        w.fence(timeout=0.3)
    assert 0.25 <= time.perf_counter() - t0 < 5
    gate.set()
    w.wait()
    w.close()


@pytest.mark.parametrize(
    "feature",
    ["managed_gradient_accumulation", "zenflow", "super_offload", None],
)
def test_nothing_is_held_when_deepspeed_may_step_outside_the_fence(feature):
    """Unmanaged gradient accumulation, ZenFlow and SuperOffload update the optimizer outside
    the boundary step the loop fences: then every tensor is copied."""
    from types import SimpleNamespace

    from wonderland_ds.checkpoint.snapshot_engine import step_only_storages

    p = torch.nn.Parameter(torch.zeros(4))
    base = torch.optim.SGD([p], lr=0.1)
    engine = SimpleNamespace(
        module=torch.nn.Linear(2, 2),
        optimizer=base,
        managed_gradient_accumulation=lambda: feature != "managed_gradient_accumulation",
        zenflow=feature == "zenflow",
        super_offload=lambda: feature == "super_offload",
    )
    held = step_only_storages(engine)
    if feature is None:
        assert p.untyped_storage().data_ptr() in held and len(held) == 3  # p, weight, bias
    else:
        assert held == frozenset()


class _FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _FakeStream) -> None:
        self.log.append((self.name, "wait_stream", other.name))

    def wait_event(self, event: _FakeEvent) -> None:
        self.log.append((self.name, "wait_event", event.n))


class _FakeEvent:
    def __init__(self, log: list) -> None:
        self.log, self.n = log, 1 + sum(1 for e in log if e[0] == "record")

    def record(self, stream: _FakeStream) -> None:
        self.log.append(("record", self.n, stream.name))

    def synchronize(self) -> None:
        self.log.append(("sync", self.n))


class _FakeAccel:
    """DeepSpeed's accelerator API as an asynchronous device answers it, every call logged.
    Its copies are host copies (done at once); the order of the calls is what is checked."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.main = _FakeStream("main", self.log)
        self.pinned: list[int] = []  # data pointers of the page-locked buffers it made

    @property
    def Stream(self):
        return lambda: _FakeStream("side", self.log)

    @property
    def Event(self):
        return lambda: _FakeEvent(self.log)

    def stream(self, stream: _FakeStream):
        import contextlib

        @contextlib.contextmanager
        def ctx():
            self.log.append(("enter", stream.name))
            yield
            self.log.append(("exit", stream.name))

        return ctx()

    def current_stream(self) -> _FakeStream:
        return self.main

    def pin_empty(self, nbytes: int, dtype: torch.dtype) -> torch.Tensor:
        t = torch.empty(nbytes, dtype=dtype)
        self.pinned.append(t.data_ptr())
        return t

    def is_synchronized_device(self) -> bool:
        return False

    def synchronize(self) -> None:
        self.log.append(("synchronize",))


def _as_device(monkeypatch, *tensors: torch.Tensor) -> set[int]:
    """Make the stager treat these host tensors' storages as device ones, and fail any clone
    of them (a clone of a device storage would take device memory)."""
    from wonderland_ds.checkpoint import staging

    dev = {t.untyped_storage().data_ptr() for t in tensors}
    monkeypatch.setattr(staging, "_on_device", lambda s: s.data_ptr() in dev)
    clone = torch.UntypedStorage.clone

    def no_device_clone(self):
        assert self.data_ptr() not in dev, "a device storage was cloned"
        return clone(self)

    monkeypatch.setattr(torch.UntypedStorage, "clone", no_device_clone)
    return dev


def test_device_storages_go_to_pooled_host_buffers_on_a_side_stream(tmp_path, monkeypatch):
    """Device storages (stood in for by host ones): each save queues their copies into pooled
    page-locked buffers on a side stream that first waits for the current stream; the current
    stream waits at once for what a forward may change, and for the held storages only at
    the fence; the writer synchronizes both events before torch.save. Files are byte for
    byte what a synchronous torch.save of the state writes; the second save allocates no
    page-locked buffer, and a host storage of the same size never takes one."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    flat = torch.arange(12.0)  # held: e.g. the flat fp32 master weights, saved as views
    running = torch.zeros(3)  # not held: a buffer a forward may update
    host = torch.ones(3)  # a host tensor of the same size as `running`
    _as_device(monkeypatch, flat, running)
    accel = _FakeAccel()
    real_save = torch.save

    def logged_save(obj, f, **kw):
        accel.log.append(("torch.save",))
        real_save(obj, f, **kw)

    monkeypatch.setattr(torch, "save", logged_save)
    w = Writer(accel=accel)
    eng = SnapshotCheckpointEngine(object(), w, lambda: frozenset({flat.data_ptr()}))
    for k in (1, 2):
        (tmp_path / f"ref{k}").mkdir(), (tmp_path / f"ours{k}").mkdir()
        state = {"w": flat[:6], "m": flat[6:], "running": running, "host": host}
        # DeepSpeed's own, synchronous save (the name inside the zip is the writer's .tmp one)
        real_save(state, tmp_path / f"ref{k}" / "s.pt.tmp")
        accel.log.clear()
        w.pool.start()
        eng.save(state, str(tmp_path / f"ours{k}" / "s.pt"))
        mine = [e for e in accel.log if e[0] not in ("sync", "torch.save")]  # writer's
        assert mine == [
            ("side", "wait_stream", "main"),
            ("enter", "side"),
            ("exit", "side"),
            ("record", 1, "side"),
            ("main", "wait_event", 1),  # the buffer's copy: the current stream waits at once
            ("side", "wait_stream", "main"),
            ("enter", "side"),
            ("exit", "side"),
            ("record", 2, "side"),
        ], accel.log
        w.fence(timeout=10)
        assert accel.log.count(("main", "wait_event", 2)) == 1  # held: only at the fence
        w.fence(timeout=10)
        assert accel.log.count(("main", "wait_event", 2)) == 1  # once
        flat += 100  # the optimizer step
        running += 1  # the next forward
        w.wait()
        at = accel.log.index(("torch.save",))
        assert ("sync", 1) in accel.log[:at] and ("sync", 2) in accel.log[:at], accel.log
        ours = (tmp_path / f"ours{k}" / "s.pt").read_bytes()
        assert ours == (tmp_path / f"ref{k}" / "s.pt.tmp").read_bytes()
    assert len(accel.pinned) == 2  # first save only: flat's and running's
    assert w.pool.reused == 3  # the second save reused both page-locked buffers and host's
    assert {b.data_ptr() for b in w.pool._free[(12, True)]} == {accel.pinned[1]}
    assert w.pool._free[(12, False)][0].data_ptr() not in accel.pinned
    w.close()


def test_device_path_on_deepspeeds_cpu_accelerator(tmp_path, monkeypatch):
    """The same code on the accelerator this machine has (DeepSpeed's CPU one: no streams,
    no events, no pinning): copies are done at the save, the fence and the writer have no
    event to wait for, and the file equals a synchronous save of the state. Without a
    writer, snapshot() copies a device storage into a host buffer at once."""
    from wonderland_ds.checkpoint.snapshot_engine import SnapshotCheckpointEngine

    flat, running = torch.arange(8.0), torch.zeros(2)
    _as_device(monkeypatch, flat, running)
    state = {"a": flat[:4], "b": flat[4:], "running": running}
    (tmp_path / "ref").mkdir(), (tmp_path / "ours").mkdir()
    torch.save(state, tmp_path / "ref" / "s.pt.tmp")  # the zip's inner name: the writer's
    w = Writer()
    eng = SnapshotCheckpointEngine(object(), w, lambda: frozenset({flat.data_ptr()}))
    eng.save(state, str(tmp_path / "ours" / "s.pt"))
    assert w.stager.accel.is_synchronized_device() and w.stager.accel.Stream is None
    w.fence(timeout=10)
    flat += 1
    w.wait()
    w.close()
    ours = (tmp_path / "ours" / "s.pt").read_bytes()
    assert ours == (tmp_path / "ref" / "s.pt.tmp").read_bytes()
    snap = snapshot(state)
    flat += 1
    assert snap["a"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert snap["a"].untyped_storage().data_ptr() != flat.untyped_storage().data_ptr()
