"""Cached loader vs a plain torch DataLoader over one file per sample.

    python bench/bench_loader.py [--task digits|pylm] [--reps 5] [--stage-run]

Both read the same samples in the same order with the same micro-batch size. The cached side is
wonderland's Prefetcher over the memory-mapped .npy cache; the plain side is a torch DataLoader
whose Dataset np.load()s one file per sample (how teams without a cache read their data).
`--stage-run` also runs a real 2-rank stage 15 and reports the data-stall fraction it measured.
Prints samples/s (min and median over --reps) and the ratio, measured side by side in one run.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from wonderland_ds.data import builtin, cache  # noqa: E402
from wonderland_ds.data.sampler import GlobalSampler, Prefetcher  # noqa: E402


class FilePerSample(Dataset):
    def __init__(self, folder: Path, n: int) -> None:
        self.folder, self.n = folder, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        x = np.load(self.folder / f"x_{i}.npy")
        y = np.load(self.folder / f"y_{i}.npy")
        return torch.from_numpy(x), torch.from_numpy(np.asarray(y))


def run_cached(task, micro: int, samples: int) -> float:
    sampler = GlobalSampler(len(task.train), seed=1)
    steps = samples // micro
    loader = Prefetcher(task.train.x, task.train.y, sampler, 0, micro, 1, 1, 0, steps)
    t0 = time.perf_counter()
    for _ in range(steps):
        loader.next()
    loader.close()
    return samples / (time.perf_counter() - t0)


def run_plain(folder: Path, task, micro: int, samples: int, workers: int) -> float:
    order = GlobalSampler(len(task.train), seed=1).indices(0, samples)
    loader = DataLoader(
        FilePerSample(folder, len(task.train)),
        batch_size=micro,
        sampler=list(order),
        num_workers=workers,
    )
    t0 = time.perf_counter()
    for _ in loader:
        pass
    return samples / (time.perf_counter() - t0)


def stage_stall(config: str, steps: int) -> dict:
    run = Path(tempfile.mkdtemp()) / "run"
    cmd = [
        sys.executable,
        "-m",
        "wonderland_ds.cli.main",
        "train",
        "--stage",
        "15",
        "--config",
        config,
        "--run-dir",
        str(run),
        "--steps",
        str(steps),
    ]
    subprocess.run(cmd, check=True, capture_output=True, cwd=REPO)
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    shutil.rmtree(run.parent)
    return {
        "steps": entry["steps"],
        "seconds": entry["seconds"],
        "data_stall_fraction": entry["data_stall_fraction"],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits", choices=["digits", "pylm"])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--samples", type=int, default=8192)
    ap.add_argument("--stage-run", action="store_true")
    args = ap.parse_args()
    raw = builtin.load(args.task).materialize()
    work = Path(tempfile.mkdtemp())
    try:
        cache.write(raw, work / "cache")
        task = cache.open_task(builtin.load(args.task), work / "cache")
        files = work / "files"
        files.mkdir()
        for i in range(len(raw.train)):
            np.save(files / f"x_{i}.npy", raw.train.x[i])
            np.save(files / f"y_{i}.npy", raw.train.y[i])
        rows = {
            "cached (wonderland Prefetcher, mmap)": [],
            "DataLoader, files, 0 workers": [],
            "DataLoader, files, 2 workers": [],
        }
        for _ in range(args.reps):  # interleaved: the machine's noise hits all sides alike
            rows["cached (wonderland Prefetcher, mmap)"].append(
                run_cached(task, args.micro, args.samples)
            )
            rows["DataLoader, files, 0 workers"].append(
                run_plain(files, raw, args.micro, args.samples, 0)
            )
            rows["DataLoader, files, 2 workers"].append(
                run_plain(files, raw, args.micro, args.samples, 2)
            )
    finally:
        shutil.rmtree(work)
    base = statistics.median(rows["cached (wonderland Prefetcher, mmap)"])
    print(f"task {args.task}: {args.samples} samples, micro-batch {args.micro}, {args.reps} reps")
    print(f"{'loader':40} {'min samples/s':>14} {'median':>10} {'cached/this':>12}")
    for name, vals in rows.items():
        med = statistics.median(vals)
        print(f"{name:40} {min(vals):14.0f} {med:10.0f} {base / med:12.1f}x")
    if args.stage_run:
        config = str(
            REPO
            / "ds_configs"
            / ("cpu_zero2_bf16.json" if args.task == "digits" else "cpu_zero2_bf16_pylm.json")
        )
        steps = 200 if args.task == "digits" else 30
        print(f"2-rank stage 15 ({config}, {steps} steps):", json.dumps(stage_stall(config, steps)))


if __name__ == "__main__":
    main()
