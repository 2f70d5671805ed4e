"""How ranks on the CPU hand freed memory back: glibc's mmap threshold fixed at 128 KiB.

glibc maps blocks from its mmap threshold (128 KiB) up and unmaps them when freed, but it
raises the threshold to the size of each mapped block freed, up to 32 MiB. After a ZeRO-3
rank's first steps free their gathered parameters and activations, blocks below that size
come from the heap and stay there when freed, so a rank's peak memory does not fall with the
world size. Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``, which is what
``MALLOC_MMAP_THRESHOLD_`` does at start) keeps large freed blocks going back at once.
Measured side by side on the causal-LM task: docs/performance.md.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 128 * 1024
#: WONDERLAND_CPU_MALLOC=glibc leaves glibc's defaults.
OPT_OUT = "WONDERLAND_CPU_MALLOC"


def fix_threshold(on_cpu: bool) -> dict[str, object]:
    """Fix the threshold in this rank when it computes on the CPU and neither
    ``MALLOC_MMAP_THRESHOLD_`` nor the opt-out is set; what was done, for run.json."""
    if not on_cpu:
        return {"mmap_threshold": None, "by": "not a CPU rank"}
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return {"mmap_threshold": os.environ["MALLOC_MMAP_THRESHOLD_"], "by": "environment"}
    if os.environ.get(OPT_OUT) == "glibc":
        return {"mmap_threshold": None, "by": f"{OPT_OUT}=glibc (glibc's dynamic threshold)"}
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name)
        ok = libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
    except (OSError, AttributeError, TypeError):  # not glibc: nothing to fix
        ok = False
    if not ok:
        return {"mmap_threshold": None, "by": "no glibc mallopt here"}
    return {"mmap_threshold": THRESHOLD, "by": "wonderland (mallopt)"}
