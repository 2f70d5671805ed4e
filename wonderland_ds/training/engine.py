"""The per-rank training stage: build, load, a plain step loop, verified saves.

Read top to bottom: :func:`build` makes the model and the DeepSpeed engine, :func:`restore`
loads a checkpoint (plain or universal) and repairs what DeepSpeed leaves wrong,
:func:`fit` trains ``steps`` optimizer steps and saves through :func:`save`.
"""

from __future__ import annotations

import contextlib
import csv
import json
import math
import os
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wonderland_ds.checkpoint import async_save as async_ckpt
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.config.ds_config import DSConfig
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, GuardStop, Refused
from wonderland_ds.data.sampler import GlobalSampler, LoaderState, Prefetcher
from wonderland_ds.data.tasks import Normalize, Split, Task, normalization_stats
from wonderland_ds.run import manifest
from wonderland_ds.training import faults, health, startup
from wonderland_ds.training.cpu import short_gloo_slices
from wonderland_ds.training.guards import StepGuards
from wonderland_ds.training.health import Event
from wonderland_ds.training.metrics import MetricsSink, guard_figures
from wonderland_ds.training.progress import ProgressDisplay

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class StageRun:
    """Everything one rank needs to run one training stage."""

    stage: int
    run_dir: Path
    task: Task
    ds_dict: dict[str, Any]
    cfg: DSConfig
    settings: WonderlandSettings
    seed: int
    steps: int
    fault: faults.FaultPlan = field(default_factory=faults.FaultPlan)
    heartbeat: Any = None
    """The rank's :class:`~wonderland_ds.run.liveness.Heartbeat`; the loop sets its ``step``."""

    @property
    def stage_dir(self) -> Path:
        return self.run_dir / f"stage{self.stage}"

    @property
    def ckpt_root(self) -> Path:
        return self.stage_dir / "checkpoints"


@dataclass
class Progress:
    """The state the loop carries and every checkpoint records."""

    samples_consumed: int = 0
    stage_start_step: int = 0
    norm_mean: list[float] = field(default_factory=list)
    norm_std: list[float] = field(default_factory=list)


def build(run: StageRun, norm: tuple[np.ndarray, np.ndarray] | None) -> Any:
    import deepspeed

    torch.manual_seed(run.seed)
    model = run.task.build_model()
    if norm is not None:
        normalize = getattr(model, "norm", None)
        if not isinstance(normalize, Normalize):
            raise Refused(
                f"task {run.task.name!r}: its model has no .norm Normalize module",
                "make the model's first module wonderland_ds.data.tasks.Normalize as .norm",
            )
        normalize.set_stats(*norm)
    trainable = [p for p in model.parameters() if p.requires_grad]
    engine, *_ = deepspeed.initialize(model=model, model_parameters=trainable, config=run.ds_dict)
    return engine


def loss_scale(engine: Any) -> float | None:
    """The current fp16 loss scale: ZeRO's optimizers have ``cur_scale``; DeepSpeed 0.19.8's
    FP16_Optimizer (fp16 without ZeRO) keeps it in ``loss_scale_config``."""
    opt = engine.optimizer
    scale = getattr(opt, "cur_scale", None)
    if scale is None:
        scale = getattr(getattr(opt, "loss_scale_config", None), "cur_scale", None)
    return None if scale is None else float(scale)


def _micro_seed(seed: int, position: int) -> int:
    # Dropout noise is a function of the micro-batch's place in the sample stream, not of
    # history, rank or micro-step: a resumed run, or one on another world size with the same
    # micro batch, draws exactly the noise the original run drew for the same samples.
    return (seed * 1_000_003 + position) % (2**63)


def _seed_micro(seed: int, device: Any) -> None:
    # torch.manual_seed also seeds every lazily-initialised accelerator module (cuda, xpu,
    # mtia), each capturing a traceback when that module is not initialised: 1.2 ms per call
    # on a CPU host, 5 ms of a 25 ms step (profiled, BENCHMARKS.md). Seed only the
    # generators dropout draws from on this device.
    torch.default_generator.manual_seed(seed)
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.manual_seed(seed)


def save(
    run: StageRun,
    engine: Any,
    prog: Progress,
    loss: float | None,
    writer: async_ckpt.Writer,
    settled: bool = False,
) -> tuple[Path, float]:
    """A verified, crash-safe save that blocks training only for an in-memory snapshot
    (async_ckpt.py; checkpoint.py for the order of writes). ``settled``: every rank's writer
    was idle without an error at the last step's all-reduce, so there is nothing to wait for
    or agree on. Returns (tag dir, seconds the loop was blocked)."""
    t0 = time.perf_counter()
    if not settled:
        finish_pending(run, writer)  # back-pressure: the previous save completes first
    writer.pool.start()  # its buffers (all written now) are this save's to reuse
    step = int(engine.global_steps)
    tag = ck.tag_for(step)
    tag_dir = run.ckpt_root / tag
    if dist.is_main():
        run.ckpt_root.mkdir(parents=True, exist_ok=True)
        if tag_dir.exists() and ck.read_meta(tag_dir) is None:
            shutil.rmtree(tag_dir)  # a save of this step that never completed: start over
    # No barrier of our own: save_checkpoint's first collective is a barrier (after rank 0's
    # makedirs), before any rank creates a file, so no rank writes into the tag folder before
    # rank 0 has cleared it.
    state = loader_state(run, prog)
    client = {
        "universal_checkpoint_info": {"universal_checkpoint_version": 0.2},
        "wonderland": {
            "stage": run.stage,
            "data": state.to_dict(),
            "stage_start_step": prog.stage_start_step,
            "norm_mean": prog.norm_mean,
            "norm_std": prog.norm_std,
        },
    }
    faults.limit_file_size(run.fault, step, dist.rank())
    engine.save_checkpoint(str(run.ckpt_root), tag=tag, client_state=client, save_latest=False)
    writer.pool.trim()
    # Each rank's RNG states ride its own marker (no collective on the loop's time).
    rank, rng = dist.rank(), async_ckpt.rng_states()
    writer.submit(lambda: async_ckpt.mark_done(tag_dir, rank, rng))
    if dist.is_main():
        meta = _meta(run, engine, prog, loss, state)
        timeout = float(run.settings.process_group_timeout_s)

        def finalize() -> None:
            # Only after every rank's shards are durably written: metadata last, then latest.
            ck.finalize(
                run.ckpt_root,
                tag_dir,
                dist.world_size(),
                meta,
                run.settings.keep_last,
                timeout,
                lambda point: faults.maybe(run.fault, f"save-{point}", step, 0),
            )

        writer.submit(finalize)
    if not run.settings.async_save:
        finish_pending(run, writer)
    return tag_dir, time.perf_counter() - t0


def _fence(run: StageRun, writer: async_ckpt.Writer) -> float:
    """The optimizer-update fence, with finish_pending's time limit. A rank whose writer is
    stuck stops with the checkpoint-write finding; the other ranks then fail at their next
    collective (the process-group timeout names this rank)."""
    try:
        return writer.fence(timeout=float(run.settings.process_group_timeout_s) * 2)
    except TimeoutError as exc:
        raise GuardStop(
            [
                Finding(
                    "checkpoint-write",
                    "error",
                    f"rank {dist.rank()}: {exc}",
                    "check the checkpoint storage (hung mount, full or very slow disk), then"
                    " resume with --resume auto (the newest complete checkpoint is intact)",
                    str(run.ckpt_root),
                )
            ]
        ) from None


def finish_pending(run: StageRun, writer: async_ckpt.Writer) -> None:
    """Wait for this rank's queued checkpoint writes (and on rank 0 the metadata), then agree
    with every rank. A failed write on any rank stops every rank (exit 3): the half-written
    checkpoint is removed and the previous complete one stays the newest."""
    error = None
    try:
        writer.wait(timeout=float(run.settings.process_group_timeout_s) * 2)
    except (OSError, TimeoutError, RuntimeError) as exc:
        error = f"rank {dist.rank()}: {type(exc).__name__}: {exc}"
    errors = [e for e in dist.gather_all(error) if e]
    if not errors:
        return
    if dist.is_main():
        newest = ck.newest_complete(run.ckpt_root, deep=False)
        for _step, path in ck.tags(run.ckpt_root):
            if ck.read_meta(path) is None and (newest is None or path != newest.tag_dir):
                shutil.rmtree(path, ignore_errors=True)
    raise GuardStop(
        [
            Finding(
                "checkpoint-write",
                "error",
                f"writing a checkpoint failed on {e}",
                "free disk space / fix the storage, then resume with --resume auto (the newest"
                " complete checkpoint is intact; the partial one was removed)",
                str(run.ckpt_root),
            )
            for e in errors
        ]
    )


def _meta(
    run: StageRun, engine: Any, prog: Progress, loss: float | None, state: LoaderState
) -> dict[str, Any]:
    sched = engine.lr_scheduler
    lbi = int(sched.last_batch_iteration) if sched is not None else None
    scaler = loss_scale(engine) if run.cfg.fp16.enabled else None
    return {
        "stage": run.stage,
        "global_step": int(engine.global_steps),
        "skipped_steps": int(engine.skipped_steps),
        "stage_start_step": prog.stage_start_step,
        "has_optimizer_state": True,
        "has_scheduler_state": sched is not None,
        "scheduler": {
            "type": run.cfg.scheduler.type if run.cfg.scheduler else None,
            "last_batch_iteration": lbi,
        },
        "warmup_progress": None if lbi is None else lbi + 1,
        "lr": float(engine.get_lr()[0]),
        "world_size": dist.world_size(),
        "zero_stage": int(engine.zero_optimization_stage()),
        "precision": run.cfg.precision,
        "micro_batch": int(engine.train_micro_batch_size_per_gpu()),
        "grad_acc": int(engine.gradient_accumulation_steps()),
        "train_batch": int(engine.train_batch_size()),
        "loss_scale": None if scaler is None else float(scaler),
        "loss": loss,
        "data": state.to_dict(),
        "task": run.task.name,
        "norm_stats": {"mean": prog.norm_mean, "std": prog.norm_std},
        "rng_states": ck.RNG_FILE,
        "versions": manifest.versions(),
    }


def loader_state(run: StageRun, prog: Progress) -> LoaderState:
    assert run.task.train is not None
    return LoaderState(run.seed, prog.samples_consumed, run.task.fingerprint, len(run.task.train))


def fresh_progress(run: StageRun) -> tuple[Progress, tuple[np.ndarray, np.ndarray] | None]:
    """The pre-normalization pass: statistics over the cached training data, once (tasks
    without input normalization, such as the byte-level LM, skip it)."""
    assert run.task.train is not None
    if not run.task.normalize:
        return Progress(0, 0, [], []), None
    assert isinstance(run.task.train, Split)
    mean, std = normalization_stats(np.asarray(run.task.train.x))
    return Progress(0, 0, mean.tolist(), std.tolist()), (mean, std)


def sync_lr(engine: Any) -> list[Finding]:
    """DeepSpeed's scheduler load sets last_batch_iteration but not the optimizer's lr
    (FACTS.md): make the optimizer run at the scheduler's LR for the restored iteration."""
    sched = engine.lr_scheduler
    if sched is None:
        return []
    want = sched.get_lr()
    groups = engine.optimizer.param_groups
    have = [g["lr"] for g in groups]
    if all(math.isclose(h, w, rel_tol=1e-9, abs_tol=1e-15) for h, w in zip(have, want)):
        return [Finding("lr-sync", "ok", f"optimizer lr {have[0]:.3g} matches the scheduler")]
    for g, w in zip(groups, want):
        g["lr"] = w
    return [
        Finding(
            "lr-sync",
            "warn",
            f"DeepSpeed left the optimizer lr at {have[0]:.3g}; set it to the scheduler's"
            f" {want[0]:.3g} at iteration {sched.last_batch_iteration}",
        )
    ]


def restore_module_extras(engine: Any, source: Path) -> list[Finding]:
    """Under a universal load DeepSpeed restores trained weights only: frozen parameters and
    buffers keep their fresh values (FACTS.md). Copy them from the source checkpoint's module
    states (``mp_rank_00_model_states.pt``, or rank 0's file under ZeRO-3)."""
    from wonderland_ds.checkpoint.describe import safe_load

    files = sorted(source.glob("mp_rank_00_model_states.pt")) or sorted(
        source.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    states, why = safe_load(files[0]) if files else (None, "no model states file")
    if not isinstance(states, dict) or not isinstance(states.get("module"), dict):
        return [
            Finding(
                "restore-extras",
                "error",
                f"cannot read module states: {why}",
                "resume from a complete checkpoint",
                str(source),
            )
        ]
    saved = states["module"]
    module = engine.module
    names = [n for n, p in module.named_parameters() if not p.requires_grad]
    names += [n for n, _ in module.named_buffers()]
    restored, skipped = 0, []
    with torch.no_grad():
        own = dict(module.named_parameters()) | dict(module.named_buffers())
        for n in names:
            if n in saved and saved[n].numel() == own[n].numel() and saved[n].numel() > 0:
                own[n].copy_(saved[n].to(own[n].dtype).view_as(own[n]))
                restored += 1
            else:
                skipped.append(n)
    out = [
        Finding(
            "restore-extras",
            "ok",
            f"restored {restored} frozen parameter(s)/buffer(s) DeepSpeed's universal load skips",
        )
    ]
    if skipped:
        # ZeRO-3 partitions frozen parameters too (frozen_param_fragments, one slice per rank):
        # they keep the model's initial values. Say so rather than pretend.
        out.append(
            Finding(
                "restore-extras",
                "warn",
                f"not restored (partitioned under ZeRO-3 or absent): {skipped[:5]}",
                "make frozen parameters deterministic at init, or use ZeRO-1/2",
                str(source),
            )
        )
    return out


def write_metrics(run: StageRun, rows: list[dict[str, Any]], keep_upto: int | None) -> None:
    """Append step rows to metrics.csv; on resume drop rows past the restored step first."""
    path = run.stage_dir / "metrics.csv"
    cols = [
        "step",
        "loss",
        "lr",
        "grad_norm",
        "samples",
        "sample_digest",
        "step_s",
        "data_wait_s",
        "wall",
    ]
    old: list[dict[str, str]] = []
    if keep_upto is not None and path.exists():
        with open(path, newline="") as fh:
            old = [r for r in csv.DictReader(fh) if int(r["step"]) <= keep_upto]
    mode = "w" if keep_upto is not None or not path.exists() else "a"
    with open(path, mode, newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=cols)
        if mode == "w":
            w.writeheader()
            w.writerows(old)
        w.writerows(rows)


def start_check(run: StageRun, guards: StepGuards, verify: bool) -> None:
    """All-reduce verification and per-rank transfer timings before the first step."""
    g = run.settings.guards
    if not (g.enabled and verify):
        return
    missing = dist.monitored_barrier(min(run.settings.process_group_timeout_s, 120))
    if missing:
        raise GuardStop(
            [
                Finding(
                    "allreduce-check",
                    "error",
                    missing,
                    "check that host's network and process, then resume",
                )
            ]
        )
    report, events = health.verify_allreduce(DTYPES[run.cfg.precision], run.fault, guards.hosts, g)
    if dist.is_main():
        dump_json(run.stage_dir / "allreduce_check.json", report)
        print(
            "[wonderland] all-reduce verification at stage start:\n" + health.report_table(report),
            flush=True,
        )
    guards.record(events)
    guards.probe_hint_s = float(report["probe_s"])
    stop = [e for e in events if e.policy == "stop"]
    if stop:
        raise GuardStop(
            [
                Finding(
                    e.guard,
                    "error",
                    f"rank {e.rank} ({e.host}): {e.message}",
                    "check that host's network/GPU, exclude it from the hostfile,"
                    " then resume with --resume auto",
                )
                for e in stop
            ]
        )


def _stop(run: StageRun, engine: Any, guards: StepGuards, events: list[Event]) -> GuardStop:
    if dist.is_main():
        report = {
            "stopped_at_step": guards.step,
            # The last step trained: later than stopped_at_step when the check that judged it
            # came later (check_interval) or overlapped the next step (overlap_check).
            "trained_to_step": int(engine.global_steps),
            "events": [e.to_dict() for e in guards.events],
        }
        dump_json(run.stage_dir / "guard_report.json", report)
    return GuardStop(
        [
            Finding(
                e.guard,
                "error",
                f"step {e.step}"
                + (f" rank {e.rank} ({e.host})" if e.rank is not None else "")
                + f": {e.message}",
                "the newest complete checkpoint is untouched: fix the cause and"
                " resume with --resume auto",
            )
            for e in events
            if e.policy != "warn"
        ]
    )


@dataclass
class _Pending:
    """One trained step waiting for the next check: this rank's row and what the log and the
    judge need, as it was right after the step."""

    step: int
    vec: list[float]
    losses: list[torch.Tensor]  # the micro-batch losses, where they were computed
    sq: torch.Tensor | None  # this rank's squared gradient norm (guard hooks), likewise
    lr: float
    grad_norm: Any  # DeepSpeed's global norm: a float, a device tensor or None
    skipped: int
    scale: float | None
    samples: int
    step_s: float
    wait_s: float
    wall: float


def _check_matrix(pending: list[_Pending], rank: int) -> tuple[torch.Tensor, list[float | None]]:
    """The rows of the steps since the last check, each with its loss sum and this rank's
    gradient norm filled in, and DeepSpeed's global gradient norm of each step as a float. A
    handful of tensor operations and host transfers per check, whatever its length: nothing
    of this synchronizes per step or per micro-batch."""
    mat = torch.tensor([p.vec for p in pending], dtype=torch.float64)
    losses = torch.stack([x for p in pending for x in p.losses]).double()
    mat[:, 0] = losses.view(len(pending), -1).sum(1).cpu()
    have = [(i, p.sq) for i, p in enumerate(pending) if p.sq is not None]
    if have:
        sq = torch.stack([t for _, t in have]).to("cpu", torch.float64)
        mat[[i for i, _ in have], 2 + rank] = sq.sqrt()
    tensors = [
        (i, p.grad_norm) for i, p in enumerate(pending) if isinstance(p.grad_norm, torch.Tensor)
    ]
    read = (
        dict(zip([i for i, _ in tensors], torch.stack([t.float() for _, t in tensors]).tolist()))
        if tensors
        else {}
    )
    norms = [read.get(i, p.grad_norm) for i, p in enumerate(pending)]
    return mat, [None if g is None else float(g) for g in norms]


@dataclass
class _Check:
    """One check under way: its steps, their matrix (summed in place by the all-reduce), the
    all-reduce's handle and the seconds the loop spent starting it."""

    pending: list[_Pending]
    mat: torch.Tensor
    grad_norms: list[float | None]
    work: Any
    held_s: float


class _Checks:
    """The guards' checks of one ``fit``: each starts one all-reduce of the rows of the steps
    since the last check, and is settled (waited for, then every step judged in order) either
    at once or after the next step trained (``guards.overlap_check``). Settled steps become
    metrics rows, the progress line and the metrics sink's events.

    Why overlap: the all-reduce itself is a few hundred bytes, but a blocking gloo collective
    on a busy host costs a hand-off to gloo's thread and a wake-up on every rank (720 bytes
    between two ranks on this project's 2-core machine: 0.3-1.8 ms median, 1.2-1.9 ms mean,
    bench/bench_check_allreduce.py; 1.0-1.8 ms a check inside the digits loop). Started before
    the next step and waited for after it, most of that latency hides behind the step
    (0.004-0.03 ms left inside the loop; BENCHMARKS.md section 2)."""

    def __init__(
        self,
        run: StageRun,
        guards: StepGuards,
        module: torch.nn.Module,
        gas: int,
        display: ProgressDisplay | None,
        sink: MetricsSink | None,
    ) -> None:
        self.run, self.guards, self.module = run, guards, module
        self.rank, self.world, self.gas = dist.rank(), dist.world_size(), gas
        self.display, self.sink = display, sink
        self.rows: list[dict[str, Any]] = []
        self.last_loss: float | None = None
        self.step_total = self.wait_total = 0.0

    def start(self, pending: list[_Pending]) -> _Check:
        t0 = time.perf_counter()
        mat, grad_norms = _check_matrix(pending, self.rank)
        work = dist.all_reduce_sum_start(mat)
        return _Check(pending, mat, grad_norms, work, time.perf_counter() - t0)

    def settle(self, check: _Check) -> tuple[str, list[Event], bool]:
        """Wait for the check's all-reduce and judge its steps in order, up to the first that
        stops or rolls back. Returns (verdict, that step's events, whether every rank's
        checkpoint writer was idle at the check's last step)."""
        t0 = time.perf_counter()
        check.work.wait()
        summed = check.mat.tolist()
        guards, world, last = self.guards, self.world, len(check.pending) - 1
        verdict, events = "ok", []  # "warn" is logged and training goes on
        for i, (p, v, gn) in enumerate(zip(check.pending, summed, check.grad_norms)):
            guards.step = p.step
            self.last_loss = float(v[0]) / (self.gas * world)
            events = guards.judge(v, self.last_loss, p.lr, self.module, p.skipped, p.scale)
            verdict = guards.decision(events)
            if verdict in ("stop", "rollback"):
                break
            # The check's own time is charged to its last step, whenever it was paid.
            step_s = p.step_s + (check.held_s + time.perf_counter() - t0 if i == last else 0)
            self.step_total += step_s
            self.wait_total += p.wait_s
            self.rows.append(
                {
                    "step": p.step,
                    "loss": f"{self.last_loss:.8g}",
                    "lr": f"{p.lr:.8g}",
                    "grad_norm": "" if gn is None else f"{gn:.6g}",
                    "samples": p.samples,
                    "sample_digest": int(v[1]),
                    "step_s": f"{step_s:.5f}",
                    "data_wait_s": f"{p.wait_s:.6f}",
                    "wall": f"{p.wall:.6f}",
                }
            )
            if self.display is not None and self.sink is not None:
                self.display.step(self.rows[-1], loss_scale=p.scale)
                window = guards.watchdog.losses[-self.run.settings.guards.spike_window :]
                self.sink.write(
                    self.rows[-1],
                    loss_scale=p.scale,
                    extra=guard_figures(
                        [float(x) for x in v[2 : 2 + world]],
                        loss_median=statistics.median(window) if window else None,
                        skipped_steps=p.skipped,
                        events=len(guards.events),
                    ),
                )
        return verdict, events, summed[-1][-1] == 0.0

    def take_rows(self) -> list[dict[str, Any]]:
        """The settled rows not yet written to metrics.csv (and forget them)."""
        rows, self.rows = self.rows, []
        return rows


#: The GIL switch interval while a stage trains (Python's default: 5 ms). See short_gil_waits.
SWITCH_INTERVAL_S = 0.0005


@contextlib.contextmanager
def short_gil_waits(interval_s: float | None = None) -> Iterator[None]:
    """Python's GIL switch interval at most ``interval_s`` (default ``SWITCH_INTERVAL_S``)
    inside the block, then as it was.

    Why: the step loop shares its process with threads that hold the GIL in bursts (rank 0's
    metrics writer and TensorBoard's, the checkpoint writer serializing a save). When the
    loop returns from a call that released the GIL (a collective, the backward) while such a
    thread holds it, it waits up to the switch interval for it; on a short step every rank
    then waits for rank 0 at the next collective. Measured on digits ZeRO-1 (2 ranks, 2 cores,
    30 repetitions side by side): 0.956 of the step time under the default 5 ms by paired
    median (BENCHMARKS.md section 2). A smaller interval the caller set is kept."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_INTERVAL_S if interval_s is None else interval_s))
    try:
        yield
    finally:
        sys.setswitchinterval(before)


@contextlib.contextmanager
def nicer_thread(increment: int) -> Iterator[str | None]:
    """The calling thread's nice value raised by ``increment`` (at most 19) inside the block,
    then as it was where the system lets it back; yields None, or why nothing changed.

    Why (``wonderland.loop_nice``): the step loop is one thread per rank doing compute, and a
    collective completes on other threads (gloo's work and TCP threads, NCCL's proxy thread,
    the rendezvous store). When such a thread wakes while the loop computes on its core,
    Linux lets it run only once the loop's slice is used up, and every rank waits at the next
    collective for it. A nicer loop thread lets them in sooner (and gloo's threads get a
    shorter slice too: comm_threads.short_gloo_slices). Measured on digits ZeRO-1 (2 ranks, 2 cores, 20-30 repetitions side
    by side, three runs): the stage 1.04-1.10 of a plain DeepSpeed loop by median at nice 0,
    1.03-1.06 at +10; the plain loop itself 0.95-0.99 at +10; gloo's work threads waited
    2.2-2.5 ms a step in the run queue at nice 0, 1.6-1.8 ms at +10 (BENCHMARKS.md section 2).

    Only this thread changes: Linux keeps a nice value per thread (setpriority(2) with a
    thread id), and threads it starts inside the block inherit it (the metrics and checkpoint
    writers: background work). Raising a nice value needs no privilege; lowering it back needs
    CAP_SYS_NICE or a RLIMIT_NICE allowance, without which the thread stays nicer (only the
    order among the process's own threads and other busy processes changes)."""
    if increment <= 0:
        yield None
        return
    if not sys.platform.startswith("linux"):
        yield "per-thread nice values are Linux only"
        return
    tid = threading.get_native_id()
    try:
        before = os.getpriority(os.PRIO_PROCESS, tid)
        os.setpriority(os.PRIO_PROCESS, tid, min(19, before + increment))
    except OSError as exc:
        yield f"setpriority refused: {exc}"
        return
    try:
        yield None
    finally:
        try:
            os.setpriority(os.PRIO_PROCESS, tid, before)
        except OSError:
            pass  # no CAP_SYS_NICE / RLIMIT_NICE: the thread stays nicer (see above)


def fit(
    run: StageRun, engine: Any, prog: Progress, log: Any, verify: bool = False
) -> dict[str, Any]:
    """Train until the stage's step budget under the guards; save every ``save_interval``
    and at the end."""
    with (
        short_gil_waits(),
        nicer_thread(run.settings.loop_nice) as why_not,
        short_gloo_slices(run.settings.gloo_slice_us) as why_not_gloo,
    ):
        if why_not is not None and dist.is_main():
            print(
                f"[wonderland] loop_nice {run.settings.loop_nice} not applied ({why_not}):"
                " the step loop runs at its usual priority",
                file=sys.stderr,
                flush=True,
            )
        if why_not_gloo is not None and dist.is_main():
            print(
                f"[wonderland] gloo_slice_us {run.settings.gloo_slice_us} not applied"
                f" ({why_not_gloo}): gloo's threads keep their time slice",
                file=sys.stderr,
                flush=True,
            )
        return _fit(run, engine, prog, log, verify)


def _peak_rss_mb() -> float | None:
    """This process's peak resident memory (Linux VmHWM), in MB; None elsewhere."""
    try:
        with open("/proc/self/status") as fh:
            for line in fh:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return None


def _fit(
    run: StageRun, engine: Any, prog: Progress, log: Any, verify: bool = False
) -> dict[str, Any]:
    rank, world = dist.rank(), dist.world_size()
    mb = int(engine.train_micro_batch_size_per_gpu())
    gas = int(engine.gradient_accumulation_steps())
    batch = mb * gas * world
    train = run.task.train
    assert train is not None
    end = prog.stage_start_step + run.steps
    first = int(engine.global_steps)
    fp16 = run.cfg.fp16
    guards = StepGuards(
        run.settings.guards,
        run.fault,
        run.stage_dir,
        int(engine.zero_optimization_stage()),
        fp16.enabled,
        float(fp16.min_loss_scale),
    )
    guards.skipped = int(engine.skipped_steps)  # DeepSpeed restores its count on a resume
    guards.start(first)
    start_check(run, guards, verify)
    guards.attach(engine.module)
    writer = async_ckpt.install(engine, copy_held=run.settings.async_save_copy)
    blocked: list[float] = []

    def loader_from(step: int) -> Prefetcher:
        xy = (train.x, train.y) if isinstance(train, Split) else (train, None)
        return Prefetcher(
            xy[0],
            xy[1],
            GlobalSampler(len(train), run.seed),
            prog.samples_consumed,
            mb,
            gas,
            world,
            rank,
            end - step,
            x_dtype=DTYPES[run.cfg.precision],
        )

    loader = loader_from(first)
    if dist.is_main():
        write_metrics(run, [], keep_upto=first)
        manifest.update_stage(run.run_dir, run.stage, end_step=end)
    display, sink = None, None
    if log is not None:  # a real stage (benchmarks call fit without a log)
        tokens = train.tokens_per_sample if run.task.kind == "lm" else None
        display = ProgressDisplay(
            run.stage, end, first, batch, tokens_per_sample=tokens, every=run.settings.log_interval
        )
        sink = MetricsSink(
            run.ds_dict,
            run.stage_dir,
            engine=engine,
            keep_upto=first,
            samples_per_step=batch,
            tokens_per_sample=tokens,
        )
    on_host = torch.device(engine.device).type == "cpu"  # batches are read into host memory
    checks = _Checks(run, guards, engine.module, gas, display, sink)
    pending: list[_Pending] = []  # steps trained since the last check
    overlapped: _Check | None = None  # a check whose all-reduce runs during this step
    # The stage is set up: the collector, off while this rank started (train.py), is back on
    # after one collection of what the start left (startup.py).
    startup.release()
    t_start = time.perf_counter()
    try:
        while int(engine.global_steps) < end:
            step = int(engine.global_steps)
            guards.begin(step)
            t0, wait0 = time.perf_counter(), loader.wait_s
            losses: list[torch.Tensor] = []
            digest = 0.0
            for m in range(gas):
                mbatch = loader.next()
                _seed_micro(_micro_seed(run.seed, mbatch.position), engine.device)
                x, y = mbatch.x, mbatch.y
                if not on_host:
                    x, y = x.to(engine.device), y.to(engine.device)
                loss = run.task.batch_loss(engine, x, y)
                loss = faults.corrupt_loss(run.fault, loss, step + 1, rank)
                guards.micro(m == gas - 1)
                engine.backward(loss)
                if m == gas - 1 and blocked:
                    # The optimizer update changes what the last save's writer may still be
                    # serializing from the live tensors: wait for it (async_ckpt.py). The wait
                    # is part of that save's blocked time.
                    blocked[-1] += _fence(run, writer)
                engine.step()
                # Kept where it lives: read on the host once per check (below), not once per
                # micro-batch or step.
                losses.append(loss.detach())
                digest += mbatch.digest
            faults.perturb(run.fault, engine.module, step + 1, rank)
            prog.samples_consumed += batch
            # [loss sum, sample digest, per-rank grad norms, per-rank fingerprints, ...]: one
            # small all-reduce per check carries every number the guards and the log need.
            vec, sq = guards.vector(engine.module, extra=1)
            vec[1] = digest
            vec[-1] = float(writer.busy)  # summed: 0 when every rank's writer is idle
            done = int(engine.global_steps)
            if run.heartbeat is not None:
                run.heartbeat.step = done
            run.fault.step_done(step + 1)
            scale = loss_scale(engine) if run.cfg.fp16.enabled else None
            pending.append(
                _Pending(
                    done,
                    vec,
                    losses,
                    sq,
                    float(engine.get_lr()[0]),
                    engine.get_global_grad_norm(),
                    int(engine.skipped_steps),
                    scale,
                    prog.samples_consumed,
                    time.perf_counter() - t0,
                    loader.wait_s - wait0,
                    time.time(),
                )
            )
            faults.maybe(run.fault, "step", done, rank)
            save_due = done % run.settings.save_interval == 0 or done >= end
            check_due = save_due or done % run.settings.guards.check_interval == 0
            if overlapped is None and not check_due:
                continue
            verdict, settled = "ok", False
            events: list[Event] = []
            if overlapped is not None:
                # The last check's all-reduce ran while this step trained: its verdict now,
                # before anything of this step is judged, saved or checked.
                verdict, events, settled = checks.settle(overlapped)
                overlapped = None
            if check_due and verdict not in ("stop", "rollback"):
                # One all-reduce for the steps since the last check, then each is judged in
                # order. A save always waits for its check: no checkpoint holds an unjudged
                # step.
                check = checks.start(pending)
                pending = []
                if run.settings.guards.overlap_check and not save_due:
                    overlapped = check
                    continue
                verdict, events, settled = checks.settle(check)
            if verdict == "stop":
                if dist.is_main():
                    write_metrics(run, checks.take_rows(), keep_upto=None)
                if display is not None:
                    display.close("stopped")
                raise _stop(run, engine, guards, events)
            if verdict == "rollback":
                # The steps after the offending one (up to this check, and the step the
                # check overlapped) are not judged: they are rolled back with it, and their
                # batches skipped with its.
                rows = checks.take_rows()
                if dist.is_main():
                    write_metrics(run, rows, keep_upto=None)
                pending = []
                loader.close()
                finish_pending(run, writer)
                back = rollback(run, engine, prog, guards, log)
                guards.skipped = int(engine.skipped_steps)  # restored with the checkpoint
                if display is not None and sink is not None:
                    display.rewind(back)
                    sink.rewind(back)
                loader = loader_from(back)
                continue
            if save_due:
                rows = checks.take_rows()
                if dist.is_main():
                    write_metrics(run, rows, keep_upto=None)
                tag_dir, held = save(run, engine, prog, checks.last_loss, writer, settled)
                blocked.append(held)
                if display is not None and sink is not None:
                    display.checkpoint(tag_dir, held, background=True)
                    sink.flush()
        finish_pending(run, writer)  # the stage's last checkpoint is complete before "ok"
        if display is not None and blocked:
            display.note(
                f"checkpoint {ck.tag_for(int(engine.global_steps))} complete (sha256"
                " verified, metadata written last)"
            )
    except BaseException:
        if display is not None:
            # Not "done": a collective timed out, a rank died, or the user interrupted.
            display.close(f"failed at step {int(engine.global_steps)} of {end}")
        raise
    finally:
        loader.close()
        guards.close()
        writer.close()
        if display is not None and sink is not None:
            display.close()
            sink.close()
    rows = checks.take_rows()
    if rows and dist.is_main():
        write_metrics(run, rows, keep_upto=None)
    elapsed = time.perf_counter() - t_start
    peak_rss = dist.gather_all(_peak_rss_mb())  # host memory per rank, for the record
    return {
        "steps": int(engine.global_steps) - first,
        "peak_rss_mb": peak_rss,
        "final_loss": checks.last_loss,
        "global_step": int(engine.global_steps),
        "seconds": round(elapsed, 3),
        "data_stall_fraction": round(checks.wait_total / max(checks.step_total, 1e-9), 6),
        "guard_events": guards.summary(),
        "save_blocked_s": [round(b, 4) for b in blocked],
        "rollbacks": guards.rollbacks,
        "checkpoint": str(run.ckpt_root / ck.tag_for(int(engine.global_steps))),
    }


def rollback(run: StageRun, engine: Any, prog: Progress, guards: StepGuards, log: Any) -> int:
    """PaLM-style: reload this stage's newest complete checkpoint and skip the batches between
    it and the offending step (the sample position is not rewound). Bounded by max_rollbacks."""
    newest = ck.newest_complete(run.ckpt_root)
    if newest is None or newest.meta is None:
        raise _stop(
            run,
            engine,
            guards,
            [
                Event(
                    "rollback",
                    guards.step,
                    "stop",
                    "no complete checkpoint of this stage to roll back to",
                )
            ],
        )
    path, _ = engine.load_checkpoint(
        str(run.ckpt_root),
        tag=newest.tag_dir.name,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if path is None:
        raise _stop(
            run,
            engine,
            guards,
            [Event("rollback", guards.step, "stop", f"DeepSpeed did not load {newest.tag_dir}")],
        )
    sync_lr(engine)
    back = int(engine.global_steps)
    skipped_from = int(newest.meta["data"]["samples_consumed"])
    guards.rollbacks += 1
    guards.watchdog.forget_after(back)
    if dist.is_main():
        write_metrics(run, [], keep_upto=back)
    guards.record(
        [
            Event(
                "rollback",
                guards.step,
                "warn",
                f"rolled back to {newest.tag_dir.name}; skipping samples"
                f" [{skipped_from}, {prog.samples_consumed}) (rollback"
                f" {guards.rollbacks}/{run.settings.guards.max_rollbacks})",
            )
        ]
    )
    return back


def read_losses(stage_dir: Path) -> dict[int, float]:
    with open(stage_dir / "metrics.csv", newline="") as fh:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh)}


def dump_json(path: Path, obj: Any) -> None:
    ck.atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True, default=str))
