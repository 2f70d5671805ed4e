"""The disk's sequential speeds, measured beside the benchmarks that compare against them."""

from __future__ import annotations

import os
import time
from pathlib import Path


def write_speed(folder: Path, mb: int = 512, keep: bool = False) -> float:
    """Bytes/s writing ``mb`` MiB of random data with an fsync at the end."""
    path = folder / "dd.bin"
    block = os.urandom(1 << 20)
    t0 = time.perf_counter()
    with open(path, "wb") as fh:
        for _ in range(mb):
            fh.write(block)
        fh.flush()
        os.fsync(fh.fileno())
    took = time.perf_counter() - t0
    if not keep:
        path.unlink()
    return mb * (1 << 20) / took


def read_speed(path: Path) -> tuple[float, bool]:
    """Bytes/s reading ``path`` once, and whether the page cache could be dropped first
    (root only: otherwise the read may come from memory)."""
    dropped = False
    try:
        Path("/proc/sys/vm/drop_caches").write_text("3\n")
        dropped = True
    except OSError:
        pass
    t0 = time.perf_counter()
    with open(path, "rb") as fh:
        while fh.read(1 << 24):
            pass
    return path.stat().st_size / (time.perf_counter() - t0), dropped
