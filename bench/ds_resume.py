"""The plain-DeepSpeed side of bench_resume.py: what a hand-written loop does to resume.

Launched by DeepSpeed's launcher: build the same model, ``deepspeed.initialize``,
``load_checkpoint`` (optimizer and scheduler state), one training step; rank 0 writes the wall
clock time the first step ended to --out. Rank 0 also prints ``PHASE <name> <wall clock>``
lines (imported, loaded) that bench/resume_timeline.py reads.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True)
    ap.add_argument("--load-dir", required=True)
    ap.add_argument("--tag", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    args = ap.parse_args()

    def phase(name: str) -> None:
        if os.environ.get("RANK", "0") == "0":
            print(f"PHASE {name} {time.time()}", flush=True)

    import deepspeed
    import torch

    from bench.big_task import pylm
    from wonderland_ds.data.builtin import PYLM_CONTEXT

    config = json.loads(Path(args.config).read_text())
    config.pop("wonderland", None)
    deepspeed.init_distributed("gloo" if not torch.cuda.is_available() else "nccl")
    task = pylm()
    torch.manual_seed(0)
    model = task.build_model()
    phase("imported")
    engine, *_ = deepspeed.initialize(
        model=model, config=config, model_parameters=[p for p in model.parameters()]
    )
    path, _ = engine.load_checkpoint(
        args.load_dir, tag=args.tag, load_optimizer_states=True, load_lr_scheduler_states=True
    )
    assert path is not None, "DeepSpeed loaded nothing"
    phase("loaded")
    mb = engine.train_micro_batch_size_per_gpu()
    for _ in range(engine.gradient_accumulation_steps()):
        x = torch.randint(0, 256, (mb, PYLM_CONTEXT))
        loss = task.loss(engine(x), torch.randint(0, 256, (mb, PYLM_CONTEXT)))
        engine.backward(loss)
        engine.step()
    float(loss)
    if engine.global_rank == 0:
        Path(args.out).write_text(
            json.dumps({"first_step_end": time.time(), "global_steps": engine.global_steps})
        )
    # After the timed part: leave as wonderland's train.py does (a barrier, the group torn
    # down, then no interpreter finalization). Plain DeepSpeed here aborted at finalization in
    # 2 of 4 runs, 1 December 2026 ("terminate called without an active exception", SIGABRT,
    # "<no Python frame>": gloo's C++ threads destroyed while joinable, the class of
    # pytorch/pytorch#179291), even with engine.destroy() and destroy_process_group() first.
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
