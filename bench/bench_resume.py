"""Resume benchmark: seconds from launch to the end of the first training step.

    .venv/bin/python bench/bench_resume.py --reps 3 --out resume.json

One stage-15 checkpoint of a 25.5M-parameter GPT (ZeRO-2 bf16, 2 ranks) is made once; then,
alternating sides each repetition (the machine is noisy):

* ``wonderland_same``: ``wonderland train --stage 16 --resume auto`` on 2 ranks (preflight with
  sha256 verification, pickle scan, start-of-stage all-reduce check, everything a stage does);
* ``deepspeed_same``: a plain script under ``deepspeed --num_gpus 2``: initialize,
  ``load_checkpoint``, one step (bench/ds_resume.py);
* ``wonderland_changed``: the same on 3 ranks: wonderland converts through ``ds_to_universal``;
* ``deepspeed_changed``: ``python -m deepspeed.checkpoint.ds_to_universal`` by hand, then the plain
  script on 3 ranks with ``checkpoint.load_universal``.

Both sides resume from a copy of the checkpoint made just before (the wonderland side copies
the whole run folder, the DeepSpeed side the checkpoint folder). Both sides are timed from the moment the command starts to the wall-clock time their first
optimizer step ended (wonderland: the first row of metrics.csv). The disk's sequential write
and read speeds are measured in the same run; the conversion's throughput is (bytes read +
bytes written) / conversion seconds, against what the disk needs to read and write as much.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from disk import read_speed, write_speed  # noqa: E402

from wonderland_ds.launch.command import free_port  # noqa: E402

BIN = Path(sys.executable).parent


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def config(folder: Path, dim: int, layers: int) -> Path:
    cfg = json.loads((REPO / "ds_configs" / "cpu_zero2_bf16_pylm.json").read_text())
    cfg["train_micro_batch_size_per_gpu"] = 2
    cfg["gradient_accumulation_steps"] = 1
    cfg["wonderland"].update(
        task="bench.big_task:pylm",
        stage_train_steps={"15": 2, "16": 1},
        min_warmup_steps=0,
        keep_last=1,
        log_interval=1,
    )
    path = folder / "config.json"
    path.write_text(json.dumps(cfg, indent=1))
    return path


def run(cmd: list[str], log: Path) -> float:
    """Start time of the command (wall clock); raises with the log tail on failure."""
    t0 = time.time()
    with open(log, "w") as fh:
        proc = subprocess.run(cmd, cwd=REPO, env=env(), stdout=fh, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log.read_text()[-3000:]}")
    return t0


def first_step_wall(run_dir: Path, stage: int) -> float:
    with open(run_dir / f"stage{stage}" / "metrics.csv") as fh:
        return float(next(csv.DictReader(fh))["wall"])


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def disk_speeds(folder: Path, mb: int = 1024) -> dict[str, float]:
    write = write_speed(folder, mb, keep=True)
    read, cold = read_speed(folder / "dd.bin")
    (folder / "dd.bin").unlink()
    return {"write_Bps": write, "read_Bps": read, "read_cold": cold}


def wonderland(cfg: Path, src: Path, work: Path, name: str, hostfile: str) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(src, run_dir, symlinks=True)
    os.sync()  # the copy's writeback must not run inside the timed launch
    cmd = [str(BIN / "wonderland"), "train", "--stage", "16", "--config", str(cfg)]
    cmd += ["--run-dir", str(run_dir), "--resume", "auto", "--hostfile", hostfile]
    t0 = run(cmd, work / f"{name}.log")
    out = {"launch_to_first_step_s": first_step_wall(run_dir, 16) - t0}
    infos = list(run_dir.rglob("*_universal/wonderland_meta.json"))
    if infos:
        uni = infos[0].parent
        meta = json.loads(infos[0].read_text())
        out["conversion_s"] = meta["conversion_seconds"]
        out["universal_bytes"] = tree_bytes(uni)
    shutil.rmtree(run_dir)
    return out


def deepspeed(cfg: Path, ckpt: Path, work: Path, name: str, nproc: int) -> dict:
    out_json = work / f"{name}.json"
    port = str(free_port())  # outside the ephemeral range, free now, as the engine's own launches
    # A fresh copy of the checkpoint, as the wonderland side resumes from a fresh copy of the
    # run: reading files copied just before is measurably slower here (a conversion of a
    # fresh copy took 2.0-2.4 s, of the same files a minute later 0.65-0.95 s), so both sides
    # must read the same kind of copy.
    fresh = work / f"{name}-ckpt" / ckpt.name
    shutil.rmtree(fresh.parent, ignore_errors=True)
    shutil.copytree(ckpt, fresh, symlinks=True)
    ckpt = fresh
    os.sync()  # as for the wonderland side: start with no writeback pending
    launch = [str(BIN / "deepspeed"), "--num_gpus", str(nproc), "--no_ssh_check"]
    launch += ["--master_addr", "127.0.0.1", "--master_port", port, "bench/ds_resume.py"]
    t0 = time.time()
    result: dict = {}
    load_dir, tag, use_cfg = ckpt.parent, ckpt.name, cfg
    if nproc != 2:  # changed topology: convert by hand, then load universal
        uni_root = work / f"{name}-universal"
        shutil.rmtree(uni_root, ignore_errors=True)
        conv = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
        conv += ["--input_folder", str(ckpt)]
        conv += ["--output_folder", str(uni_root / f"{ckpt.name}_universal")]
        conv += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
        c0 = time.perf_counter()
        run(conv, work / f"{name}-convert.log")
        result["conversion_s"] = time.perf_counter() - c0
        result["universal_bytes"] = tree_bytes(uni_root / f"{ckpt.name}_universal")
        load_dir, tag = uni_root, f"{ckpt.name}_universal"
        c = json.loads(cfg.read_text())
        c["checkpoint"] = {"load_universal": True}
        use_cfg = work / f"{name}-config.json"
        use_cfg.write_text(json.dumps(c))
    run(
        launch
        + ["--config", str(use_cfg), "--load-dir", str(load_dir), "--tag", tag]
        + ["--out", str(out_json)],
        work / f"{name}.log",
    )
    result["launch_to_first_step_s"] = json.loads(out_json.read_text())["first_step_end"] - t0
    from wonderland_ds.core.distributed import shm_buffers

    for path in shm_buffers(port):  # plain DeepSpeed leaves its /dev/shm buffers behind
        Path(path).unlink(missing_ok=True)
    if nproc != 2:
        shutil.rmtree(load_dir)
    shutil.rmtree(fresh.parent)
    return result


def bench_args(name: str) -> tuple[argparse.Namespace, Path]:
    """The resume benchmarks' flags (the model's size exported for bench/big_task.py) and a
    fresh work folder."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()
    os.environ["WL_BENCH_DIM"], os.environ["WL_BENCH_LAYERS"] = str(args.dim), str(args.layers)
    return args, Path(tempfile.mkdtemp(prefix=f"wl-bench-{name}-"))


def main() -> None:
    args, work = bench_args("resume")
    try:
        cfg = config(work, args.dim, args.layers)
        src = work / "stage15"
        run(
            [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(cfg)]
            + ["--run-dir", str(src)],
            work / "stage15.log",
        )
        ckpt = (src / "stage15" / "checkpoints" / "latest").read_text().strip()
        ckpt_dir = src / "stage15" / "checkpoints" / ckpt
        result: dict = {
            "dim": args.dim,
            "layers": args.layers,
            "checkpoint_bytes": tree_bytes(ckpt_dir),
            "disk": disk_speeds(work),
        }
        sides: dict[str, list[dict]] = {
            k: []
            for k in (
                "wonderland_same",
                "deepspeed_same",
                "wonderland_changed",
                "deepspeed_changed",
            )
        }
        for _ in range(args.reps):
            sides["wonderland_same"].append(
                wonderland(cfg, src, work, "wl-same", "hostfiles/localhost")
            )
            sides["deepspeed_same"].append(deepspeed(cfg, ckpt_dir, work, "ds-same", 2))
            sides["wonderland_changed"].append(
                wonderland(cfg, src, work, "wl-changed", "hostfiles/localhost3")
            )
            sides["deepspeed_changed"].append(deepspeed(cfg, ckpt_dir, work, "ds-changed", 3))
        result["runs"] = sides
        summary: dict = {}
        for name, runs in sides.items():
            t = [r["launch_to_first_step_s"] for r in runs]
            summary[name] = {"min_s": min(t), "median_s": statistics.median(t)}
            conv = [r["conversion_s"] for r in runs if "conversion_s" in r]
            if conv:
                moved = result["checkpoint_bytes"] + runs[0]["universal_bytes"]
                disk = result["disk"]
                need = result["checkpoint_bytes"] / disk["read_Bps"]
                need += runs[0]["universal_bytes"] / disk["write_Bps"]
                summary[name]["conversion_median_s"] = statistics.median(conv)
                summary[name]["conversion_Bps"] = moved / statistics.median(conv)
                summary[name]["conversion_vs_disk"] = need / statistics.median(conv)
        for kind in ("same", "changed"):
            w, d = summary[f"wonderland_{kind}"], summary[f"deepspeed_{kind}"]
            pairs = zip(sides[f"wonderland_{kind}"], sides[f"deepspeed_{kind}"])
            summary[f"ratio_{kind}"] = {
                "min": w["min_s"] / d["min_s"],
                "median": w["median_s"] / d["median_s"],
                # each repetition's wonderland run over the DeepSpeed run right after it
                "paired_median": statistics.median(
                    a["launch_to_first_step_s"] / b["launch_to_first_step_s"] for a, b in pairs
                ),
            }
        result["summary"] = summary
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(summary, indent=2))
    finally:
        if args.keep:
            print("work folder kept:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
