"""gloo's threads get a short Linux time slice while a stage trains (``wonderland.gloo_slice_us``).

Why: a gloo collective completes on gloo's own threads (``pt_gloo_runloop``, the process
group's work threads, and ``gloo_tcp_loop``, its socket loop). Each wakes for a few
microseconds of work while the step loop computes on the same core, and Linux's scheduler
(EEVDF) lets the running thread go on to the end of its time slice first: 0.7 ms times
1 + log2(cores) by default, 1.4 ms on 2 cores. A small collective so waits out most of the
loop's slice at each hop, and every rank waits for it at the next collective. Since Linux 6.12
a thread's slice can be set (``sched_setattr``'s ``sched_runtime`` under SCHED_OTHER), and a
thread waking with a shorter slice than the running one preempts it at once. Measured on
digits (2 ranks, 2 cores, 20 repetitions side by side, BENCHMARKS.md section 2): the stage's
step 0.96 / 0.95 / 0.91 of a plain DeepSpeed loop's on ZeRO-1/2/3 with gloo's threads at
0.1 ms, 1.03 / 1.01 / 0.96 without.

Only gloo's threads that exist when the block starts change (found by their names in
``/proc/self/task``), and they are back at their slice when it ends. No privilege is needed,
for another thread of one's own process as for oneself. NCCL's threads carry no name unless
``NCCL_SET_THREAD_NAME=1`` and are left alone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import platform
import sys
from collections.abc import Iterator
from pathlib import Path

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
    import threading

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
