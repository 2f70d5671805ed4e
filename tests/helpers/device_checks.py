"""One rank of the device checks of tests/test_gpu.py (CPU and gloo where there is no GPU, so
the script itself is exercised on every machine).

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29599 \
        python tests/helpers/device_checks.py collectives|async-save OUT_DIR

``collectives``: the guards' check matrix (float64, one row per step) summed across ranks as
the check sums it (a CPU tensor: gloo beside NCCL on CUDA) and as a device tensor (NCCL),
plus the start-of-stage all-reduce check on the device. ``async-save``: a DeepSpeed engine
saved twice through the production snapshot engine (held copies), with the device memory
allocated before and after. Each rank writes OUT_DIR/<check>-rank<R>.json.
"""

from __future__ import annotations

import gc
import json
import os
import sys
from pathlib import Path

import torch


def collectives(out: Path, rank: int, world: int) -> dict:
    import torch.distributed as tdist

    from wonderland_ds.config.settings import Guards
    from wonderland_ds.core import distributed as dist
    from wonderland_ds.training import faults, health

    dev = dist.device()
    cols = 4 + 2 * world  # a guard vector's slots for this world size
    base = torch.arange(10 * cols, dtype=torch.float64).reshape(10, cols)

    def row(r: int) -> torch.Tensor:  # distinct per rank, every sum exact in float64
        return base * (r + 1) + 0.5 ** (r + 1)

    want = row(0)
    for r in range(1, world):
        want = want + row(r)
    on_cpu = row(rank)
    dist.all_reduce_sum_start(on_cpu).wait()  # how the guards' check sums its matrix
    on_dev = row(rank).to(dev)
    dist.all_reduce_sum(on_dev)
    dist.sync(dev)
    dtype = torch.float16 if dev.type == "cuda" else torch.float32
    hosts = dist.gather_all(dist.hostname())
    report, events = health.verify_allreduce(dtype, faults.FaultPlan(), hosts, Guards())
    return {
        "backend": str(tdist.get_backend()),
        "device": str(dev),
        "cpu_sum_exact": bool(torch.equal(on_cpu, want)),
        "device_sum_exact": bool(torch.equal(on_dev.cpu(), want)),
        "allreduce_ok": [r["allreduce_ok"] for r in report["ranks"]],
        "events": [e.to_dict() for e in events],
    }


def async_save(out: Path, rank: int, world: int) -> dict:
    import deepspeed

    from wonderland_ds.checkpoint import snapshot_engine

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    writer = snapshot_engine.install(engine, copy_held=True)

    def step() -> None:
        loss = engine(torch.randn(8, 512, device=dev)).pow(2).mean()
        engine.backward(loss)
        writer.fence()  # as the step loop does before every optimizer update
        engine.step()

    def allocated() -> int:
        gc.collect()
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())

    step()  # the optimizer state exists from here on
    step()
    before = allocated()  # steady state: another step without a save leaves this much
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    after = []
    for k in (1, 2):  # the second save reuses the first one's buffers
        engine.save_checkpoint(str(out / "ckpt"), tag=f"global_step{k}", save_latest=False)
        step()  # training goes on while the writer serializes the held copies
        writer.wait()
        after.append(allocated())
    peak = int(torch.cuda.max_memory_allocated()) if cuda else 0
    writer.close()
    files = sorted(p.name for p in (out / "ckpt" / "global_step2").iterdir())
    return {
        "device": str(dev),
        "state_device": str(next(engine.module.parameters()).device),
        "param_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
        "before": before,
        "after": after,
        "peak": peak,
        "files": files,
    }


def main() -> None:
    check, out = sys.argv[1], Path(sys.argv[2])
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if torch.cuda.is_available():
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    from wonderland_ds.core import distributed as dist

    dist.init(60)
    result = {"collectives": collectives, "async-save": async_save}[check](out, rank, world)
    (out / f"{check}-rank{rank}.json").write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
