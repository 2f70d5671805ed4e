"""One rank of the device checks of tests/test_gpu.py (CPU and gloo where there is no GPU, so
the script itself is exercised on every machine).

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29599 \
        python tests/helpers/device_checks.py collectives|async-save OUT_DIR

``collectives``: the guards' check matrix (float64, one row per step) summed across ranks as
the check sums it (a CPU tensor: gloo beside NCCL on CUDA) and as a device tensor (NCCL),
plus the start-of-stage all-reduce check on the device. ``async-save``: a DeepSpeed engine
(ZeRO-2, bf16, the optimizer on the device) saved twice through the production snapshot engine
and, at the same steps, by DeepSpeed itself: the device memory allocated around each save,
the pool's page-locked buffers and whether the files load back equal. Each rank writes
OUT_DIR/<check>-rank<R>.json.
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

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    from tests.helpers.util import same
    from wonderland_ds.checkpoint import snapshot_engine

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    config = {
        "train_micro_batch_size_per_gpu": 8,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 10)
    )
    model.register_buffer("seen", torch.zeros(3))  # a buffer each forward updates: not held
    engine, *_ = deepspeed.initialize(
        model=model, model_parameters=model.parameters(), config=config
    )
    original = engine.checkpoint_engine
    writer = snapshot_engine.install(engine, copy_held=True)
    ours = engine.checkpoint_engine

    def step() -> None:
        engine.module.seen.add_(1.0)
        loss = engine(torch.randn(8, 512, device=dev).bfloat16()).float().pow(2).mean()
        engine.backward(loss)
        writer.fence()  # as the step loop does before every optimizer update
        engine.step()

    def allocated() -> int:
        gc.collect()
        if not cuda:
            return 0
        torch.cuda.synchronize()
        return int(torch.cuda.memory_allocated())

    def peak() -> int:
        return int(torch.cuda.max_memory_allocated()) if cuda else 0

    def reset_peak() -> None:
        if cuda:
            torch.cuda.reset_peak_memory_stats()

    def host_allocs() -> int:  # page-locked blocks the CUDA host allocator has created
        stats = getattr(torch.cuda, "host_memory_stats", None)
        return int(stats().get("num_host_alloc", 0)) if cuda and stats else 0

    def pinned_pool() -> dict[str, int]:  # the pool's page-locked buffers, once written
        return {
            str(buf.data_ptr()): buf.nbytes()
            for (_, pinned), bufs in writer.pool._free.items()
            if pinned
            for buf in bufs
        }

    def device_state_bytes() -> int:  # one copy of the device storages a save writes
        seen: dict[int, int] = {}

        def walk(obj: object) -> None:
            if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
                s = obj.untyped_storage()
                seen[s.data_ptr()] = s.nbytes()
            elif isinstance(obj, dict):
                for v in obj.values():
                    walk(v)
            elif isinstance(obj, (list, tuple)):
                for v in obj:
                    walk(v)

        walk([engine.module_state_dict(), engine.optimizer.state_dict()])
        return sum(seen.values())

    step()  # the optimizer state exists from here on
    step()
    saves = []
    for k in (1, 2):  # the second save reuses the first one's buffers
        tag = f"global_step{k}"
        # DeepSpeed's own synchronous save of this step: the reference, and its device memory.
        engine.checkpoint_engine = original
        ds_before = allocated()
        reset_peak()
        engine.save_checkpoint(str(out / "ref"), tag=tag, save_latest=False)
        ds_peak = peak()
        engine.checkpoint_engine = ours
        writer.pool.start()  # as Saver.save does
        before, allocs = allocated(), host_allocs()
        reset_peak()
        engine.save_checkpoint(str(out / "ckpt"), tag=tag, save_latest=False)
        writer.pool.trim()
        saved, save_peak = allocated(), peak()
        step()  # training goes on while the held copies finish; the fence orders the update
        writer.wait()
        saves.append(
            {
                "ds_before": ds_before,
                "ds_peak": ds_peak,
                "before": before,
                "saved": saved,
                "peak": save_peak,
                "after": allocated(),
                "host_allocs": host_allocs() - allocs,
                "reused": writer.pool.reused,
                "pinned": pinned_pool(),
            }
        )
    all_pinned = all(
        torch.empty(0, dtype=torch.uint8).set_(buf).is_pinned()
        for (_, pinned), bufs in writer.pool._free.items()
        if pinned
        for buf in bufs
    )
    writer.close()
    files = sorted(p.name for p in (out / "ckpt" / "global_step2").iterdir())
    equal = {
        f"global_step{k}/{f}": same(
            torch.load(out / "ref" / f"global_step{k}" / f, map_location="cpu", weights_only=False),
            torch.load(
                out / "ckpt" / f"global_step{k}" / f, map_location="cpu", weights_only=False
            ),
        )
        for k in (1, 2)
        for f in files
    }
    return {
        "device": str(dev),
        "state_device": str(next(engine.module.parameters()).device),
        "param_bytes": sum(p.numel() * p.element_size() for p in engine.module.parameters()),
        "device_state_bytes": device_state_bytes(),
        "saves": saves,
        "all_pinned": all_pinned,
        "files": files,
        "equal": equal,
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
    dist.teardown()  # a barrier, then the group destroyed
    dist.leave(0)  # no interpreter finalization left to meet a gloo thread


if __name__ == "__main__":
    main()
