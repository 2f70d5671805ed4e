"""Verified, crash-safe checkpoint saves that block training only for a snapshot.

The order of writes is :mod:`wonderland_ds.checkpoint.contract`'s; the background writer is
:mod:`wonderland_ds.checkpoint.async_save`'s. :class:`Saver` is the trainer's callback: it
installs the writer, makes each optimizer update wait for the previous save's snapshot (the
fence), and waits for the last save before the stage ends.
"""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import async_save as async_ckpt
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint import markers, snapshot_engine
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.files import disk_error, free_bytes, tree_bytes
from wonderland_ds.core.findings import Finding, GuardStop, Stopped
from wonderland_ds.core.signals import StopRequest
from wonderland_ds.data.sampler import LoaderState
from wonderland_ds.run import manifest
from wonderland_ds.training import faults
from wonderland_ds.training.callbacks import Callback
from wonderland_ds.training.state import Progress, StageRun, loader_state, loss_scale


class Saver(Callback):
    """This rank's checkpoint writer for one stage's training, and the saves' blocked times."""

    def __init__(self, run: StageRun, engine: Any) -> None:
        self.run, self.engine = run, engine
        self.timeout = float(run.settings.process_group_timeout_s)
        self.writer: async_ckpt.Writer | None = None
        self.blocked: list[float] = []  # seconds each save blocked training
        self.save_s: float | None = None  # rank 0: the last complete save, start to `latest`

    @property
    def busy(self) -> bool:
        """This rank's writer still has a save's work queued or under way."""
        assert self.writer is not None
        return bool(self.writer.busy)

    def on_start(self) -> None:
        self.writer = snapshot_engine.install(
            self.engine, copy_held=self.run.settings.async_save_copy
        )

    def pre_update(self) -> None:
        # The optimizer update changes what the last save's writer may still be serializing
        # from the live tensors: wait for it. The wait is part of that save's blocked time.
        if self.blocked:
            self.blocked[-1] += self.fence()

    def on_train_end(self) -> None:
        self.finish_pending()  # the stage's last checkpoint is complete before "ok"

    def on_close(self) -> None:
        if self.writer is not None:
            self.writer.close()

    def save(self, prog: Progress, loss: float | None, settled: bool = False) -> tuple[Path, float]:
        """A verified, crash-safe save of the current step. ``settled``: every rank's writer
        was idle without an error at the last step's all-reduce, so there is nothing to wait
        for or agree on. Returns (tag dir, seconds the loop was blocked), kept in ``blocked``."""
        run, engine, writer = self.run, self.engine, self.writer
        assert writer is not None
        t0 = time.perf_counter()
        if not settled:
            self.finish_pending()  # back-pressure: the previous save completes first
        self.check_space()
        writer.pool.start()  # its buffers (all written now) are this save's to reuse
        step = int(engine.global_steps)
        tag = ck.tag_for(step)
        tag_dir = run.ckpt_root / tag
        if dist.is_main():
            run.ckpt_root.mkdir(parents=True, exist_ok=True)
            if tag_dir.exists() and ck.read_meta(tag_dir) is None:
                shutil.rmtree(tag_dir)  # a save of this step that never completed: start over
        # No barrier of our own: save_checkpoint's first collective is a barrier (after rank
        # 0's makedirs), before any rank creates a file, so no rank writes into the tag folder
        # before rank 0 has cleared it.
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
        rank = dist.rank()
        writer.on_error = lambda: markers.mark_failed(tag_dir, rank)  # rank 0 stops waiting
        engine.save_checkpoint(str(run.ckpt_root), tag=tag, client_state=client, save_latest=False)
        writer.pool.trim()
        # Each rank's RNG states ride its own marker (no collective on the loop's time).
        rng = markers.rng_states()
        writer.submit(lambda: markers.mark_done(tag_dir, rank, rng))
        if dist.is_main():
            meta = _meta(run, engine, prog, loss, state)
            timeout = self.timeout

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
                self.save_s = time.perf_counter() - t0

            writer.submit(finalize)
        if not run.settings.async_save:
            self.finish_pending()
        held = time.perf_counter() - t0
        self.blocked.append(held)
        return tag_dir, held

    def check_space(self) -> None:
        """Every rank: would the next save fit in its checkpoint folder's filesystem? One
        gather at each save; a save that does not fit stops every rank (``disk_space_check``)."""
        policy = self.run.settings.disk_space_check
        if policy == "off":
            return
        root = self.run.ckpt_root
        newest = ck.newest_complete(root, deep=False)
        need = tree_bytes(newest.tag_dir) if newest is not None else self.state_bytes()
        free = free_bytes(root)
        short = dist.gather_all((free, need) if free < 2 * need else None)
        lacking = [(r, s) for r, s in enumerate(short) if s is not None]
        if not lacking:
            return
        worst_free, worst_need = min((s for _, s in lacking), key=lambda fs: fs[0] - fs[1])
        where = (
            f"{root}: {worst_free / 1e6:.1f} MB free, a checkpoint takes {worst_need / 1e6:.1f} MB"
        )
        if policy == "stop" and worst_free < worst_need:
            why = f"the disk is full at {where}; the save would not fit"
            raise Stopped(
                StopRequest("disk-full", None, time.time(), why),
                step=int(self.engine.global_steps),
                checkpoint=str(newest.tag_dir) if newest is not None else None,
                agreed=True,
            )
        if dist.is_main():
            print(
                f"[wonderland] WARNING: the checkpoint disk is nearly full at {where}"
                + (
                    ": this save may not fit" if worst_free < worst_need else ": one more save fits"
                ),
                flush=True,
            )

    def state_bytes(self) -> int:
        """About what a save writes before the stage has made one: fp32 weights and two
        Adam moments of every parameter, plus the module's own weights."""
        module = self.engine.module
        numel = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in module.parameters())
        return numel * 16

    def fence(self) -> float:
        """The optimizer-update fence, with finish_pending's time limit. A rank whose writer is
        stuck stops with the checkpoint-write finding; the other ranks then fail at their next
        collective (the process-group timeout names this rank)."""
        assert self.writer is not None
        try:
            return self.writer.fence(timeout=self.timeout * 2)
        except TimeoutError as exc:
            raise GuardStop(
                [
                    Finding(
                        "checkpoint-write",
                        "error",
                        f"rank {dist.rank()}: {exc}",
                        "check the checkpoint storage (hung mount, full or very slow disk), then"
                        " resume with --resume auto (the newest complete checkpoint is intact)",
                        str(self.run.ckpt_root),
                    )
                ]
            ) from None

    def finish_pending(self) -> None:
        """Wait for this rank's queued checkpoint writes (and on rank 0 the metadata), then
        agree with every rank. A failed write on any rank stops every rank (exit 3): the
        half-written checkpoint is removed and the previous complete one stays the newest."""
        assert self.writer is not None
        root = self.run.ckpt_root
        error: tuple[str, bool, bool] | None = None
        try:
            self.writer.wait(timeout=self.timeout * 2)
        except (OSError, TimeoutError, RuntimeError) as exc:
            # torch's zip writer hides the errno: the writer re-raises its failure as an
            # OSError without one, caused by torch's error (checkpoint/async_save.py).
            wrapped = isinstance(exc, OSError) and exc.errno is None and exc.__cause__ is not None
            storage = disk_error(exc) or wrapped
            waited = isinstance(exc, markers.MarkersMissing)  # another rank's failure, or slow
            error = (f"rank {dist.rank()}: {type(exc).__name__}: {exc}", storage, waited)
        got = [e for e in dist.gather_all(error) if e]
        if not got:
            return
        # The cause first: rank 0's wait for the others' markers only echoes their failure.
        got = [e for e in got if not e[2]] + [e for e in got if e[2]]
        newest = ck.newest_complete(root, deep=False)
        if dist.is_main():
            for _step, path in ck.tags(root):
                if ck.read_meta(path) is None and (newest is None or path != newest.tag_dir):
                    shutil.rmtree(path, ignore_errors=True)
        errors = [text for text, _, _ in got]
        causes = [disk for _, disk, waited in got if not waited]
        if causes and all(causes):
            kept = f"{newest.tag_dir.name} is intact" if newest is not None else "none is complete"
            free = free_bytes(root)
            full = newest is None or free < tree_bytes(newest.tag_dir)
            what = (
                f"the disk is full at {root} ({free / 1e6:.1f} MB free)"
                if full
                else f"the checkpoint storage at {root} refused a write (a file-size limit,"
                " a quota or an I/O error)"
            )
            why = (
                f"{what}: writing a checkpoint failed ({errors[0][:200]}); the half-written one"
                f" was removed, the newest complete checkpoint {kept}"
            )
            raise Stopped(
                StopRequest("disk-full", None, time.time(), why),
                step=int(self.engine.global_steps),
                checkpoint=str(newest.tag_dir) if newest is not None else None,
                agreed=True,
            )
        raise GuardStop(
            [
                Finding(
                    "checkpoint-write",
                    "error",
                    f"writing a checkpoint failed on {e}",
                    "free disk space / fix the storage, then resume with --resume auto (the"
                    " newest complete checkpoint is intact; the partial one was removed)",
                    str(root),
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
