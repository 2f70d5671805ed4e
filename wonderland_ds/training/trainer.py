"""The per-rank step loop of a training stage, with its callbacks.

:func:`fit` trains the stage's steps. :class:`Trainer` holds the loop;
everything around a step plugs in as a :class:`~wonderland_ds.training.callbacks.Callback`:
the guards and their checks (:mod:`.checks`), fault injection, the heartbeat, metrics.csv,
the progress display and metrics sink (:mod:`.callbacks`), and checkpoint saving
(:mod:`.saving`). The loop decides only when to check, save and roll back.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Refused, Stopped
from wonderland_ds.core.process import peak_rss_mb
from wonderland_ds.core.signals import StopRequest, StopSignals
from wonderland_ds.core.slurm import Allocation
from wonderland_ds.data.blend import Blend
from wonderland_ds.data.sampler import GlobalSampler, Prefetcher
from wonderland_ds.data.tasks import Split
from wonderland_ds.data.tokens import TokenData
from wonderland_ds.training import startup
from wonderland_ds.training.callbacks import (
    Callback,
    FaultInjection,
    Heartbeat,
    MetricsRows,
    ProgressReport,
    SourceTokens,
)
from wonderland_ds.training.checks import Checks
from wonderland_ds.training.rollback import guard_stop, rollback
from wonderland_ds.training.saving import Saver
from wonderland_ds.training.state import DTYPES, Progress, StageRun, source_epochs
from wonderland_ds.training.stopping import StopAgreement


def fit(
    run: StageRun, engine: Any, prog: Progress, log: Any, verify: bool = False
) -> dict[str, Any]:
    """Train until the stage's step budget under the guards; save every ``save_interval``
    and at the end. ``log``: None leaves out the progress display and metrics sink."""
    if run.task.document_eos is not None:  # check's probe, on the model as built to train
        from wonderland_ds.data.documents import refusal

        found = refusal(run.task, engine.module, "wonderland.data.document_masking")
        if found is not None:
            raise Refused(found)
        dist.log(
            f"document masking: {type(engine.module).__name__} keeps attention and positions"
            f" inside documents (EOS {run.task.document_eos})"
        )
    return Trainer(run, engine, prog, log is not None, verify).train()


def _micro_seed(seed: int, position: int) -> int:
    # Dropout noise is a function of the micro-batch's place in the sample stream, not of
    # history, rank or micro-step: a resumed run, or one on another world size with the same
    # micro batch, draws exactly the noise the original run drew for the same samples.
    return (seed * 1_000_003 + position) % (2**63)


def _seed_micro(seed: int, device: Any) -> None:
    # torch.manual_seed also seeds every lazily-initialised accelerator module, each capturing
    # a traceback when that module is not initialised (milliseconds a call on a CPU host).
    # Seed only the generators dropout draws from on this device.
    torch.default_generator.manual_seed(seed)
    if getattr(device, "type", str(device)) == "cuda":
        torch.cuda.manual_seed(seed)


def _state_bytes(module: torch.nn.Module, world: int) -> int:
    """About what one rank's save writes: its share of the fp32 weights and Adam's two
    moments, plus the module's weights on rank 0 (ZeRO-3 parameters count their full size)."""
    numel = sum(int(getattr(p, "ds_numel", 0) or p.numel()) for p in module.parameters())
    return int(numel * (12 / max(world, 1) + 4))


class Trainer:
    """One stage's training on this rank: ``run.steps`` optimizer steps from the engine's."""

    def __init__(
        self, run: StageRun, engine: Any, prog: Progress, report: bool, verify: bool = False
    ) -> None:
        self.run, self.engine, self.prog = run, engine, prog
        self.world = dist.world_size()
        self.mb = int(engine.train_micro_batch_size_per_gpu())
        self.gas = int(engine.gradient_accumulation_steps())
        self.batch = self.mb * self.gas * self.world
        self.first = int(engine.global_steps)
        self.end = prog.stage_start_step + run.steps
        self.on_host = torch.device(engine.device).type == "cpu"  # batches are in host memory
        self.checks = Checks(run, engine, verify)
        self.saver = Saver(run, engine)
        self.stopper = StopAgreement(
            run.signals or StopSignals(),
            run.settings.preemption,
            run.stage_dir,
            lambda: self.saver.save_s,
            _state_bytes(engine.module, self.world),
            Allocation.from_env(),
        )
        train = run.task.train
        if isinstance(train, TokenData):  # token files: each step's data checked a step ahead
            self.stopper.lookahead, self.stopper.describe = self._data_check, train.describe
            train.checked_ahead = True
        self.stopper.end = self.end
        self.callbacks: list[Callback] = [self.checks, self.saver, self.stopper]
        if run.heartbeat is not None:  # before the step's fault point: a killed rank's last
            self.callbacks.append(Heartbeat(run.heartbeat))  # heartbeat has its step
        self.callbacks.append(FaultInjection(run.fault, engine.module))
        if isinstance(train, TokenData) and train.sources:  # before the rows: it fills them
            blend = Blend(train.sources, run.seed)
            self.callbacks.append(SourceTokens(run, blend, self.batch, prog.stream_start))
        self.callbacks.append(MetricsRows(run, self.first, self.end))
        if report:  # a real stage (benchmarks train without the display and sink)
            train = run.task.train
            tokens = getattr(train, "tokens_per_sample", None) if run.task.kind == "lm" else None
            self.callbacks.append(
                ProgressReport(
                    run, engine, self.checks.guards, self.first, self.end, self.batch, tokens
                )
            )
        self.checks.listeners = self._hooks("on_judged")
        # Each event's overridden handlers, in the callbacks' order: no-ops are not called.
        self._on_start, self._pre_step = self._hooks("on_start"), self._hooks("pre_step")
        self._on_loss, self._pre_backward = self._hooks("on_loss"), self._hooks("pre_backward")
        self._pre_update, self._on_update = self._hooks("pre_update"), self._hooks("on_update")
        self._post_step = self._hooks("post_step")
        self.loader: Prefetcher | None = None
        self.loader_origin = self.first  # the global step the loader's first step follows

    def _hooks(self, event: str) -> list[Callable[..., Any]]:
        base = getattr(Callback, event)
        return [getattr(cb, event) for cb in self.callbacks if getattr(type(cb), event) is not base]

    def _fire(self, event: str, *args: Any) -> None:
        for hook in self._hooks(event):
            hook(*args)

    def train(self) -> dict[str, Any]:
        """Train to the stage's end step: after each step the checks due, then a stop, a
        rollback or a save as they decide. Returns the stage's figures for the record."""
        for hook in self._on_start:
            hook()
        # Training mode: from_pretrained returns a model in eval mode (no dropout, and
        # transformers' gradient checkpointing only recomputes in training mode).
        self.engine.train()
        self.loader = self._loader_from(self.first)
        # The stage is set up: the collector, off while this rank started (train.py), is back
        # on after one collection of what the start left (startup.py).
        startup.release()
        t_start = time.perf_counter()
        try:
            stop = self.stopper.at_start(self.first)
            if stop is not None:
                raise self._stopped(stop, saved=False)
            while int(self.engine.global_steps) < self.end:
                done = self._step(int(self.engine.global_steps))
                stop = self.stopper.agreed()  # a signal, the time limit, bad data: every rank
                full = stop is not None and stop.reason == "disk-full"  # no save would fit
                save_due = not full and (
                    stop is not None
                    or done % self.run.settings.save_interval == 0
                    or done >= self.end
                )
                verdict = self.checks.after_step(done, save_due or stop is not None)
                if verdict is None:
                    continue
                if verdict.kind == "stop":
                    self._fire("on_stop")
                    raise guard_stop(self.run, self.engine, self.checks.guards, verdict.events)
                if verdict.kind == "rollback":
                    self._rollback()
                elif save_due:
                    self._fire("pre_save")
                    tag_dir, held = self.saver.save(
                        self.prog, self.checks.last_loss, verdict.settled
                    )
                    self._fire("post_save", tag_dir, held)
                if stop is not None and (done < self.end or full):
                    raise self._stopped(stop, saved=save_due and verdict.kind != "rollback")
            self._fire("on_train_end")
        except BaseException as exc:
            self._fire("on_error", exc)
            raise
        finally:
            self.loader.close()
            self._fire("on_close")
        self._fire("on_end")
        return self._result(time.perf_counter() - t_start)

    def _step(self, step: int) -> int:
        """One optimizer step of ``gas`` micro-batches; returns the global step after it."""
        engine, loader, last = self.engine, self.loader, self.gas - 1
        assert loader is not None
        for hook in self._pre_step:
            hook(step)
        t0, wait0 = time.perf_counter(), loader.wait_s
        losses: list[torch.Tensor] = []
        aux: list[torch.Tensor] = []
        task = self.run.task
        digest = 0.0
        for m in range(self.gas):
            mbatch = loader.next()
            _seed_micro(_micro_seed(self.run.seed, mbatch.position), engine.device)
            x, y = mbatch.x, mbatch.y
            if not self.on_host:
                x, y = x.to(engine.device), y.to(engine.device)
            out = task.forward(engine, x, y)
            loss = task.loss(out, y)
            router = task.aux_loss(out)
            if router is not None:
                aux.append(router)
            for on_loss in self._on_loss:
                loss = on_loss(loss)
            for hook in self._pre_backward:
                hook(m == last)
            engine.backward(loss)
            if m == last:
                for hook in self._pre_update:
                    hook()
            engine.step()
            # Kept where it lives: read on the host once per check, not once per micro-batch.
            losses.append(loss.detach())
            digest += mbatch.digest
        for hook in self._on_update:
            hook()
        self.prog.samples_consumed += self.batch
        done = self.checks.record(
            losses,
            digest,
            self.saver.busy,
            self.prog.samples_consumed,
            t0,
            loader.wait_s - wait0,
            aux,
        )
        for hook in self._post_step:
            hook(done)
        return done

    def _stopped(self, stop: StopRequest, saved: bool) -> Stopped:
        """The stage stops at this step: its save (if it made one) complete and verified on
        every rank, the metrics rows written; the exception the rank's entry exits 4 on."""
        self.saver.finish_pending()
        step = int(self.engine.global_steps)
        newest = ck.newest_complete(self.run.ckpt_root, deep=False)
        where = str(newest.tag_dir) if newest is not None else None
        return Stopped(stop, step=step, checkpoint=where, saved=saved, agreed=True)

    def _rollback(self) -> None:
        """Reload the newest complete checkpoint and go on from it, on fresh batches."""
        assert self.loader is not None
        self._fire("pre_rollback")
        self.loader.close()
        self.saver.finish_pending()
        back = rollback(self.run, self.engine, self.prog, self.checks.guards)
        self._fire("post_rollback", back)
        self.loader = self._loader_from(back)

    def _data_check(self, step: int) -> tuple[Any, int] | None:
        """Global step ``step``'s samples on this rank, checked before the loop reads them."""
        rel = step - self.loader_origin - 1
        if self.loader is None or rel < 0 or step > self.end:
            return None
        train = self.run.task.train
        assert isinstance(train, TokenData)
        return train.check(self.loader.step_indices(rel))

    def _loader_from(self, step: int) -> Prefetcher:
        train = self.run.task.train
        assert train is not None
        self.loader_origin = step
        xy = (train.x, train.y) if isinstance(train, Split) else (train, None)
        return Prefetcher(
            xy[0],
            xy[1],
            train.sampler(self.run.seed)
            if isinstance(train, TokenData)
            else GlobalSampler(len(train), self.run.seed),
            self.prog.samples_consumed - self.prog.stream_start,  # the mix's own position
            self.mb,
            self.gas,
            self.world,
            dist.rank(),
            self.end - step,
            x_dtype=DTYPES[self.run.cfg.precision],
        )

    def _result(self, elapsed: float) -> dict[str, Any]:
        checks, step = self.checks, int(self.engine.global_steps)
        peak_rss = dist.gather_all(peak_rss_mb())  # host memory per rank, for the record
        return {
            "steps": step - self.first,
            "peak_rss_mb": peak_rss,
            "final_loss": checks.last_loss,
            "global_step": step,
            "seconds": round(elapsed, 3),
            "data_stall_fraction": round(checks.wait_total / max(checks.step_total, 1e-9), 6),
            "guard_events": checks.guards.summary(),
            "save_blocked_s": [round(b, 4) for b in self.saver.blocked],
            # Rank 0: the last complete save, start to `latest` (None elsewhere or unsaved).
            "last_save_s": None if self.saver.save_s is None else round(self.saver.save_s, 4),
            "rollbacks": checks.guards.rollbacks,
            "checkpoint": str(self.run.ckpt_root / ck.tag_for(step)),
            "data_mix": self.run.task.meta.get("mix"),
            "sources": source_epochs(self.run, self.prog),
        }
