"""Per-rank benchmark: wonderland's stage loop against a plain DeepSpeed loop, side by side.

Launched by DeepSpeed's own launcher so both sides run in the same processes, on the same
model, data, config and process count, alternating repetitions with the order rotating
(A B C, B C A, C A B, ...) so the machine's noise and a side's place hit every side alike:

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --master_addr 127.0.0.1 --no_ssh_check \\
        bench/bench_engine.py --task digits --zero 2 --steps 200 --reps 3 --out R.json

Sides: ``raw`` (a hand-written DeepSpeed loop: in-memory batches, forward/backward/step, the
loss .item() a step as every real loop logs it), ``wonderland`` (engine.fit with the guards on,
defaults, no saves inside the timed window), ``guards-off``, ``check-every-step``,
``check-blocking`` (guards.overlap_check false), ``reads-1`` (the stage's loader reading one
step at a time) and ``raw-again`` (raw once more: the noise floor of every ratio). With
``--save`` it also times
checkpoint saves: DeepSpeed's own synchronous save_checkpoint against wonderland's save
(time the loop is blocked, and time until the checkpoint is complete), with the default
``async_save_copy`` (``wl_*``) and without it (``serialize_*``), plus the disk's sequential
write speed measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import deepspeed
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from disk import write_speed  # noqa: E402

from wonderland_ds.checkpoint import async_save as async_ckpt
from wonderland_ds.checkpoint import snapshot_engine
from wonderland_ds.config.settings import Guards, WonderlandSettings  # noqa: E402
from wonderland_ds.core import distributed as dist  # noqa: E402
from wonderland_ds.data import builtin, cache  # noqa: E402
from wonderland_ds.training.build import build  # noqa: E402
from wonderland_ds.training.saving import Saver  # noqa: E402
from wonderland_ds.training.state import Progress, StageRun  # noqa: E402
from wonderland_ds.training.trainer import fit  # noqa: E402


def ds_config(zero: int, micro: int, gas: int, world: int) -> dict:
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": gas,
        "train_batch_size": micro * gas * world,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": zero},
        "bf16": {"enabled": True},
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
        "scheduler": {
            "type": "WarmupDecayLR",
            "params": {
                "warmup_min_lr": 0.0,
                "warmup_max_lr": 1e-3,
                "warmup_num_steps": 100,
                "total_num_steps": 100000,
            },
        },
    }


CPU: list[float] = []  # process CPU time (all threads) after each optimizer step, this run


def _stamp_cpu(engine) -> None:
    """Stamps the process's CPU time (every thread: gloo's, the metrics sink's, TensorBoard's)
    after every optimizer step, on either side alike: CPU time is work done, which the VM's
    steal time and the other rank's waits do not blur as they blur the wall clock."""
    step, calls = engine.step, [0]
    gas = int(engine.gradient_accumulation_steps())
    CPU.clear()

    def stamped(*a, **k):
        out = step(*a, **k)
        calls[0] += 1
        if calls[0] % gas == 0:
            CPU.append(time.process_time())
        return out

    engine.step = stamped


def cpu_per_step() -> float:
    """Mean CPU seconds per step of the last run, summed over ranks (first 5 steps dropped,
    as for the wall clock)."""
    d = [b - a for a, b in zip(CPU[5:], CPU[6:])]
    return sum(dist.gather_all(statistics.fmean(d)))


def block_quantile(times: list[float], block: int = 10, q: float = 0.25) -> float:
    """Step time estimated from the fast blocks: the steps cut into consecutive blocks of
    ``block`` (one guard check period each, so every block holds exactly one check), and the
    ``q`` quantile of the blocks' mean step times. The VM's steal bursts land in some blocks
    and make them slow; the lower quantile of blocks is what a step costs when nothing else
    takes the core, on both sides alike."""
    means = [
        statistics.fmean(times[i : i + block]) for i in range(0, len(times) - block + 1, block)
    ]
    if len(means) < 2:  # too few steps for blocks (the smoke test): the plain mean
        return statistics.fmean(times)
    return statistics.quantiles(means, n=100, method="inclusive")[int(q * 100) - 1]


def ratios_to_raw(sides: dict[str, list[float]]) -> dict[str, dict[str, float]]:
    """Each side against the raw loop, measured in the same processes: min over min, median
    over median, and the median of each repetition's own ratio (its run over the raw run of the
    same repetition: slow drifts of the machine cancel)."""
    raw = sides["raw"]
    return {
        k: {
            "min": round(min(v) / min(raw), 3),
            "median": round(statistics.median(v) / statistics.median(raw), 3),
            "paired_median": round(statistics.median(a / b for a, b in zip(v, raw)), 3),
        }
        for k, v in sides.items()
        if k != "raw"
    }


def raw_loop(task, config: dict, steps: int) -> list[float]:
    """What a team writes by hand: data indexed from memory, no checks."""
    torch.manual_seed(0)
    model = task.build_model()
    engine, *_ = deepspeed.initialize(
        model=model,
        config=config,
        model_parameters=[p for p in model.parameters() if p.requires_grad],
    )
    _stamp_cpu(engine)
    x, y = torch.from_numpy(task.train.x[:]), torch.from_numpy(task.train.y[:])
    mb, gas = config["train_micro_batch_size_per_gpu"], config["gradient_accumulation_steps"]
    g = torch.Generator().manual_seed(dist.rank())
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        for _ in range(gas):
            idx = torch.randint(0, len(y), (mb,), generator=g)
            xb = x[idx]
            if xb.is_floating_point():
                xb = xb.bfloat16()
            loss = task.loss(engine(xb), y[idx])
            engine.backward(loss)
            engine.step()
        loss.item()
        times.append(time.perf_counter() - t0)
    engine.destroy()
    return times


def wonderland_loop(
    task,
    config: dict,
    steps: int,
    guards: bool,
    run_dir: Path,
    **guard_settings,
) -> list[float]:
    # Default settings (progress line, metrics sink, guards) except that no checkpoint is
    # saved inside the timed window (saves are benchmarked on their own, --save).
    # guard_settings: guards.* fields changed from their defaults (another side).
    g = Guards(enabled=guards, **guard_settings)
    settings = WonderlandSettings(train_steps=steps, save_interval=10**9, guards=g)
    from wonderland_ds.config.ds_config import DSConfig

    run = StageRun(
        stage=15,
        run_dir=run_dir,
        task=task,
        ds_dict=config,
        cfg=DSConfig.model_validate(config),
        settings=settings,
        seed=0,
        steps=steps,
    )
    run.stage_dir.mkdir(parents=True, exist_ok=True)
    engine = build(run, None if not task.normalize else _stats(task))
    _stamp_cpu(engine)
    # verify: the stage-start check runs as in a stage (before the first step, untimed); its
    # probe time places the first in-training probe.
    fit(run, engine, Progress(), lambda *a, **k: None, verify=True)
    with open(run.stage_dir / "metrics.csv") as fh:
        rows = list(__import__("csv").DictReader(fh))
    engine.destroy()
    # Wall clock between consecutive steps: everything the loop does (guards, progress line,
    # metrics sink) is inside. The last step includes the final save: dropped.
    wall = [float(r["wall"]) for r in rows[:-1]]
    return [b - a for a, b in zip(wall, wall[1:])]


def with_constant(module, name: str, value, run):
    """``run()`` with ``module.name`` set to ``value``, then as it was."""
    before = getattr(module, name)
    setattr(module, name, value)
    try:
        return run()
    finally:
        setattr(module, name, before)


def one_step_reads(run):
    """``run()`` with the stage's loader reading one step at a time (data.CHUNK_STEPS 1)
    instead of the 16 it reads at once in the step loop."""
    from wonderland_ds.data import sampler as data

    return with_constant(data, "CHUNK_STEPS", 1, run)


def _stats(task):
    from wonderland_ds.data.tasks import normalization_stats

    return normalization_stats(task.train.x[:])


def save_bench(task, config: dict, reps: int, folder: Path) -> dict:
    settings = WonderlandSettings(keep_last=1)
    from wonderland_ds.config.ds_config import DSConfig

    run = StageRun(
        stage=15,
        run_dir=folder / "w",
        task=task,
        ds_dict=config,
        cfg=DSConfig.model_validate(config),
        settings=settings,
        seed=0,
        steps=1,
    )
    run.stage_dir.mkdir(parents=True, exist_ok=True)
    engine = build(run, None if not task.normalize else _stats(task))
    params = sum(p.numel() for p in engine.module.parameters())
    mb = config["train_micro_batch_size_per_gpu"]
    dtype = next(engine.module.parameters()).dtype

    def train_step(writer: async_ckpt.Writer | None = None) -> float:
        """One optimizer step as the stage loop takes it: the fence (wonderland's side) before
        the optimizer update. Returns the seconds the fence waited."""
        waited = 0.0
        for m in range(config["gradient_accumulation_steps"]):
            xb = torch.from_numpy(task.train.x[:mb])
            xb = xb.to(dtype) if xb.is_floating_point() else xb
            engine.backward(task.loss(engine(xb), torch.from_numpy(task.train.y[:mb])))
            if writer is not None and m == config["gradient_accumulation_steps"] - 1:
                waited = writer.fence()
            engine.step()
        return waited

    # One real optimizer step first: a checkpoint worth timing has Adam's moments in it
    # (without a step the optimizer files hold only the fp32 master weights, 1/3 the bytes).
    train_step()
    out: dict = {
        "params": params,
        "ds_sync_s": [],
        "ds_sync_durable_s": [],
        "wl_blocked_s": [],
        "wl_fence_s": [],
        "wl_complete_s": [],
        "ds_step_after_s": [],
        "wl_step_after_s": [],
    }
    # Two wonderland sides, each with its own writer (and buffer pool), as a stage has one:
    # "wl" the default (the writer copies the held tensors first, async_save_copy), and
    # "serialize" (async_save_copy false: the writer serializes the live tensors, and the
    # fence waits for that). Their order alternates from one repetition to the next.
    for side in ("serialize",):
        for key in ("blocked_s", "fence_s", "complete_s", "step_after_s"):
            out[f"{side}_{key}"] = []
    prog = Progress()
    original = engine.checkpoint_engine
    writers = {}
    for side, copy_held in (("wl", True), ("serialize", False)):
        writer = snapshot_engine.install(engine, copy_held=copy_held)
        writers[side] = (writer, engine.checkpoint_engine)
        engine.checkpoint_engine = original
    step = 0
    for rep in range(reps):
        dist.barrier()
        t0 = time.perf_counter()
        engine.save_checkpoint(str(folder / "ds"), tag=f"r{rep}")
        dist.barrier()
        out["ds_sync_s"].append(time.perf_counter() - t0)
        # The same save made durable (fsync every file), as wonderland's checkpoints are.
        if dist.is_main():
            for f in (folder / "ds" / f"r{rep}").iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
        dist.barrier()
        out["ds_sync_durable_s"].append(time.perf_counter() - t0)
        # The step after the save, as training goes on (DeepSpeed's save has finished).
        t1 = time.perf_counter()
        train_step()
        out["ds_step_after_s"].append(max(dist.gather_all(time.perf_counter() - t1)))
        for side in ("wl", "serialize")[:: 1 if rep % 2 == 0 else -1]:
            writer, ours = writers[side]
            step += 1
            engine.global_steps = step
            engine.checkpoint_engine = ours  # as in a stage: one writer (and pool) per run
            # What the stage loop learns from its check's all-reduce: every writer is idle.
            settled = not any(dist.gather_all(writer.busy))
            dist.barrier()
            t0 = time.perf_counter()
            saver = Saver(run, engine)
            saver.writer = writer
            _, blocked = saver.save(prog, None, settled)
            # Training goes on while the writer reads the held tensors; the fence before the
            # optimizer update is the rest of the blocked time (engine.fit does the same).
            t1 = time.perf_counter()
            fence = train_step(writer)
            step_after = time.perf_counter() - t1
            # The slowest rank's blocked time (DeepSpeed's side is timed barrier to barrier).
            out[f"{side}_blocked_s"].append(max(dist.gather_all(blocked + fence)))
            out[f"{side}_fence_s"].append(max(dist.gather_all(fence)))
            out[f"{side}_step_after_s"].append(max(dist.gather_all(step_after)))
            writer.wait()
            dist.barrier()
            out[f"{side}_complete_s"].append(time.perf_counter() - t0)
            engine.checkpoint_engine = original  # DeepSpeed's own engine for the next sync save
    for side, (writer, _) in writers.items():
        # Host memory each side keeps between saves (its buffer pool), all ranks together.
        pooled = sum(b.nbytes() for bufs in writer.pool._free.values() for b in bufs)
        out[f"{side}_pool_bytes"] = sum(dist.gather_all(pooled))
        writer.close()
    tag = folder / "w" / "stage15" / "checkpoints" / f"global_step{step}"
    out["checkpoint_bytes"] = sum(p.stat().st_size for p in tag.iterdir())
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default="digits")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--zero", type=int, default=2)
    ap.add_argument("--micro", type=int, default=16)
    ap.add_argument("--gas", type=int, default=4)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--save", type=int, default=0, help="save repetitions (0: no save bench)")
    ap.add_argument("--skip-steps", action="store_true")
    ap.add_argument(
        "--sides",
        default="raw,wonderland,guards-off,check-every-step,check-blocking",
        help="step-time sides to run (raw is always run: the ratios are to it)",
    )
    ap.add_argument(
        "--profile",
        action="store_true",
        help="cProfile one wonderland and one raw run on rank 0 (where time goes)",
    )
    ap.add_argument(
        "--pin",
        action="store_true",
        help="pin each rank to one core (local rank modulo the core count), both sides alike",
    )
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if args.pin:
        local = int(os.environ.get("LOCAL_RANK", args.local_rank))
        os.sched_setaffinity(0, {local % (os.cpu_count() or 1)})
    dist.init(600)
    world = dist.world_size()
    raw_task = (
        builtin.pylm(args.dim, args.layers) if args.task == "pylm" else builtin.load(args.task)
    )
    folder = Path(tempfile.mkdtemp(prefix="wl-bench-")) if dist.is_main() else None
    folder = dist.broadcast(folder)
    if dist.is_main():
        cache.write(raw_task.materialize(), folder / "cache")
    dist.barrier()
    task = cache.open_task(raw_task, folder / "cache")
    config = ds_config(args.zero, args.micro, args.gas, world)
    result: dict = {
        "task": args.task,
        "zero": args.zero,
        "world": world,
        "micro": args.micro,
        "gas": args.gas,
        "steps": args.steps,
        "reps": args.reps,
    }
    if args.profile:
        import cProfile
        import io
        import pstats

        for name, fn in (
            ("raw", lambda: raw_loop(task, config, args.steps)),
            (
                "wonderland",
                lambda: wonderland_loop(task, config, args.steps, True, folder / "prof"),
            ),
        ):
            prof = cProfile.Profile()
            prof.enable()
            fn()
            prof.disable()
            if dist.is_main():
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(18)
                print(f"=== profile: {name}\n{buf.getvalue()}", flush=True)
    if not args.skip_steps:
        sides: dict[str, list[float]] = {
            "raw": [],
            "wonderland": [],
            "guards-off": [],
            "check-every-step": [],
            "check-blocking": [],
            "raw-again": [],
            "reads-1": [],
        }
        wanted = set(args.sides.split(",")) | {"raw"}
        sides = {k: v for k, v in sides.items() if k in wanted}
        runs = {
            "raw": lambda rep: raw_loop(task, config, args.steps),
            # The same raw loop a second time: its ratio to raw is the estimators' noise floor.
            "raw-again": lambda rep: raw_loop(task, config, args.steps),
            "wonderland": lambda rep: wonderland_loop(
                task, config, args.steps, True, folder / f"on{rep}"
            ),
            "guards-off": lambda rep: wonderland_loop(
                task, config, args.steps, False, folder / f"off{rep}"
            ),
            # guards.check_interval 1: the guards' all-reduce every step (the default checks
            # every 10 steps), to show what that collective costs.
            "check-every-step": lambda rep: wonderland_loop(
                task, config, args.steps, True, folder / f"c1{rep}", check_interval=1
            ),
            # guards.overlap_check false: the loop waits for each check's all-reduce at once
            # instead of overlapping it with the next step (the default), to show what the
            # overlap saves.
            "check-blocking": lambda rep: wonderland_loop(
                task, config, args.steps, True, folder / f"cb{rep}", overlap_check=False
            ),
            # The stage's loader reading one step at a time, to show what reading several
            # steps in one gather saves.
            "reads-1": lambda rep: one_step_reads(
                lambda: wonderland_loop(task, config, args.steps, True, folder / f"r1{rep}")
            ),
        }
        cpu: dict[str, list[float]] = {k: [] for k in sides}
        blocks: dict[str, list[float]] = {k: [] for k in sides}
        order = list(sides)
        for rep in range(args.reps):
            # Every side once a repetition, the order rotating from one repetition to the
            # next: no side always runs first, or right after raw.
            k = rep % len(order)
            for side in order[k:] + order[:k]:
                times = runs[side](rep)[5:]
                sides[side].append(statistics.fmean(times))
                blocks[side].append(block_quantile(times))
                cpu[side].append(cpu_per_step())
        # Each run's mean step time (first 5 steps dropped), not its median: the guards' check
        # comes every guards.check_interval steps, and a median would not see it.
        result["mean_step_s"] = sides
        result["ratio_to_raw"] = ratios_to_raw(sides)
        # The same for the fast blocks' step time (block_quantile): the estimator least moved
        # by the VM's steal bursts.
        result["block_q25_step_s"] = blocks
        result["block_ratio_to_raw"] = ratios_to_raw(blocks)
        # The same for CPU time per step (all ranks, all threads): the work each side does.
        result["cpu_step_s"] = cpu
        result["cpu_ratio_to_raw"] = ratios_to_raw(cpu)
    if args.save:
        if dist.is_main():
            result["disk_write_Bps"] = write_speed(folder)
        result["save"] = save_bench(task, config, args.save, folder)
    if dist.is_main():
        Path(args.out).write_text(json.dumps(result, indent=2))
        import shutil

        shutil.rmtree(folder, ignore_errors=True)
    dist.barrier()


if __name__ == "__main__":
    main()
