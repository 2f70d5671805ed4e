"""Models bigger than a rank, on the causal-LM task, side by side in one run:

    python bench/bench_zero3.py --out bench/results/zero3.json

* rank memory vs world size: ``wonderland train --stage 15`` under ZeRO-3 (fp32) on a ~150M
  Llama loaded from sharded safetensors (``init: weights``), on 4 and 8 ranks, and the same
  runs on a ~1M Llama (the process baseline: torch, DeepSpeed, gloo, the loop). A rank's peak
  RSS above the baseline is what the model costs it; partitioned, it should fall as 1/N.
* gradient checkpointing: the same stage on a small Llama with a long sequence, with and
  without ``gradient_checkpointing``, each against the same run at a short sequence: the
  difference is the activation peak.
* step time: ``wonderland train`` against the plain DeepSpeed + ``transformers`` loop of
  ``bench/plain_causal_lm.py`` (``zero.Init`` through ``HfDeepSpeedConfig``, the same
  non-reentrant checkpointing), ZeRO-3, 2 ranks, the order rotating, plus the plain loop again
  (the noise floor).
* export: stage 18's streamed writer on each stage-15 checkpoint above, in a fresh process: its
  peak RSS above the process after imports, against the model's fp32 size.

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

import numpy as np

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
BIN = Path(PY).parent
sys.path.insert(0, str(REPO / "bench"))

from bench_causal_lm import plain_side  # noqa: E402

LLAMA = {
    "big": dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=14,
                num_attention_heads=12, vocab_size=32000),  # ~150M parameters
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, vocab_size=32000),  # the baseline: ~4M, the embeddings
    "long": dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6,
                 num_attention_heads=8, vocab_size=4096),
}  # fmt: skip
QUICK = {
    "big": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                num_attention_heads=4, vocab_size=4096),
    "tiny": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                 num_attention_heads=4, vocab_size=4096),
    "long": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                 num_attention_heads=4, vocab_size=4096),
}  # fmt: skip
#: The memory part's world sizes (``--quick``: 2 and 3).
WORLDS = [4, 8]


def env(live: bool = False) -> dict[str, str]:
    """``live``: glibc returns every freed block over 128 KiB at once, so a process's peak
    RSS is the memory it really held at once; by default glibc's mmap threshold grows with
    the first large frees, and freed activations then stay in its heap (for step time, the
    allocator as users run it)."""
    extra = {"MALLOC_MMAP_THRESHOLD_": "131072"} if live else {}
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), **extra)


def llama(folder: Path, name: str, positions: int) -> int:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=positions, **LLAMA[name]))
    model.save_pretrained(folder, max_shard_size="100MB")  # sharded, with an index
    return sum(p.numel() for p in model.parameters())


def config(work: Path, name: str, model: Path, seq_len: int, micro: int, **levers) -> Path:
    vocab = LLAMA["long" if name.startswith(("long", "step")) else "big"]["vocab_size"]
    tokens = work / f"tokens{vocab}.bin"
    if not tokens.exists():
        np.random.default_rng(0).integers(0, vocab, 2_000_000, dtype=np.uint16).tofile(tokens)
    raw = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    # ZeRO-3's buffers sized to the model, as transformers' "auto" values size them:
    # DeepSpeed's defaults (5e8-element buckets, 1e9 live parameters) keep a 150M model
    # gathered whole on every rank.
    hidden = LLAMA["long" if name.startswith(("long", "step")) else "big"]["hidden_size"]
    raw["zero_optimization"] = {
        "stage": 3,
        "reduce_bucket_size": hidden * hidden,
        "stage3_prefetch_bucket_size": int(0.9 * hidden * hidden),
        "stage3_param_persistence_threshold": 10 * hidden,
        "stage3_max_live_parameters": 30_000_000,
        "stage3_max_reuse_distance": 30_000_000,
    }
    raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"] = micro, 1
    raw["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(model), "init": "weights", **levers},
        "data": {"train": [str(tokens)], "heldout": {"held": [str(tokens)]},
                 "dtype": "uint16", "seq_len": seq_len},
        "save_interval": 100_000, "log_interval": 100_000, "keep_last": 1,
    }  # fmt: skip
    path = work / f"{name}.json"
    path.write_text(json.dumps(raw, indent=2))
    return path


def train(config: Path, run: Path, steps: int, nproc: int, live: bool = False) -> dict:
    cmd = [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(config)]
    cmd += ["--run-dir", str(run), "--steps", str(steps), "--nproc", str(nproc)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env(live), cwd=REPO)
    if done.returncode != 0:
        raise SystemExit(f"{config.name} failed:\n{done.stdout[-3000:]}\n{done.stderr[-2000:]}")
    with open(run / "stage15" / "metrics.csv", newline="") as fh:
        walls = [float(r["wall"]) for r in csv.DictReader(fh)]
    stage = json.loads((run / "run.json").read_text())["stages"]["15"]
    return {"peak_rss_mb": stage["peak_rss_mb"], "walls": walls}


def step_s(walls: list[float], warm: int) -> float:
    return (walls[-1] - walls[warm - 1]) / (len(walls) - warm)


EXPORT = """
import json, sys
from pathlib import Path
import torch
from transformers import AutoConfig, AutoModelForCausalLM
from wonderland_ds.core.process import status_mb
from wonderland_ds.model import export
hf, tag, out = sys.argv[1:4]
cfg = AutoConfig.from_pretrained(hf)
before = status_mb("VmRSS")
export.export_weights(lambda: AutoModelForCausalLM.from_config(cfg), Path(tag), Path(out),
                      torch.float32, 100 << 20)
peak = status_mb("VmHWM")
files = sum(p.stat().st_size for p in Path(out).glob("*.safetensors"))
print(json.dumps({"rss_before_mb": before, "peak_mb": peak, "export_bytes": files}))
"""


def export_peak(hf: Path, run: Path, out: Path) -> dict:
    (state,) = run.glob("stage15/**/zero_pp_rank_0_mp_rank_00_model_states.pt")
    done = subprocess.run([PY, "-c", EXPORT, str(hf), str(state.parent), str(out)],
                          capture_output=True, text=True, env=env(True), cwd=REPO)  # fmt: skip
    if done.returncode != 0:
        raise SystemExit(f"export failed:\n{done.stderr[-3000:]}")
    got = json.loads(done.stdout.strip().splitlines()[-1])
    got["above_mb"] = got["peak_mb"] - got["rss_before_mb"]
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--reps", type=int, default=3, help="step-time repetitions")
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--warm", type=int, default=4, help="steps left out of the timing")
    ap.add_argument("--long-seq", type=int, default=2048)
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    ap.add_argument("--quick", action="store_true", help="tiny sizes: a smoke test")
    ap.add_argument("--parts", default="memory,checkpointing,step,export",
                    help="what to measure; results merge into --out's earlier ones")  # fmt: skip
    args = ap.parse_args()
    if args.quick:
        LLAMA.update(QUICK)
        WORLDS[:] = [2, 3]
        args.reps, args.steps, args.warm, args.long_seq = 1, 3, 1, 128
    parts = set(args.parts.split(","))
    if "export" in parts and "memory" not in parts:
        ap.error("export reads the memory part's checkpoints: add memory to --parts")
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_zero3_"))
    work.mkdir(parents=True, exist_ok=True)
    params = {n: llama(work / n, n, args.long_seq) for n in LLAMA}
    out = Path(args.out)
    result: dict = json.loads(out.read_text()) if out.exists() else {}
    result["parameters"], result["quick"] = params, args.quick
    if "memory" in parts:
        runs = memory(result, work, params)
    if "checkpointing" in parts:
        checkpointing(result, work, args.long_seq)
    if "step" in parts:
        step(result, work, args)
    if "export" in parts:
        result["export"] = {
            name: export_peak(work / name, runs[name, WORLDS[0]], work / f"export_{name}")
            for name in ("tiny", "big")
        }
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps({k: v for k, v in result.items() if k != "step"}, indent=2))
    print(json.dumps({k: v for k, v in result.get("step", {}).items() if k != "sides_s"}, indent=2))


def memory(result: dict, work: Path, params: dict) -> dict:
    """Rank memory vs world size: 3 steps each, micro 1 x 64 tokens."""
    result["memory_vs_world"] = {}
    runs = {}
    for ranks in WORLDS:
        for name in ("tiny", "big"):
            cfg = config(work, f"{name}{ranks}", work / name, 64, 1)
            runs[name, ranks] = work / f"run_{name}{ranks}"
            got = train(cfg, runs[name, ranks], 3, ranks, live=True)
            result["memory_vs_world"][f"{name}@{ranks}"] = got["peak_rss_mb"]
            print(f"{name} on {ranks} ranks: peak RSS {got['peak_rss_mb']}", flush=True)
    above = {}
    for ranks in WORLDS:
        base = max(result["memory_vs_world"][f"tiny@{ranks}"])
        above[ranks] = max(result["memory_vs_world"][f"big@{ranks}"]) - base
    result["model_mb_per_rank_above_baseline"] = above
    result["fall_4_to_8"] = above[WORLDS[1]] / above[WORLDS[0]]  # quick: 2 to 3
    result["model_states_mb_per_rank_expected"] = {
        r: 16 * (params["big"] - params["tiny"]) / r / 2**20 for r in WORLDS
    }
    return runs


def checkpointing(result: dict, work: Path, long_seq: int) -> None:
    """Gradient checkpointing: micro 2 x long_seq against micro 2 x 64, 2 ranks."""
    result["checkpointing"] = {}
    for ckpt in (False, True):
        peaks = {}
        for seq in (64, long_seq):
            cfg = config(work, f"long_{seq}_{ckpt}", work / "long", seq, 2,
                         gradient_checkpointing=ckpt)  # fmt: skip
            run = work / f"run_long_{seq}_{ckpt}"
            peaks[seq] = max(train(cfg, run, 3, 2, live=True)["peak_rss_mb"])
        result["checkpointing"][f"activation_peak_mb_ckpt_{ckpt}"] = peaks[long_seq] - peaks[64]
        print(f"checkpointing {ckpt}: {peaks}", flush=True)
    ck = result["checkpointing"]
    ck["cut"] = ck["activation_peak_mb_ckpt_False"] / ck["activation_peak_mb_ckpt_True"]


def step(result: dict, work: Path, args: argparse.Namespace) -> None:
    """Step time, ZeRO-3 with checkpointing, 2 ranks, micro 4 x 256 on the small Llama."""
    seq = min(256, args.long_seq)  # the long model has long_seq positions
    side_cfg = config(work, "step", work / "long", seq, 4, gradient_checkpointing=True)
    sides: dict[str, list[float]] = {"wonderland": [], "plain": [], "plain_again": []}
    order = list(sides)
    for rep in range(args.reps):
        k = rep % len(order)
        for side in order[k:] + order[:k]:
            if side == "wonderland":
                walls = train(side_cfg, work / f"step_{rep}", args.steps, 2)["walls"]
                got = step_s(walls, args.warm)
            else:
                got = plain_step(side_cfg, work / f"{side}{rep}.json", args.steps, args.warm)
            sides[side].append(got)
            print(f"rep {rep} {side}: {got:.4f} s", flush=True)
    result["step"] = {
        "sides_s": sides,
        "wonderland_median_s": statistics.median(sides["wonderland"]),
        "plain_median_s": statistics.median(sides["plain"]),
        "ratio_paired": statistics.median(
            w / p for w, p in zip(sides["wonderland"], sides["plain"])
        ),
        "noise_floor_plain_again": statistics.median(
            a / p for a, p in zip(sides["plain_again"], sides["plain"])
        ),
    }


def plain_step(config: Path, out: Path, steps: int, warm: int) -> float:
    """The plain loop with the same checkpointing: ``plain_side`` with ``--grad-ckpt``."""
    return plain_side(config, out, steps, warm, extra=("--grad-ckpt",))["step_s"]


if __name__ == "__main__":
    main()
