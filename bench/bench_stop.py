"""Per-rank benchmark: what the stop agreement costs a step of the causal-LM task.

Every step starts one small asynchronous all-reduce of the stop flags and waits for it when
the step is done (``training/stopping.py``). Side by side in the same processes, the order
rotating every repetition: the stage's loop as it trains (``wonderland``), the same loop with
the agreement taken out (``no-agreement``) and the default once more (``wonderland-again``: the
noise floor). A ``transformers`` GPT-2 on a uint16 token file, fp32 (bf16 is emulated on CPUs
without AVX512-BF16), ZeRO-2, 2 ranks:

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --no_ssh_check --master_addr 127.0.0.1 \\
        bench/bench_stop.py --steps 40 --reps 6 --out R.json

Also reported: the time the loop itself spends in the agreement (starting the all-reduce and
waiting for it), per step, measured inside the ``wonderland`` side, and the part of it that
checks the next step's token ids against the vocabulary (the bad-data check).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from wonderland_ds.config.ds_config import DSConfig  # noqa: E402
from wonderland_ds.config.settings import WonderlandSettings  # noqa: E402
from wonderland_ds.core import distributed as dist  # noqa: E402
from wonderland_ds.data import lm  # noqa: E402
from wonderland_ds.training import stopping  # noqa: E402
from wonderland_ds.training.build import build  # noqa: E402
from wonderland_ds.training.callbacks import Callback  # noqa: E402
from wonderland_ds.training.state import Progress, StageRun  # noqa: E402
from wonderland_ds.training.trainer import fit  # noqa: E402


def prepare(work: Path, vocab: int, seq_len: int) -> dict:
    from transformers import GPT2Config

    GPT2Config(
        vocab_size=vocab, n_positions=seq_len, n_embd=256, n_layer=4, n_head=4,
        bos_token_id=0, eos_token_id=0,
    ).save_pretrained(work / "model")  # fmt: skip
    rng = np.random.default_rng(0)
    rng.integers(0, vocab, 4_000_000, dtype=np.uint16).tofile(work / "train.bin")
    rng.integers(0, vocab, 50_000, dtype=np.uint16).tofile(work / "held.bin")
    return {
        "task": "causal-lm",
        "model": {"hf": str(work / "model")},
        "data": {
            "train": [str(work / "train.bin")],
            "heldout": {"held": [str(work / "held.bin")]},
            "dtype": "uint16",
            "seq_len": seq_len,
        },
    }


def ds_config(world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 2,
        "train_batch_size": 8 * world,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }


class Timed:
    """The agreement's two calls, timed where the loop makes them."""

    def __init__(self) -> None:
        self.seconds, self.calls, self.look = 0.0, 0, 0.0
        self.pre, self.agreed = stopping.StopAgreement.pre_step, stopping.StopAgreement.agreed

    def __enter__(self) -> Timed:
        timed = self

        def pre_step(agreement, step):
            look = agreement.lookahead
            if look is not None and not getattr(look, "timed", False):

                def timed_look(at, look=look):
                    t = time.perf_counter()
                    try:
                        return look(at)
                    finally:
                        timed.look += time.perf_counter() - t

                timed_look.timed = True  # type: ignore[attr-defined]
                agreement.lookahead = timed_look
            t0 = time.perf_counter()
            timed.pre(agreement, step)
            timed.seconds += time.perf_counter() - t0

        def agreed(agreement):
            t0 = time.perf_counter()
            try:
                return timed.agreed(agreement)
            finally:
                timed.seconds += time.perf_counter() - t0
                timed.calls += 1

        stopping.StopAgreement.pre_step, stopping.StopAgreement.agreed = pre_step, agreed
        return self

    def __exit__(self, *exc) -> None:
        stopping.StopAgreement.pre_step, stopping.StopAgreement.agreed = self.pre, self.agreed


class Without:
    """The agreement taken out: its per-step hook is the base class's no-op (the trainer
    does not call it) and it never agrees."""

    def __enter__(self) -> Without:
        self.pre, self.agreed = stopping.StopAgreement.pre_step, stopping.StopAgreement.agreed
        stopping.StopAgreement.pre_step = Callback.pre_step  # type: ignore[method-assign]
        stopping.StopAgreement.agreed = lambda agreement: None  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc) -> None:
        stopping.StopAgreement.pre_step, stopping.StopAgreement.agreed = self.pre, self.agreed


def stage_loop(task, config: dict, steps: int, run_dir: Path) -> list[float]:
    settings = WonderlandSettings(train_steps=steps, save_interval=10**9)
    run = StageRun(
        stage=15, run_dir=run_dir, task=task, ds_dict=config,
        cfg=DSConfig.model_validate(config), settings=settings, seed=0, steps=steps,
    )  # fmt: skip
    run.stage_dir.mkdir(parents=True, exist_ok=True)
    engine = build(run, None)
    fit(run, engine, Progress(), lambda *a, **k: None)
    import csv

    with open(run.stage_dir / "metrics.csv") as fh:
        wall = [float(r["wall"]) for r in csv.DictReader(fh)][:-1]  # the last includes the save
    engine.destroy()
    return [b - a for a, b in zip(wall, wall[1:])]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--warm", type=int, default=5)
    ap.add_argument("--seq-len", type=int, default=128)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    dist.init(600)
    folder = Path(tempfile.mkdtemp(prefix="wl-bench-stop-")) if dist.is_main() else None
    folder = dist.broadcast(folder)
    assert folder is not None
    section = prepare(folder, args.vocab, args.seq_len) if dist.is_main() else None
    section = dist.broadcast(section)
    task = lm.load_task("causal-lm", WonderlandSettings(**section)).materialize()
    config = ds_config(dist.world_size())
    sides: dict[str, list[float]] = {"wonderland": [], "no-agreement": [], "wonderland-again": []}
    inside: list[float] = []
    looks: list[float] = []  # of which: the range check of the next step's tokens
    order = list(sides)
    for rep in range(args.reps):
        k = rep % len(order)
        for side in order[k:] + order[:k]:
            run_dir = folder / f"{side}{rep}"
            if side == "no-agreement":
                with Without():
                    times = stage_loop(task, config, args.steps, run_dir)
            else:
                with Timed() as timed:
                    times = stage_loop(task, config, args.steps, run_dir)
                inside.append(timed.seconds / max(timed.calls, 1))
                looks.append(timed.look / max(timed.calls, 1))
            sides[side].append(statistics.fmean(times[args.warm :]))
            dist.barrier()
    base = sides["no-agreement"]
    result = {
        "setup": {
            "model": f"GPT-2 (transformers), 4 layers, 256 wide, vocabulary {args.vocab}",
            "seq_len": args.seq_len,
            "micro": 4,
            "grad_acc": 2,
            "ranks": dist.world_size(),
            "zero": 2,
            "precision": "fp32",
            "steps": args.steps,
            "warm": args.warm,
            "reps": args.reps,
        },  # fmt: skip
        "mean_step_s": sides,
        "ratio_to_no_agreement": {
            side: {
                "median": statistics.median(v) / statistics.median(base),
                "paired": statistics.median(a / b for a, b in zip(v, base)),
            }
            for side, v in sides.items()
        },
        "agreement_in_loop_s_per_step": {
            "median": statistics.median(inside),
            "max": max(inside),
        },
        "token_check_s_per_step": {"median": statistics.median(looks), "max": max(looks)},
    }
    if dist.is_main():
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result, indent=2))
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    main()
