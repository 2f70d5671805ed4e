"""Whether this machine's CPU computes bf16 natively: without AVX512-BF16 or AMX (x86) or the
bf16 extension (Arm), torch emulates every bf16 matmul and a CPU step runs many times slower
than in fp32. Read from /proc/cpuinfo; no torch import (``check`` stays fast)."""

from __future__ import annotations

import platform
from pathlib import Path

from wonderland_ds.core.devices import has_accelerator
from wonderland_ds.core.findings import Finding

#: cpuinfo flags that mean native bf16 arithmetic.
NATIVE = ("avx512_bf16", "amx_bf16", "bf16")
FP32_CONFIG = "ds_configs/cpu_zero2_fp32.json"


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in ("flags", "Features"):
            return set(value.split())
    return set()


def has_gpu() -> bool:
    """An accelerator's device node exists (the stage would not compute on the CPU)."""
    return has_accelerator()


def bf16_emulated(flags: set[str] | None = None) -> bool | None:
    """True: this CPU has no native bf16; None: cannot tell (no flags read)."""
    flags = cpu_flags() if flags is None else flags
    if not flags:
        return None
    return not any(f in flags for f in NATIVE)


def check_bf16(precision: str, where: str = "") -> list[Finding]:
    """A warning for a bf16 config on a GPU-less machine whose CPU would emulate bf16."""
    if precision != "bf16" or has_gpu() or not bf16_emulated():
        return []
    cpu = platform.processor() or platform.machine()
    return [
        Finding(
            "cpu-bf16",
            "warn",
            f"bf16 would be emulated on this machine's CPU ({cpu}: no AVX512-BF16, AMX or bf16"
            " extension): a training step on the CPU runs many times slower than in fp32",
            f"on this machine train in fp32 (e.g. {FP32_CONFIG}); keep bf16 for the GPU nodes",
            where,
            "bf16.enabled",
        )
    ]
