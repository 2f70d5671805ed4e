"""Costs of two pieces of the step loop, measured apart in one process.

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_parts.py --steps 400 --reps 5 --out R.json

1. Metrics: one step's events (the 14 tags engine.fit writes on a 2-rank digits run) through
   DeepSpeed's own ``MonitorMaster.write_events``, event by event, against
   ``monitor.write_batch`` (batched), and with the CSV files opened once per batch instead of
   kept open (``write_batch_reopen_ms``), all into a CSV and a TensorBoard writer; CPU time per
   step of the process (TensorBoard's writer thread included), written every 10 steps as the
   sink does.
2. Guard hooks: forward and backward of a small bf16 model (digits' shapes) without a hook,
   with the guards' per-gradient norm hook (the norm in the gradient's dtype) and with the
   hook it replaced (an fp32 result); CPU microseconds per hooked gradient.
Sides alternate within each repetition; min and median over repetitions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wonderland_ds.training import metrics as monitor  # noqa: E402
from wonderland_ds.training.rows import StepRow  # noqa: E402


def _master(folder: Path):
    import deepspeed.comm
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    deepspeed.comm.get_rank = lambda *a, **k: 0  # rank 0 of a process group that is not there
    sections = monitor.monitor_sections({}, folder, tensorboard=True)
    return MonitorMaster(get_monitor_config(sections))


def _events(steps: int, start: int) -> list[list[tuple[str, float, int]]]:
    """Batches of 10 steps of fit-shaped events."""
    sink = monitor.MetricsSink({}, Path("unused"), rank=1, samples_per_step=128)
    batches: list[list[tuple[str, float, int]]] = []
    for s in range(start + 1, start + steps + 1):
        row = {
            "step": s,
            "loss": f"{2.0 / s:.8g}",
            "lr": "0.001",
            "grad_norm": "0.5",
            "samples": 128 * s,
            "step_s": "0.013",
            "data_wait_s": "0.0001",
            "wall": f"{1000 + 0.013 * s:.6f}",
        }
        extra = monitor.guard_figures([0.5, 0.4], loss_median=1.5, skipped_steps=0, events=0)
        if (s - start - 1) % 10 == 0:
            batches.append([])
        batches[-1] += sink.events(StepRow.parse(row), extra=extra)
    return batches


def metrics(steps: int, reps: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="wl-parts-"))
    theirs, ours = _master(folder / "ds"), _master(folder / "ours")
    files: dict = {}  # CSV files kept open between batches, as MetricsSink keeps them
    sides = (
        ("ds_write_events_ms", theirs.write_events),
        ("write_batch_reopen_ms", lambda b: monitor.write_batch(ours, b)),
        ("write_batch_ms", lambda b: monitor.write_batch(ours, b, files)),
    )
    out: dict = {"tags_per_step": None, **{k: [] for k, _ in sides}}
    for rep in range(reps):
        batches = _events(steps, rep * steps)
        out["tags_per_step"] = sum(len(b) for b in batches) / steps
        for key, write in sides:
            t0 = time.process_time()  # every thread: TensorBoard's writer thread included
            for b in batches:
                write(b)
            out[key].append((time.process_time() - t0) / steps * 1e3)
    return out


def hooks(steps: int, reps: int) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10)
    ).bfloat16()
    x, y = torch.randn(16, 64).bfloat16(), torch.randint(0, 10, (16,))
    norms: list[torch.Tensor] = []

    def hook_fp32(grad: torch.Tensor) -> torch.Tensor:  # the guards' earlier fp32 hook
        norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        return grad

    def hook(grad: torch.Tensor) -> torch.Tensor:  # guards.StepGuards._hook: native dtype
        norms.append(torch.linalg.vector_norm(grad))
        return grad

    def run() -> float:
        t0 = time.process_time()
        for _ in range(steps):
            for _ in range(4):  # 4 micro-batches a step
                torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            norms.clear()
        return (time.process_time() - t0) / steps

    params = [p for p in model.parameters() if p.requires_grad]
    # The norm alone on this model's gradient shapes (timeit, best of 7: the whole-step
    # figures below move by more than the difference on a busy machine).
    import timeit

    grads = [torch.randn_like(p) for p in params]
    norm_us = {
        name: min(timeit.repeat(lambda fn=fn: [fn(g) for g in grads], number=2000, repeat=7))
        / (2000 * len(grads))
        * 1e6
        for name, fn in (
            ("fp32_result", lambda g: torch.linalg.vector_norm(g, dtype=torch.float32)),
            ("native", lambda g: torch.linalg.vector_norm(g)),
        )
    }
    sides = {"plain_ms": None, "hooked_fp32_ms": hook_fp32, "hooked_ms": hook}
    out: dict = {
        "hooked_grads_per_step": 4 * len(params),
        "norm_us_best": {k: round(v, 2) for k, v in norm_us.items()},
        **{k: [] for k in sides},
    }
    run()  # warm-up
    for _ in range(reps):
        for key, fn in sides.items():  # alternating within each repetition
            handles = [p.register_hook(fn) for p in params] if fn else []
            out[key].append(run() * 1e3)
            for h in handles:
                h.remove()
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    m, h = metrics(args.steps, args.reps), hooks(args.steps, args.reps)
    m["ratio_min"] = round(min(m["ds_write_events_ms"]) / min(m["write_batch_ms"]), 2)
    m["ratio_min_reopen"] = round(min(m["write_batch_reopen_ms"]) / min(m["write_batch_ms"]), 2)
    for key in ("hooked_ms", "hooked_fp32_ms"):
        per_grad = [
            (a - b) * 1e3 / h["hooked_grads_per_step"] for a, b in zip(h[key], h["plain_ms"])
        ]
        h[f"us_per_grad_{key[:-3]}_median"] = round(statistics.median(per_grad), 2)
    result = {"metrics": m, "hooks": h}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
