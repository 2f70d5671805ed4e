"""The causal-LM task against its bars, side by side in one run:

    python bench/bench_causal_lm.py --out bench/results/causal_lm.json [--reps 3 --steps 40]

* step time: ``wonderland train --stage 15`` on a ``transformers`` GPT-2 and a 40 MB uint16
  token file, against the plain DeepSpeed loop of ``bench/plain_causal_lm.py`` over the same
  model directory, config and file, 2 ranks each, and that plain loop once more (the noise
  floor), the sides' order rotating (A B C, B C A, C A B, ...); a step is
  the wall time between consecutive steps' ends after a warm-up, so it includes everything
  each loop does between steps.
* rank memory: the same stage on a 4 GB token file (sparse), a third side in the rotation,
  against the 40 MB one: the median over repetitions of the largest rank's peak RSS
  (``run.json``), and the bytes of data files in the run folders.
* the front's data check: opening, checking and fingerprinting the task's data in a fresh
  process (what ``wonderland train`` does before it launches), on both corpora.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent


def prepare(work: Path, vocab: int, seq_len: int) -> dict[str, Path]:
    from transformers import GPT2Config

    GPT2Config(
        vocab_size=vocab,
        n_positions=seq_len,
        n_embd=256,
        n_layer=4,
        n_head=4,
        bos_token_id=0,
        eos_token_id=0,
    ).save_pretrained(work / "model")
    rng = np.random.default_rng(0)
    small = work / "small.bin"
    rng.integers(0, vocab, 20_000_000, dtype=np.uint16).tofile(small)  # 40 MB
    big = work / "big.bin"
    with open(big, "wb") as fh:  # 4 GB, sparse: reads as token 0
        fh.truncate(4 << 30)
    held = work / "held.bin"
    rng.integers(0, vocab, 50_000, dtype=np.uint16).tofile(held)
    base = json.loads((REPO / "ds_configs" / "cpu_zero2_bf16_pylm.json").read_text())
    base["train_micro_batch_size_per_gpu"], base["gradient_accumulation_steps"] = 4, 2
    configs = {}
    for name, corpus in (("small", small), ("big", big)):
        cfg = json.loads(json.dumps(base))
        cfg["wonderland"] = {
            "task": "causal-lm",
            "model": {"hf": str(work / "model")},
            "data": {
                "train": [str(corpus)],
                "heldout": {"held": [str(held)]},
                "dtype": "uint16",
                "seq_len": seq_len,
            },
            "save_interval": 100_000,
            "log_interval": 100_000,
            "keep_last": 1,
        }
        configs[name] = work / f"{name}.json"
        configs[name].write_text(json.dumps(cfg, indent=2))
    return configs


def env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def wonderland_side(config: Path, run: Path, steps: int, warm: int) -> dict:
    cmd = [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(config)]
    cmd += ["--run-dir", str(run), "--steps", str(steps)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"wonderland side failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    import csv

    with open(run / "stage15" / "metrics.csv", newline="") as fh:
        walls = [float(r["wall"]) for r in csv.DictReader(fh)]
    stage = json.loads((run / "run.json").read_text())["stages"]["15"]
    data_bytes = sum(p.stat().st_size for p in run.rglob("*") if p.suffix in (".bin", ".npy"))
    return {
        "step_s": (walls[-1] - walls[warm - 1]) / (len(walls) - warm),
        "peak_rss_mb": stage["peak_rss_mb"],
        "run_dir_data_bytes": data_bytes,
    }


def plain_side(config: Path, out: Path, steps: int, warm: int, extra: tuple[str, ...] = ()) -> dict:
    from wonderland_ds.launch.command import free_port

    port = free_port()  # outside the ephemeral range, free now, as the engine's own launches
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--no_ssh_check", "--master_addr"]
    cmd += ["127.0.0.1", "--master_port", str(port), str(REPO / "bench" / "plain_causal_lm.py")]
    cmd += ["--config", str(config), "--steps", str(steps), "--out", str(out), *extra]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(), cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"plain side failed:\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}")
    walls = json.loads(out.read_text())["walls"]
    return {"step_s": (walls[-1] - walls[warm - 1]) / (len(walls) - warm)}


FRONT = """
import json, sys, time
t0 = time.perf_counter()
from wonderland_ds.config import ds_config
from wonderland_ds.data import lm
from wonderland_ds.core.process import status_mb
raw, _ = ds_config.load_json(sys.argv[1])
_, settings, _ = ds_config.validate(raw, sys.argv[1])
task = lm.load_task(settings.task, settings).materialize()
took = time.perf_counter() - t0
print(json.dumps({"seconds": took, "samples": len(task.train), "fingerprint": task.fingerprint,
                  "max_rss_mb": status_mb("VmHWM")}))
"""


def front_check(config: Path, reps: int = 3) -> dict:
    runs = []
    for _ in range(reps):
        done = subprocess.run([PY, "-c", FRONT, str(config)], capture_output=True, text=True,
                              env=env(), cwd=REPO, check=True)  # fmt: skip
        runs.append(json.loads(done.stdout))
    return {
        "seconds_median": statistics.median(r["seconds"] for r in runs),
        "max_rss_mb": max(r["max_rss_mb"] for r in runs),
        "samples": runs[0]["samples"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warm", type=int, default=6, help="steps left out of the timing")
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_causal_lm_"))
    work.mkdir(parents=True, exist_ok=True)
    configs = prepare(work, args.vocab, args.seq_len)
    result: dict = {
        "front_check": {n: front_check(c) for n, c in configs.items()},
        "sides": {"wonderland": [], "plain": [], "wonderland_4GB": [], "plain_again": []},
    }
    sides = list(result["sides"])
    for rep in range(args.reps):
        k = rep % len(sides)
        for side in sides[k:] + sides[:k]:  # the order rotates
            if side.startswith("plain"):
                out = work / f"{side}{rep}.json"
                got = plain_side(configs["small"], out, args.steps, args.warm)
            else:
                name = "big" if side == "wonderland_4GB" else "small"
                run = work / f"{side}_{rep}"
                got = wonderland_side(configs[name], run, args.steps, args.warm)
            result["sides"][side].append(got)
            print(f"rep {rep} {side}: {got}", flush=True)
    wl = [r["step_s"] for r in result["sides"]["wonderland"]]
    plain = [r["step_s"] for r in result["sides"]["plain"]]
    rss = {
        side: statistics.median(max(r["peak_rss_mb"]) for r in result["sides"][side])
        for side in ("wonderland", "wonderland_4GB")
    }
    result["memory"] = {
        "rank_peak_rss_mb_40MB_median": rss["wonderland"],
        "rank_peak_rss_mb_4GB_median": rss["wonderland_4GB"],
        "difference_mb": rss["wonderland_4GB"] - rss["wonderland"],
        "run_dir_data_bytes_4GB": max(
            r["run_dir_data_bytes"] for r in result["sides"]["wonderland_4GB"]
        ),
    }
    again = [r["step_s"] for r in result["sides"]["plain_again"]]
    result["step"] = {
        "wonderland_median_s": statistics.median(wl),
        "plain_median_s": statistics.median(plain),
        "ratio_of_medians": statistics.median(wl) / statistics.median(plain),
        "ratio_paired": statistics.median(w / p for w, p in zip(wl, plain)),
        # The same plain loop twice: how far apart two identical sides land in this run.
        "noise_floor_plain_again": statistics.median(a / p for a, p in zip(again, plain)),
    }
    result["setup"] = {
        "model": f"GPT-2 (transformers), 4 layers, 256 wide, vocabulary {args.vocab}",
        "seq_len": args.seq_len, "micro": 4, "grad_acc": 2, "ranks": 2, "zero": 2,
        "precision": "bf16", "steps": args.steps, "warm": args.warm, "reps": args.reps,
    }  # fmt: skip
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: result[k] for k in ("front_check", "memory", "step")}, indent=2))


if __name__ == "__main__":
    main()
