"""What the guards' check all-reduce costs the loop, blocking against overlapped.

The check sums a few hundred bytes across ranks every ``guards.check_interval`` steps. This
times that collective through the same helpers engine.fit uses, between two gloo ranks, with
``--work-ms`` between checks: busy CPU on both ranks (``--work spin``: no core is left for
gloo's own thread, the pessimistic case on 2 cores) or a sleep (``--work sleep``: the cores are
free, as while a rank waits in DeepSpeed's collectives, about half of a digits step):

    OMP_NUM_THREADS=1 .venv/bin/torchrun --nproc_per_node 2 bench/bench_check_allreduce.py \\
        --reps 300 --work spin --out R.json

* ``blocking``: ``distributed.all_reduce_sum``, the time the call takes;
* ``overlapped``: ``distributed.all_reduce_sum_start``, then the work, then ``wait()``: the
  time the wait takes (what ``guards.overlap_check`` leaves on the loop).

Per rank, median and mean microseconds; sides alternate call by call.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as tdist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wonderland_ds.core import distributed as dist  # noqa: E402


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--work-ms", type=float, default=1.0)
    ap.add_argument("--work", choices=("spin", "sleep"), default="spin")
    ap.add_argument("--rows", type=int, default=10, help="steps per check (check_interval)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    tdist.init_process_group("gloo")
    world = dist.world_size()
    # The check's matrix: one row per step, 4 + 2 * world + 1 float64 columns (engine.fit).
    mat = torch.zeros(args.rows, 5 + 2 * world, dtype=torch.float64)
    work = args.work_ms / 1e3
    busy = spin if args.work == "spin" else time.sleep
    times: dict[str, list[float]] = {"blocking": [], "overlapped": []}
    for _ in range(args.reps):
        busy(work)
        t0 = time.perf_counter()
        dist.all_reduce_sum(mat)
        times["blocking"].append(time.perf_counter() - t0)
        handle = dist.all_reduce_sum_start(mat)
        busy(work)
        t0 = time.perf_counter()
        handle.wait()
        times["overlapped"].append(time.perf_counter() - t0)
    mine = {
        side: {
            "median_us": round(statistics.median(v[5:]) * 1e6, 1),
            "mean_us": round(statistics.fmean(v[5:]) * 1e6, 1),
        }
        for side, v in times.items()
    }
    every = dist.gather_all(mine)
    if dist.is_main():
        result = {
            "world": world,
            "bytes": mat.numel() * mat.element_size(),
            "work_ms": args.work_ms,
            "work": args.work,
            "reps": args.reps,
            "ranks": every,
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
    tdist.destroy_process_group()


if __name__ == "__main__":
    main()
