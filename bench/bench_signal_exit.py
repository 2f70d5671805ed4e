"""Signal to exit against checkpoint size: ``wonderland train --stage 15`` on a ``transformers``
GPT-2 of growing width, 2 ranks, ZeRO-2, fp32, no periodic save; SIGTERM to the whole process
group (as ``scancel``, a preemption or Slurm's time limit sends it) after a few steps; timed
until the command exits (4: stopped, saved). Slurm's default grace before SIGKILL is 30 s
(KillWait): the last column says how much of it the stop took. The disk's sequential write
speed is measured in the same run.

    python bench/bench_signal_exit.py --out bench/results/signal_exit.json [--widths 256,512,768,1024]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from disk import write_speed  # noqa: E402

from wonderland_ds.run import liveness  # noqa: E402

GRACE_S = 30.0


def prepare(work: Path, width: int, layers: int, vocab: int, seq_len: int) -> Path:
    from transformers import GPT2Config

    model = work / f"gpt2_{width}"
    GPT2Config(
        vocab_size=vocab, n_positions=seq_len, n_embd=width, n_layer=layers,
        n_head=max(4, width // 64), bos_token_id=0, eos_token_id=0,
    ).save_pretrained(model)  # fmt: skip
    tokens = work / "train.bin"
    if not tokens.exists():
        rng = np.random.default_rng(0)
        rng.integers(0, vocab, 2_000_000, dtype=np.uint16).tofile(tokens)
        rng.integers(0, vocab, 20_000, dtype=np.uint16).tofile(work / "held.bin")
    cfg = json.loads((REPO / "tests" / "configs" / "tiny_zero2_fp32.json").read_text())
    cfg["train_micro_batch_size_per_gpu"], cfg["gradient_accumulation_steps"] = 2, 1
    cfg["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(model)},
        "data": {
            "train": [str(tokens)],
            "heldout": {"held": [str(work / "held.bin")]},
            "dtype": "uint16",
            "seq_len": seq_len,
        },
        "save_interval": 10**6,
        "log_interval": 10**6,
        "keep_last": 1,
        "process_group_timeout_s": 600,
    }
    path = work / f"config_{width}.json"
    path.write_text(json.dumps(cfg))
    return path


def one(config: Path, run: Path, after_steps: int) -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "wonderland_ds.cli.main", "train", "--stage", "15"]
    cmd += ["--config", str(config), "--run-dir", str(run), "--steps", "100000"]
    proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    deadline = time.time() + 900
    while time.time() < deadline:
        beats = liveness.heartbeats(run / "stage15")
        if max((b.get("step") or 0 for b in beats), default=0) >= after_steps:
            break
        if proc.poll() is not None:
            raise SystemExit(f"the stage ended early with {proc.returncode}")
        time.sleep(0.2)
    t0 = time.time()
    os.killpg(proc.pid, signal.SIGTERM)
    rc = proc.wait()
    took = time.time() - t0
    stop = json.loads((run / "run.json").read_text())["stages"]["15"].get("stop") or {}
    tag = Path(stop.get("checkpoint") or run)
    size = sum(p.stat().st_size for p in tag.rglob("*") if p.is_file())
    return {
        "exit_code": rc,
        "signal_to_exit_s": round(took, 2),
        "request_to_saved_s": stop.get("seconds"),
        "checkpoint_bytes": size,
        "step": stop.get("step"),
        "share_of_grace": round(took / GRACE_S, 3),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--widths", default="256,512,768,1024")
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--after-steps", type=int, default=3)
    ap.add_argument("--work", help="working folder (default: a temporary one)")
    args = ap.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_signal_exit_"))
    work.mkdir(parents=True, exist_ok=True)
    rows = []
    for width in (int(w) for w in args.widths.split(",")):
        config = prepare(work, width, args.layers, args.vocab, args.seq_len)
        got = one(config, work / f"run_{width}", args.after_steps)
        got["width"] = width
        print(json.dumps(got), flush=True)
        rows.append(got)
    speed = write_speed(work)
    result = {
        "setup": {
            "model": f"GPT-2 (transformers), {args.layers} layers, vocabulary {args.vocab}",
            "ranks": 2,
            "zero": 2,
            "precision": "fp32",
            "seq_len": args.seq_len,
        },  # fmt: skip
        "disk_write_Bps": speed,
        "runs": rows,
        # What fits in Slurm's default grace at this disk's speed, from the largest run:
        # the stop's fixed part (everything but writing) plus bytes at the measured rate.
        "fits_in_grace_bytes_estimate": _fit(rows),
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))


def _fit(rows: list[dict]) -> int | None:
    """A line through (checkpoint bytes, signal-to-exit seconds): the size at 30 s."""
    if len(rows) < 2:
        return None
    x = np.array([r["checkpoint_bytes"] for r in rows], dtype=float)
    y = np.array([r["signal_to_exit_s"] for r in rows], dtype=float)
    slope, intercept = np.polyfit(x, y, 1)
    return int((GRACE_S - intercept) / slope) if slope > 0 else None


if __name__ == "__main__":
    main()
