"""ZeRO-3 as users bring it: bucket keys ``"auto"``, no allocator variables set, and glibc's
allocator against a fixed mmap threshold, side by side in one run:

    python bench/bench_zero3_defaults.py --out bench/results/zero3_defaults.json

* rank memory vs world size: ``wonderland train --stage 15`` under ZeRO-3 (fp32) on the ~150M
  Llama of ``bench_zero3.py``, its buckets ``"auto"`` (filled from its hidden size), loaded
  from one ``model.safetensors`` and from 100 MB shards, on 4 and 8 ranks, each against the
  same run on the ~4M baseline Llama, glibc's allocator as it comes; and the shards again
  with ``wonderland.cpu_mmap_threshold`` 131072 (``--threshold``), or with another malloc
  preloaded (``--preload /usr/lib/x86_64-linux-gnu/libjemalloc.so.2``).
* step time with and without that threshold: the 7M Llama, 2 ranks, micro 4 x 256, gradient
  checkpointing, alternating, paired ratios.

``--quick`` runs every part at a tiny size (a smoke test of the script, not a measurement).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_zero3 import BIN, LLAMA, config, step_s  # noqa: E402

QUICK = {
    "big": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=32000),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, vocab_size=32000),
    "long": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, vocab_size=4096),
}  # fmt: skip


def save_llama(folder: Path, name: str, positions: int, single: bool) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=positions, **LLAMA[name]))
    # transformers 5 writes up to 50 GB into one model.safetensors by default.
    model.save_pretrained(folder, max_shard_size="50GB" if single else "100MB")
    return sum(p.numel() for p in model.parameters())


def auto_config(
    work: Path,
    name: str,
    model: Path,
    seq_len: int,
    micro: int,
    threshold: int | None = None,
    **levers: object,
) -> Path:
    """``bench_zero3.config`` with the three bucket keys "auto", as users bring them, and
    ``threshold`` as ``wonderland.cpu_mmap_threshold``."""
    path = config(work, name, model, seq_len, micro, **levers)
    raw = json.loads(path.read_text())
    raw["wonderland"]["cpu_mmap_threshold"] = threshold
    for key in (
        "reduce_bucket_size",
        "stage3_prefetch_bucket_size",
        "stage3_param_persistence_threshold",
    ):
        raw["zero_optimization"][key] = "auto"
    path.write_text(json.dumps(raw, indent=2))
    return path


PRELOAD: str | None = None
"""``--preload``: the fixed side runs with this allocator preloaded instead of the threshold."""


def train(cfg: Path, run: Path, steps: int, nproc: int, fixed: bool = False) -> dict:
    """One stage 15, the allocator variables out of the environment."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    if fixed and PRELOAD:
        env["LD_PRELOAD"] = PRELOAD
    cmd = [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(cfg)]
    cmd += ["--run-dir", str(run), "--steps", str(steps), "--nproc", str(nproc)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{cfg.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    stage = json.loads((run / "run.json").read_text())["stages"]["15"]
    resolved = json.loads((run / "stage15" / "ds_config.json").read_text())
    with open(run / "stage15" / "metrics.csv", newline="") as fh:
        walls = [float(r["wall"]) for r in csv.DictReader(fh)]
    return {
        "peak_rss_mb": stage["peak_rss_mb"],
        "allocator": stage.get("allocator"),
        "walls": walls,
        "buckets": {
            k: resolved["zero_optimization"][k]
            for k in ("reduce_bucket_size", "stage3_prefetch_bucket_size")
        },
    }


def memory(result: dict, work: Path, ranks_list: tuple[int, ...], threshold: int) -> None:
    runs: dict[str, dict] = {}
    sides = [("tiny", "shards", False), ("big", "single", False), ("big", "shards", False)]
    sides += [("tiny", "shards", True), ("big", "shards", True)]
    for ranks in ranks_list:
        for name, files, fixed in sides:
            key = f"{name}_{files}{'_fixed' if fixed else ''}@{ranks}"
            thr = threshold if fixed and not PRELOAD else None
            cfg = auto_config(work, key, work / f"{name}_{files}", 64, 1, thr)
            got = train(cfg, work / f"run_{key}", 3, ranks, fixed)
            runs[key] = got
            print(f"{key}: peak {max(got['peak_rss_mb'])} MB {got['allocator']}", flush=True)
    out: dict = {"peak_mb": {k: max(v["peak_rss_mb"]) for k, v in runs.items()}}
    out["allocator"] = {k: v["allocator"] for k, v in runs.items()}
    out["buckets"] = runs[f"big_shards@{ranks_list[0]}"]["buckets"]
    for files, fixed in (("single", ""), ("shards", ""), ("shards", "_fixed")):
        above = {
            r: out["peak_mb"][f"big_{files}{fixed}@{r}"] - out["peak_mb"][f"tiny_shards{fixed}@{r}"]
            for r in ranks_list
        }
        lo, hi = ranks_list[0], ranks_list[-1]
        out[f"above_baseline_{files}{fixed}"] = above
        out[f"fall_{files}{fixed}"] = round(above[hi] / above[lo], 3)
    result["memory"] = out


def step(result: dict, work: Path, reps: int, steps: int, warm: int, threshold: int) -> None:
    cfgs = {
        side: auto_config(work, f"step_{side}", work / "long_shards", 256, 4,
                          threshold if side == "fixed" and not PRELOAD else None,
                          gradient_checkpointing=True)
        for side in ("fixed", "glibc")
    }  # fmt: skip
    sides: dict[str, list[float]] = {"fixed": [], "glibc": []}
    for rep in range(reps):
        for side in ("fixed", "glibc") if rep % 2 == 0 else ("glibc", "fixed"):
            got = train(cfgs[side], work / f"step_{side}_{rep}", steps, 2, side == "fixed")
            sides[side].append(step_s(got["walls"], warm))
            print(f"rep {rep} {side}: {sides[side][-1]:.4f} s", flush=True)
    result["step"] = {
        "sides_s": sides,
        "fixed_median_s": statistics.median(sides["fixed"]),
        "glibc_median_s": statistics.median(sides["glibc"]),
        "ratio_paired": round(
            statistics.median(f / g for f, g in zip(sides["fixed"], sides["glibc"])), 4
        ),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=4, help="step-time repetitions per side")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm", type=int, default=4, help="steps left out of the timing")
    ap.add_argument("--parts", default="memory,step")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--threshold", type=int, default=131072, help="the fixed side's threshold")
    ap.add_argument("--preload", help="the fixed side: this malloc (LD_PRELOAD) instead")
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    args = ap.parse_args()
    global PRELOAD
    PRELOAD = args.preload
    if args.quick:
        LLAMA.update(QUICK)
        args.reps, args.steps, args.warm = 2, 3, 1
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_zero3_defaults_"))
    work.mkdir(parents=True, exist_ok=True)
    result: dict = {"quick": args.quick, "parameters": {}}
    for name in LLAMA:
        for files in ("single", "shards"):
            folder = work / f"{name}_{files}"
            result["parameters"][name] = save_llama(folder, name, 256, files == "single")
    parts = set(args.parts.split(","))
    if "memory" in parts:
        memory(result, work, (2, 4) if args.quick else (4, 8), args.threshold)
    if "step" in parts:
        step(result, work, args.reps, args.steps, args.warm, args.threshold)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "step"}, indent=2))
    print(json.dumps(result.get("step", {}), indent=2))


if __name__ == "__main__":
    main()
