"""CPU-only scheduling tuning while a stage trains, all off by default.

Four knobs of the ``wonderland`` settings, each 0/false unless a config sets it, applied
together by :func:`tuned` around the step loop:

* ``loop_nice``: the loop's thread runs nicer (:func:`nicer_thread`);
* ``gloo_slice_us``: gloo's threads get a short Linux time slice (:func:`short_gloo_slices`);
* ``gil_switch_us``: a shorter GIL switch interval (:func:`short_gil_waits`);
* ``tensorboard_fast_crc``: TensorBoard's record checksums in C (:func:`fast_tensorboard_crc`).

They help only where the step is a few milliseconds of CPU work that shares its cores with
gloo's threads and the background writers; on a GPU node the loop thread is the one launching
kernels, and a step of a hundred milliseconds or more hides what they save.

Time slices: a gloo collective completes on gloo's own threads (``pt_gloo_runloop``, the
process group's work threads, and ``gloo_tcp_loop``, its socket loop). Each wakes for a few
microseconds of work while the step loop computes on the same core, and Linux's scheduler
(EEVDF) lets the running thread go on to the end of its time slice first. Since Linux 6.12 a
thread's slice can be set (``sched_setattr``'s ``sched_runtime`` under SCHED_OTHER), and a
thread waking with a shorter slice than the running one preempts it at once. Only gloo's
threads that exist when the block starts change (found by their names in
``/proc/self/task``), and they are back at their slice when it ends; no privilege is needed.
NCCL's threads carry no name unless ``NCCL_SET_THREAD_NAME=1`` and are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core import distributed as dist

# Names that gloo and PyTorch's gloo process group give their threads (pthread_setname_np).
GLOO_THREAD_PREFIXES = ("gloo_", "pt_gloo")
# (sched_setattr, sched_getattr) system call numbers.
_SYSCALLS = {"x86_64": (314, 315), "aarch64": (274, 275)}
_FAIR = (0, 3)  # SCHED_OTHER, SCHED_BATCH: the policies a time slice belongs to


class _SchedAttr(ctypes.Structure):
    """``struct sched_attr``, SCHED_ATTR_SIZE_VER0 (48 bytes)."""

    _fields_ = [
        ("size", ctypes.c_uint32),
        ("sched_policy", ctypes.c_uint32),
        ("sched_flags", ctypes.c_uint64),
        ("sched_nice", ctypes.c_int32),
        ("sched_priority", ctypes.c_uint32),
        ("sched_runtime", ctypes.c_uint64),
        ("sched_deadline", ctypes.c_uint64),
        ("sched_period", ctypes.c_uint64),
    ]


def gloo_threads(task_dir: Path = Path("/proc/self/task")) -> dict[int, str]:
    """This process's gloo threads: thread id -> name."""
    found = {}
    for entry in task_dir.iterdir():
        try:
            name = (entry / "comm").read_text().strip()
        except OSError:  # the thread ended meanwhile
            continue
        if name.startswith(GLOO_THREAD_PREFIXES):
            found[int(entry.name)] = name
    return found


class _Sched:
    """sched_getattr / sched_setattr through libc's syscall()."""

    def __init__(self, numbers: tuple[int, int]):
        self.set_nr, self.get_nr = numbers
        self.libc = ctypes.CDLL(None, use_errno=True)

    def get(self, tid: int) -> _SchedAttr:
        attr = _SchedAttr()
        if self.libc.syscall(self.get_nr, tid, ctypes.byref(attr), ctypes.sizeof(attr), 0):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))
        return attr

    def set(self, tid: int, attr: _SchedAttr) -> None:
        attr.size = ctypes.sizeof(attr)
        if self.libc.syscall(self.set_nr, tid, ctypes.byref(attr), 0):
            code = ctypes.get_errno()
            raise OSError(code, os.strerror(code))


def _sched() -> _Sched | str:
    if not sys.platform.startswith("linux"):
        return "per-thread time slices are Linux only"
    numbers = _SYSCALLS.get(platform.machine())
    if numbers is None:
        return f"sched_setattr's system call number is not known on {platform.machine()}"
    return _Sched(numbers)


def slices_supported() -> str | None:
    """None where a thread's time slice can be set here, or why not."""
    sched = _sched()
    if isinstance(sched, str):
        return sched
    try:
        attr = sched.get(threading.get_native_id())
    except OSError as exc:
        return f"sched_getattr failed: {exc.strerror}"
    if attr.sched_runtime == 0:
        return f"this kernel ({platform.release()}) has no per-thread time slices (6.12+)"
    return None


@contextlib.contextmanager
def short_gloo_slices(slice_us: int) -> Iterator[str | None]:
    """gloo's threads at a time slice of ``slice_us`` microseconds inside the block, then
    back at theirs; yields None, or why nothing changed (nothing changes then)."""
    if slice_us <= 0:
        yield None
        return
    sched = _sched()
    if isinstance(sched, str):
        yield sched
        return
    changed: list[tuple[int, _SchedAttr]] = []
    why: str | None = None
    threads = gloo_threads()  # none under another backend: nothing to do
    for tid, name in threads.items():
        try:
            attr = sched.get(tid)
            if attr.sched_policy not in _FAIR:
                continue  # real-time or idle: someone chose that; a slice does not apply
            if attr.sched_runtime == 0:  # before 6.12 the kernel reports no fair slice
                why = slices_supported() or "the kernel reports no time slice"
                break
            before = _SchedAttr.from_buffer_copy(attr)
            attr.sched_runtime = slice_us * 1000
            sched.set(tid, attr)
            changed.append((tid, before))
        except OSError as exc:
            if exc.errno == errno.ESRCH:  # the thread ended meanwhile
                continue
            why = f"sched_setattr refused on thread {tid} ({name}): {exc.strerror}"
            break
    if why is not None:  # all or nothing
        _restore(sched, changed)
        changed = []
    try:
        yield why
    finally:
        _restore(sched, changed)


def _restore(sched: _Sched, changed: list[tuple[int, _SchedAttr]]) -> None:
    for tid, before in changed:
        try:
            current = sched.get(tid)
            current.sched_runtime = before.sched_runtime
            sched.set(tid, current)
        except OSError:
            pass  # the thread ended (its group was destroyed): nothing to put back


@contextlib.contextmanager
def short_gil_waits(interval_s: float) -> Iterator[None]:
    """Python's GIL switch interval at most ``interval_s`` inside the block, then as it was
    (a smaller interval the caller set is kept; 0 or less changes nothing).

    Why: the step loop shares its process with threads that hold the GIL in bursts (rank 0's
    metrics writer, the checkpoint writer serializing a save). When the loop returns from a
    call that released the GIL (a collective, the backward) while such a thread holds it, it
    waits up to the switch interval for it, and every rank then waits for it at the next
    collective."""
    before = sys.getswitchinterval()
    if interval_s > 0:
        sys.setswitchinterval(min(before, interval_s))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def nicer_thread(increment: int) -> Iterator[str | None]:
    """The calling thread's nice value raised by ``increment`` (at most 19) inside the block,
    then as it was where the system lets it back; yields None, or why nothing changed.

    Why: the step loop is one thread per rank doing compute, and a collective completes on
    other threads (gloo's work and TCP threads, the rendezvous store). When such a thread wakes
    while the loop computes on its core, Linux lets it run only once the loop's slice is used
    up, and every rank waits at the next collective for it. A nicer loop thread lets them in
    sooner.

    Only this thread changes: Linux keeps a nice value per thread (setpriority(2) with a
    thread id), and threads it starts inside the block inherit it (the metrics and checkpoint
    writers: background work). Raising a nice value needs no privilege; lowering it back needs
    CAP_SYS_NICE or a RLIMIT_NICE allowance, without which the thread stays nicer."""
    if increment <= 0:
        yield None
        return
    if not sys.platform.startswith("linux"):
        yield "per-thread nice values are Linux only"
        return
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, before + increment))
    except OSError as exc:
        yield f"setpriority refused: {exc}"
        return
    try:
        yield None
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, before)
        except OSError:
            pass  # no CAP_SYS_NICE / RLIMIT_NICE: the thread stays nicer (see above)


def fast_tensorboard_crc() -> bool:
    """Give TensorBoard's event writer a C CRC32C. Every TFRecord it writes carries two masked
    CRC32C sums that TensorBoard computes in pure Python (a byte-at-a-time table loop). The
    replacement is installed into TensorBoard's record writer only when ``google_crc32c`` has
    its C implementation and agrees with TensorBoard's own function on test vectors; otherwise
    nothing changes (same bytes, slower). Returns whether the C checksum is in use; idempotent,
    and :func:`stock_tensorboard_crc` puts TensorBoard's own back."""
    try:
        import google_crc32c
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return False
    if getattr(record_writer.masked_crc32c, "_wonderland", False):
        return True
    if google_crc32c.implementation != "c":
        return False
    value = google_crc32c.value

    def masked_crc32c(data: bytes) -> int:
        x = value(data)
        return (((x >> 15) | (x << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    vectors = [b"", b"a", bytes(range(256)) * 3, b"\x00" * 8, b"wonderland" * 41]
    if any(masked_crc32c(v) != pywrap_tensorflow.masked_crc32c(v) for v in vectors):
        return False
    masked_crc32c._wonderland = True  # type: ignore[attr-defined]
    record_writer.masked_crc32c = masked_crc32c
    return True


def stock_tensorboard_crc() -> None:
    """TensorBoard's own record checksum back, where :func:`fast_tensorboard_crc` replaced it."""
    try:
        from tensorboard.compat.tensorflow_stub import pywrap_tensorflow
        from tensorboard.summary.writer import record_writer
    except ImportError:
        return
    if getattr(record_writer.masked_crc32c, "_wonderland", False):
        record_writer.masked_crc32c = pywrap_tensorflow.masked_crc32c


@contextlib.contextmanager
def tuned(settings: WonderlandSettings) -> Iterator[None]:
    """The CPU-only tuning ``settings`` switch on, for the block (all off by default). A
    knob this host cannot apply is said once on rank 0, and the stage trains without it."""
    with (
        short_gil_waits(settings.gil_switch_us / 1e6),
        nicer_thread(settings.loop_nice) as why_not,
        short_gloo_slices(settings.gloo_slice_us) as why_not_gloo,
    ):
        if why_not is not None and dist.is_main():
            print(
                f"[wonderland] loop_nice {settings.loop_nice} not applied ({why_not}):"
                " the step loop runs at its usual priority",
                file=sys.stderr,
                flush=True,
            )
        if why_not_gloo is not None and dist.is_main():
            print(
                f"[wonderland] gloo_slice_us {settings.gloo_slice_us} not applied"
                f" ({why_not_gloo}): gloo's threads keep their time slice",
                file=sys.stderr,
                flush=True,
            )
        crc = settings.tensorboard_fast_crc and fast_tensorboard_crc()
        try:
            yield
        finally:
            if crc:
                stock_tensorboard_crc()
