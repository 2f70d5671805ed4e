"""``wonderland doctor --prebuild``: compile DeepSpeed's JIT ops now, so the first training
start does not (on CPU: ``deepspeed_shm_comm``, which ``deepspeed.init_distributed`` builds on
first use).
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, TextIO

from wonderland_ds.core.findings import Finding
from wonderland_ds.doctor.ops import BUILD_ESTIMATE_S, extensions_root, needed_ops


def prebuild(
    ops: list[str] | None, stream: TextIO, ds_config: Mapping[str, Any] | None = None
) -> list[Finding]:
    """Build (or load from the cache) DeepSpeed's JIT ops, showing elapsed time."""
    from deepspeed.accelerator import get_accelerator

    from wonderland_ds.core import ds_internals

    ALL_OPS = ds_internals.attr("deepspeed.ops.op_builder.all_ops", "ALL_OPS")
    from tqdm import tqdm

    names = ops or needed_ops(get_accelerator()._name, ds_config)
    unknown = [n for n in names if n not in ALL_OPS]
    if unknown:
        return [
            Finding(
                "doctor-prebuild",
                "error",
                f"unknown op(s) {unknown}",
                f"choose from: {', '.join(sorted(ALL_OPS))}",
            )
        ]
    est = sum(BUILD_ESTIMATE_S.get(n, 60) for n in names)
    print(
        f"building DeepSpeed ops {', '.join(names)}: don't interrupt (first time ~{est} s;"
        " a build killed midway leaves a lock that makes every later start wait forever)",
        file=stream,
        flush=True,
    )
    out = []
    tty = bool(getattr(stream, "isatty", lambda: False)())
    bar = tqdm(
        total=len(names),
        file=stream,
        disable=not tty,
        unit="op",
        bar_format="{desc} {n_fmt}/{total_fmt} ops [{elapsed}]",
    )
    stop = threading.Event()

    def tick() -> None:  # keep the elapsed time moving while the compiler runs
        while not stop.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    # Build where a stage launched from this environment will look (launch.extensions_dir).
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root(os.environ))
    try:
        for name in names:
            bar.set_description_str(f"building {name}")
            cached = (extensions_root(os.environ) / name / f"{name}.so").exists()
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    ALL_OPS[name].load(verbose=False)
            except Exception as exc:  # noqa: BLE001 - a failed build is the finding
                out.append(
                    Finding(
                        "doctor-prebuild",
                        "error",
                        f"{name} failed to build: {str(exc).splitlines()[0][:300]}",
                        "run `ds_report`; check the compiler, ninja and nvcc findings above",
                    )
                )
                continue
            finally:
                bar.update(1)
            took = time.perf_counter() - t0
            line = (
                f"{name} was already built; loaded in {took:.1f} s"
                if cached
                else f"{name} built in {took:.1f} s"
            )
            if not tty:
                print(line, file=stream, flush=True)
            out.append(Finding("doctor-prebuild", "ok", line))
    finally:
        stop.set()
        ticker.join()
        bar.close()
    return out
