"""Costs of two pieces of the step loop, measured apart in one process (BENCHMARKS.md section 2).

    OMP_NUM_THREADS=1 .venv/bin/python bench/bench_parts.py --steps 400 --reps 5 --out R.json

1. Metrics: one step's events (the 14 tags engine.fit writes on a 2-rank digits run) through
   DeepSpeed's own ``MonitorMaster.write_events``, event by event, against
   ``monitor.write_batch`` (batched), both into a CSV and a TensorBoard writer; CPU time per step
   of the writing thread's work, written every 10 steps as the sink does.
2. Guard hooks: forward and backward of a small bf16 model (digits' shapes) with and without
   the guards' per-gradient norm hook; microseconds per hooked gradient.
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

from wonderland_ds import monitor  # noqa: E402


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
        batches[-1] += sink.events(row, extra=extra)
    return batches


def metrics(steps: int, reps: int) -> dict:
    folder = Path(tempfile.mkdtemp(prefix="wl-parts-"))
    theirs, ours = _master(folder / "ds"), _master(folder / "ours")
    out: dict = {"tags_per_step": None, "ds_write_events_ms": [], "write_batch_ms": []}
    for rep in range(reps):
        batches = _events(steps, rep * steps)
        out["tags_per_step"] = sum(len(b) for b in batches) / steps
        for key, write in (
            ("ds_write_events_ms", theirs.write_events),
            ("write_batch_ms", lambda b: monitor.write_batch(ours, b)),
        ):
            t0 = time.process_time()
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

    def hook(grad: torch.Tensor) -> torch.Tensor:  # the guards' hook (guards.StepGuards._hook)
        norms.append(torch.linalg.vector_norm(grad, dtype=torch.float32))
        return grad

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            for _ in range(4):  # 4 micro-batches a step
                torch.nn.functional.cross_entropy(model(x).float(), y).backward()
            norms.clear()
        return (time.perf_counter() - t0) / steps

    params = [p for p in model.parameters() if p.requires_grad]
    out: dict = {"hooked_grads_per_step": 4 * len(params), "plain_ms": [], "hooked_ms": []}
    run()  # warm-up
    for _ in range(reps):
        out["plain_ms"].append(run() * 1e3)
        handles = [p.register_hook(hook) for p in params]
        out["hooked_ms"].append(run() * 1e3)
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
    per_grad = [
        (a - b) * 1e3 / h["hooked_grads_per_step"] for a, b in zip(h["hooked_ms"], h["plain_ms"])
    ]
    h["us_per_hooked_grad_median"] = round(statistics.median(per_grad), 2)
    result = {"metrics": m, "hooks": h}
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
