"""megatron-core's indexed dataset module, imported without its side effect on torch: importing
``megatron.core`` adds 26 classes (numpy's reconstructors, ``PosixPath``, ...) to torch's
``weights_only`` allowlist process-wide, which would change what other tests' ``torch.load``
accepts."""

from __future__ import annotations

import warnings
from types import ModuleType

import pytest


def indexed_dataset() -> ModuleType:
    import torch

    before = torch.serialization.get_safe_globals()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            return pytest.importorskip("megatron.core.datasets.indexed_dataset")
    finally:
        torch.serialization.clear_safe_globals()
        torch.serialization.add_safe_globals(before)
