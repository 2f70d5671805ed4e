"""Whether this host has an accelerator, from its device nodes alone (no torch import)."""

from __future__ import annotations

import glob

#: Device nodes of the accelerators DeepSpeed drives (NVIDIA, AMD, Intel, Habana, Neuron).
NODES = ("/dev/nvidia[0-9]*", "/dev/kfd", "/dev/dri/renderD*", "/dev/accel*", "/dev/neuron*")


def has_accelerator() -> bool:
    return any(glob.glob(pattern) for pattern in NODES)
