"""One rank of the held-save check (tests/test_async_ckpt.py): a save that holds the live
parameters and optimizer state instead of copying them must write exactly what DeepSpeed's
own synchronous save writes at the same step, although the next optimizer steps run while
the writer is still busy.

Per ZeRO stage: train 2 steps; DeepSpeed's save_checkpoint (reference) and wonderland's
snapshot engine at the same step, with the writer made slow (its "before-file" hook sleeps);
then more steps with the loop's fence before each optimizer update; then compare every file.
``--serialize-held`` turns async_save_copy off (the writer serializes the live tensors
instead of copying them first). ``--no-fence`` drops the fence: the check must then find the files changed (the hazard the
fence exists for is real). Prints one JSON line per stage on rank 0.

    RANK=r WORLD_SIZE=2 LOCAL_RANK=r LOCAL_SIZE=2 MASTER_ADDR=127.0.0.1 MASTER_PORT=P \\
        python tests/helpers/held_save_check.py OUT_DIR [--no-fence] [--serialize-held] [--zero 1,2,3]
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import deepspeed
import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.helpers.util import same  # noqa: E402
from wonderland_ds.checkpoint import async_save as async_ckpt  # noqa: E402
from wonderland_ds.checkpoint import snapshot_engine  # noqa: E402
from wonderland_ds.core import distributed as dist  # noqa: E402


def step(engine, gen, writer: async_ckpt.Writer | None, waited: list[float]) -> None:
    """One optimizer step of 2 micro-batches; the fence (when a writer is given) before the
    optimizer update, as engine.fit does. The buffer changes in every forward."""
    for m in range(2):
        x = torch.randn(4, 32, generator=gen).bfloat16()
        engine.module.seen.add_(1.0)
        engine.backward(engine(x).float().pow(2).mean())
        if m == 1 and writer is not None:
            waited.append(writer.fence())
        engine.step()


def main() -> None:
    out, fence = Path(sys.argv[1]), "--no-fence" not in sys.argv
    stages = (1, 2, 3)
    if "--zero" in sys.argv:  # a subset, e.g. --zero 2
        stages = tuple(int(z) for z in sys.argv[sys.argv.index("--zero") + 1].split(","))
    dist.init(120)
    for zero in stages:
        config = {
            "train_micro_batch_size_per_gpu": 4,
            "gradient_accumulation_steps": 2,
            "zero_optimization": {"stage": zero},
            "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "torch_adam": True}},
        }
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.Linear(64, 4))
        model.register_buffer("seen", torch.zeros(3))  # a buffer the "forward" updates
        engine, *_ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
        gen = torch.Generator().manual_seed(dist.rank())
        for _ in range(2):
            step(engine, gen, None, [])
        root = out / f"z{zero}"
        engine.save_checkpoint(str(root), tag="ds", save_latest=False)
        original = engine.checkpoint_engine

        def slow(point: str) -> None:
            if point == "before-file":
                time.sleep(0.4)  # the next steps run while this file waits to be written

        writer = snapshot_engine.install(engine, slow, copy_held="--serialize-held" not in sys.argv)
        engine.save_checkpoint(str(root), tag="held", save_latest=False)
        engine.checkpoint_engine = original
        queued = writer.pending
        waited: list[float] = []
        for _ in range(3):
            step(engine, gen, writer if fence else None, waited)
        writer.wait()
        writer.close()
        dist.barrier()
        files = sorted(p.name for p in (root / "ds").iterdir())
        equal = {
            f: same(
                torch.load(root / "ds" / f, weights_only=False),
                torch.load(root / "held" / f, weights_only=False),
            )
            for f in files
        }
        report = {
            "zero": zero,
            "files": len(files),
            "held_files": sorted(p.name for p in (root / "held").iterdir()) == files,
            "equal": equal,
            "queued": queued,
            "fence_waited_s": sum(waited),
        }
        reports = dist.gather_all(report)
        if dist.is_main():
            print("HELD-SAVE " + json.dumps(reports), flush=True)
        engine.destroy()
        dist.barrier()
    # As the stage ends: a barrier, then the process group destroyed (a gloo thread left to the
    # interpreter's exit aborted rank 0 once: "terminate called without an active exception").
    dist.teardown()


if __name__ == "__main__":
    main()
    dist.leave(0)
