"""A wider byte-level GPT for the checkpoint and resume benchmarks, as a ``module:function`` task.

``--task bench.big_task:pylm`` (run with the repository on PYTHONPATH); the size comes from
WL_BENCH_DIM / WL_BENCH_LAYERS (default 512 x 8: 25.5M parameters).
"""

from __future__ import annotations

import os

from wonderland_ds.data import builtin, tasks


def pylm() -> tasks.Task:
    dim = int(os.environ.get("WL_BENCH_DIM", "512"))
    layers = int(os.environ.get("WL_BENCH_LAYERS", "8"))
    return builtin.pylm(dim, layers)
