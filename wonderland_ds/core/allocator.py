"""How ranks on the CPU hand freed memory back: glibc's mmap threshold, fixed on request.

glibc maps blocks from its mmap threshold (128 KiB at start) up and unmaps them when freed,
but it raises the threshold to the size of each mapped block freed, up to 32 MiB. After a
ZeRO-3 rank's first steps free their gathered parameters and buffers, blocks below that size
come from the heap and stay there when freed, so a rank's peak memory falls less with the
world size. ``wonderland.cpu_mmap_threshold`` fixes the threshold (``mallopt``, what
``MALLOC_MMAP_THRESHOLD_`` does at start): at 128 KiB large freed blocks go back at once, but
every activation is then mapped and zeroed anew each step. Measured side by side on the
causal-LM task (docs/performance.md): neither glibc setting is both lean and free, so the
default stays glibc's.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h


def fix_threshold(on_cpu: bool, threshold: int | None) -> dict[str, object]:
    """Fix the threshold in this rank when it computes on the CPU, ``threshold`` is given and
    the environment does not set ``MALLOC_MMAP_THRESHOLD_``; what holds, for run.json."""
    if not on_cpu:
        return {"mmap_threshold": None, "by": "not a CPU rank"}
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return {"mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"], "by": "environment"}
    if threshold is None:
        return {"mmap_threshold": None, "by": "glibc's default (dynamic)"}
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"))
        ok = libc.mallopt(M_MMAP_THRESHOLD, threshold) == 1
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to fix
        ok = False
    if not ok:
        return {"mmap_threshold": None, "by": "no glibc mallopt here"}
    return {"mmap_threshold": threshold, "by": "wonderland.cpu_mmap_threshold (mallopt)"}
