"""A guard's stop (the report and the findings) and its rollback to the newest checkpoint."""

from __future__ import annotations

from typing import Any

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, GuardStop
from wonderland_ds.training.build import sync_lr
from wonderland_ds.training.guards import StepGuards
from wonderland_ds.training.health import Event
from wonderland_ds.training.state import Progress, StageRun, dump_json


def guard_stop(run: StageRun, engine: Any, guards: StepGuards, events: list[Event]) -> GuardStop:
    """The stop to raise for ``events`` (rank 0 writes guard_report.json first)."""
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


def rollback(run: StageRun, engine: Any, prog: Progress, guards: StepGuards) -> int:
    """PaLM-style: reload this stage's newest complete checkpoint and skip the batches between
    it and the offending step (the sample position is not rewound). Bounded by max_rollbacks.
    Returns the global step training goes on from."""
    newest = ck.newest_complete(run.ckpt_root)
    if newest is None or newest.meta is None:
        why = "no complete checkpoint of this stage to roll back to"
        raise guard_stop(run, engine, guards, [Event("rollback", guards.step, "stop", why)])
    path, _ = engine.load_checkpoint(
        str(run.ckpt_root),
        tag=newest.tag_dir.name,
        load_optimizer_states=True,
        load_lr_scheduler_states=True,
    )
    if path is None:
        why = f"DeepSpeed did not load {newest.tag_dir}"
        raise guard_stop(run, engine, guards, [Event("rollback", guards.step, "stop", why)])
    sync_lr(engine)
    back = int(engine.global_steps)
    assert newest.meta is not None and newest.meta.data is not None  # a complete checkpoint
    skipped_from = newest.meta.data.samples_consumed
    guards.rollbacks += 1
    guards.watchdog.forget_after(back)
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
    guards.skipped = int(engine.skipped_steps)  # restored with the checkpoint
    return back
