"""The GPU figures in one run, for the day a device is lent (``bench/gpu.sh`` calls it):

    python bench/bench_gpu.py --out bench/results/gpu --size 1b [--budget-s 420]

* tokens/s and MFU of stage 15 (``wonderland train``) on a ~1B-parameter Llama in bf16, under
  ZeRO-2 and ZeRO-3, against the plain DeepSpeed + ``transformers`` loop of
  ``bench/plain_causal_lm.py`` on the same model directory, config and token file; sides
  alternate (W P P W), ratios are paired. A step is the wall time between consecutive steps'
  ends after a warm-up.
* save and resume: the stage's last save (start to ``latest``, ``run.json``'s ``last_save_s``)
  against the disk's sequential write speed for the same bytes, and ``wonderland train
  --stage 16 --resume auto`` from launch to its first step against the disk's read speed.

``--size tiny`` runs the same path in seconds on a CPU (the script's proof before a GPU run).
``--budget-s``: no launch starts once the next one would likely end past it; what did not run
is named in the JSON. Writes ``OUT/gpu.json`` and ``OUT/gpu_table.md``.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_resume import BIN, disk_speeds, first_step_wall, run, tree_bytes  # noqa: E402

SIZES = {
    # ~1B: 16 layers of 2048 (Llama-style MLP 5504), vocabulary 32000, 4 x 1024 tokens a micro
    # batch, 2 micro batches a step.
    "1b": dict(hidden=2048, layers=16, heads=16, inter=5504, vocab=32000, seq=1024, micro=4,
               gas=2, steps=24, warm=6, disk_mb=2048),
    "tiny": dict(hidden=64, layers=2, heads=4, inter=172, vocab=512, seq=64, micro=2, gas=2,
                 steps=8, warm=3, disk_mb=64),
}  # fmt: skip
# Dense bf16 peak FLOP/s by device name (vendor datasheets); MFU is left out for others.
PEAK_BF16 = {"H200": 989.4e12, "H100 SXM": 989.4e12, "H100 80GB HBM3": 989.4e12,
             "H100 PCIe": 756.0e12, "H100": 989.4e12, "A100": 312.0e12, "L40S": 362.0e12}  # fmt: skip


def device() -> dict:
    import torch

    if not torch.cuda.is_available():
        return {"name": "cpu", "peak_bf16_flops": None}
    name = torch.cuda.get_device_name(0)
    peak = next((v for k, v in PEAK_BF16.items() if k in name), None)
    return {"name": name, "peak_bf16_flops": peak, "count": torch.cuda.device_count()}


def prepare(work: Path, size: dict) -> dict:
    """The model directory, a token file and a held-out one, and a config per ZeRO stage."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    cfg = LlamaConfig(
        vocab_size=size["vocab"], hidden_size=size["hidden"], num_hidden_layers=size["layers"],
        num_attention_heads=size["heads"], num_key_value_heads=size["heads"],
        intermediate_size=size["inter"], max_position_embeddings=size["seq"],
        bos_token_id=0, eos_token_id=0, tie_word_embeddings=False,
    )  # fmt: skip
    cfg.save_pretrained(work / "model")
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg)
    params = sum(p.numel() for p in model.parameters())
    embedding = model.get_input_embeddings().weight.numel()
    rng = np.random.default_rng(0)
    tokens = max(20 * size["steps"] * size["micro"] * size["gas"] * size["seq"], 1_000_000)
    rng.integers(0, size["vocab"], tokens, dtype=np.uint16).tofile(work / "train.bin")
    rng.integers(0, size["vocab"], 50 * size["seq"], dtype=np.uint16).tofile(work / "held.bin")
    base = json.loads((REPO / "ds_configs" / "cpu_zero2_bf16_pylm.json").read_text())
    base["train_micro_batch_size_per_gpu"] = size["micro"]
    base["gradient_accumulation_steps"] = size["gas"]
    configs = {}
    for zero in (2, 3):
        body = json.loads(json.dumps(base))
        body["zero_optimization"] = {"stage": zero}
        body["wonderland"] = {
            "task": "causal-lm",
            "model": {"hf": str(work / "model")},
            "data": {
                "train": [str(work / "train.bin")],
                "heldout": {"held": [str(work / "held.bin")]},
                "dtype": "uint16",
                "seq_len": size["seq"],
            },
            "stage_train_steps": {"15": size["steps"], "16": 2},
            "min_warmup_steps": 0,
            "save_interval": 100_000,
            "log_interval": 100_000,
            "keep_last": 1,
        }
        configs[zero] = work / f"zero{zero}.json"
        configs[zero].write_text(json.dumps(body, indent=2))
    return {"configs": configs, "params": params, "embedding_params": embedding}


def step_s(walls: list[float], warm: int) -> float:
    return (walls[-1] - walls[warm - 1]) / (len(walls) - warm)


def metrics_walls(run: Path, stage: int) -> list[float]:
    with open(run / f"stage{stage}" / "metrics.csv", newline="") as fh:
        return [float(r["wall"]) for r in csv.DictReader(fh)]


def wonderland_side(config: Path, folder: Path, size: dict) -> dict:
    cmd = [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(config)]
    run([*cmd, "--run-dir", str(folder), "--nproc", "1"], folder.with_suffix(".log"))
    stage = json.loads((folder / "run.json").read_text())["stages"]["15"]
    return {
        "step_s": step_s(metrics_walls(folder, 15), size["warm"]),
        "last_save_s": stage["last_save_s"],
        "checkpoint_bytes": tree_bytes(Path(stage["checkpoint"])),
    }


def plain_side(config: Path, out: Path, size: dict) -> dict:
    from wonderland_ds.launch.command import free_port

    port = str(free_port())  # outside the ephemeral range, free now, as the engine's own launches
    cmd = [str(BIN / "deepspeed"), "--num_gpus", "1", "--no_ssh_check", "--master_addr"]
    cmd += ["127.0.0.1", "--master_port", port, str(REPO / "bench" / "plain_causal_lm.py")]
    cmd += ["--config", str(config), "--steps", str(size["steps"]), "--out", str(out)]
    run(cmd, out.with_suffix(".log"))
    return {"step_s": step_s(json.loads(out.read_text())["walls"], size["warm"])}


def flops_per_token(prep: dict, size: dict) -> float:
    """PaLM's count: 6 x the non-embedding parameters, plus the attention's 12 x L x H x T."""
    dense = prep["params"] - prep["embedding_params"]
    return 6 * dense + 12 * size["layers"] * size["hidden"] * size["seq"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu.json and gpu_table.md")
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--tests-rc", type=int, help="`pytest -m gpu`'s exit code (gpu.sh)")
    ap.add_argument("--tests-summary", help="`pytest -m gpu`'s last line (gpu.sh)")
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    args = ap.parse_args()
    t_start = time.time()
    size = SIZES[args.size]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_gpu_"))
    work.mkdir(parents=True, exist_ok=True)
    prep = prepare(work, size)
    dev = device()
    tokens_per_step = size["micro"] * size["gas"] * size["seq"]
    result: dict = {
        "date": time.strftime("%Y-%m-%d"),
        "device": dev,
        "size": args.size,
        "setup": {**size, "params": prep["params"], "precision": "bf16", "ranks": 1},
        "tests": {"rc": args.tests_rc, "summary": args.tests_summary},
        "zero": {},
        "not_run": [],
    }
    longest = 0.0
    keep: Path | None = None  # a ZeRO-2 run folder, for the resume
    for zero in (2, 3):
        sides: dict[str, list[dict]] = {"wonderland": [], "plain": []}
        for i, side in enumerate(("wonderland", "plain", "plain", "wonderland")):
            if time.time() - t_start + longest > args.budget_s:
                result["not_run"].append(f"zero{zero} {side} #{i}: the time budget")
                continue
            t0 = time.time()
            if side == "plain":
                got = plain_side(prep["configs"][zero], work / f"plain{zero}_{i}.json", size)
            else:
                folder = work / f"wonderland{zero}_{i}"
                got = wonderland_side(prep["configs"][zero], folder, size)
                if zero == 2 and keep is None:
                    keep = folder
                else:
                    shutil.rmtree(folder)  # a 1B checkpoint is 14 GB: keep one
            longest = max(longest, time.time() - t0)
            sides[side].append(got)
            print(f"zero{zero} {side}: {got}", flush=True)
        pairs = list(zip(sides["wonderland"], sides["plain"]))  # (W P) (P W): neighbours
        row: dict = {"sides": sides}
        if pairs:
            wl = statistics.median(w["step_s"] for w in sides["wonderland"])
            plain = statistics.median(p["step_s"] for p in sides["plain"])
            peak = dev["peak_bf16_flops"]
            per_token = flops_per_token(prep, size)
            row.update(
                wonderland_tokens_s=tokens_per_step / wl,
                plain_tokens_s=tokens_per_step / plain,
                ratio_paired=statistics.median(w["step_s"] / p["step_s"] for w, p in pairs),
                mfu_wonderland=None if peak is None else per_token * tokens_per_step / wl / peak,
                mfu_plain=None if peak is None else per_token * tokens_per_step / plain / peak,
            )
        result["zero"][str(zero)] = row
    if keep is not None and time.time() - t_start + longest <= args.budget_s:
        first = result["zero"]["2"]["sides"]["wonderland"][0]
        disk = disk_speeds(work, size["disk_mb"])
        write, read = disk["write_Bps"], disk["read_Bps"]
        config = prep["configs"][2]
        cmd = [str(BIN / "wonderland"), "train", "--stage", "16", "--config", str(config)]
        cmd += ["--run-dir", str(keep), "--resume", "auto", "--nproc", "1"]
        t0 = run(cmd, work / "resume.log")
        resumed = first_step_wall(keep, 16) - t0
        result["save_resume"] = {
            "checkpoint_bytes": first["checkpoint_bytes"],
            "save_s": first["last_save_s"],
            "disk_write_s": first["checkpoint_bytes"] / write,
            "launch_to_first_step_s": resumed,
            "disk_read_s": first["checkpoint_bytes"] / read,
            "disk_write_Bps": write,
            "disk_read_Bps": read,
            "read_cold": disk["read_cold"],
        }
    else:
        result["not_run"].append("save and resume: the time budget or no ZeRO-2 run")
    result["seconds"] = time.time() - t_start
    (out / "gpu.json").write_text(json.dumps(result, indent=2))
    (out / "gpu_table.md").write_text(table(result))
    print((out / "gpu_table.md").read_text())


def table(r: dict) -> str:
    def f(x: float | None, fmt: str) -> str:
        return "n/a" if x is None else format(x, fmt)

    def size(n: float) -> str:
        return f"{n / 1e9:.2f} G" if n >= 1e9 else f"{n / 1e6:.1f} M"

    s = r["setup"]
    lines = [
        f"Device: {r['device']['name']}; {r['date']}; Llama, {size(s['params'])} parameters,"
        f" bf16, {s['micro']} x {s['gas']} x {s['seq']} tokens a step, 1 rank;"
        f" `pytest -m gpu`: {r['tests']['summary'] or 'not run'}",
        "",
        "| ZeRO | wonderland tokens/s | plain tokens/s | step ratio (paired) | MFU wonderland"
        " | MFU plain |",
        "|---|---|---|---|---|---|",
    ]
    for zero, row in r["zero"].items():
        if "ratio_paired" not in row:
            lines.append(f"| {zero} | not run | | | | |")
            continue
        lines.append(
            f"| {zero} | {row['wonderland_tokens_s']:,.0f} | {row['plain_tokens_s']:,.0f}"
            f" | {row['ratio_paired']:.3f} | {f(row['mfu_wonderland'], '.1%')}"
            f" | {f(row['mfu_plain'], '.1%')} |"
        )
    sr = r.get("save_resume")
    if sr:
        lines += [
            "",
            f"Save: {size(sr['checkpoint_bytes'])}B in {f(sr['save_s'], '.2f')} s (the disk"
            f" writes as much in {sr['disk_write_s']:.2f} s); resume: launch to the first step"
            f" in {sr['launch_to_first_step_s']:.1f} s (the disk reads the checkpoint in"
            f" {sr['disk_read_s']:.2f} s)",
        ]
    if r["not_run"]:
        lines += ["", "Not run: " + "; ".join(r["not_run"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
