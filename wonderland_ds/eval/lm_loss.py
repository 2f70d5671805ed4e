"""Stage 17 for language models: loss and perplexity per held-out text source, gated on a
source's loss rise since stage 15, and the downstream tasks of ``wonderland.eval.tasks``
(``lm_eval.py``) on the same model, gated per task (``task_gate.py``)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, GuardStop
from wonderland_ds.data.tasks import Split, Task
from wonderland_ds.eval import lm_eval, task_gate
from wonderland_ds.eval.sweep import (
    baseline,
    heldout,
    record_gate_failure,
    run_holding,
)
from wonderland_ds.eval.weights import eval_model, passes
from wonderland_ds.model import construct
from wonderland_ds.run.inputs import StageInputs
from wonderland_ds.run.preflight import Plan

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions

LM_BLOCK_TOKENS = 4096
"""Language models: tokens per forward pass in stage 17 (a block is the unit dealt to ranks)."""


class _Rows:
    """Rows ``idx`` of a split as a dataset (one text source of an in-memory held-out set)."""

    def __init__(self, split: Split, idx: np.ndarray) -> None:
        self.split, self.idx = split, idx

    def __len__(self) -> int:
        return len(self.idx)

    def take(self, at: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        rows = self.idx[at]
        return np.asarray(self.split.x[rows]), np.asarray(self.split.y[rows])


def lm_sources(task: Task) -> dict[str, Any]:
    """Stage 17's held-out sets by source: the task's token files, or an in-memory held-out
    split cut by ``meta["heldout_sources"]``."""
    if task.heldout_sources:
        return dict(task.heldout_sources)
    split = heldout(task)
    assert isinstance(split, Split)
    names = np.asarray(task.meta.get("heldout_sources") or ["all"] * len(split))
    return {src: _Rows(split, np.flatnonzero(names == src)) for src in sorted(set(names.tolist()))}


def lm_source_losses(task: Task, model: torch.nn.Module, data: Any) -> tuple[float, int]:
    """(summed loss, targets) of one source: its blocks dealt round-robin to ranks, each
    block one batch whatever the world size, summed in block order (so 1, 2 or 3 ranks give
    the same numbers). The loss is the task's own, as in training."""
    rows = max(1, LM_BLOCK_TOKENS // max(1, data_tokens(data)))
    n = len(data)
    starts = list(range(dist.rank() * rows, n, dist.world_size() * rows))
    mine = []
    dev = next(model.parameters()).device
    with torch.no_grad():
        # As many forward passes on every rank (ZeRO-3's are collective): extras repeat
        # block 0 and are dropped.
        for i in range(passes(len(starts))):
            s = starts[i] if i < len(starts) else 0
            x, y = data.take(np.arange(s, min(s + rows, n)))
            tx, ty = torch.from_numpy(x).to(dev), torch.from_numpy(y).to(dev)
            count = task.targets(ty)
            loss = task.batch_loss(model, tx, ty)
            if i < len(starts):
                mine.append((s, float(loss.double()) * count if count else 0.0, count))
    blocks = sorted(b for part in dist.gather_all(mine) for b in part)
    if [b[0] for b in blocks] != list(range(0, n, rows)):  # a sharding bug: fail loudly
        raise RuntimeError("held-out blocks were not each evaluated exactly once")
    return float(sum(b[1] for b in blocks)), int(sum(b[2] for b in blocks))


def data_tokens(data: Any) -> int:
    if isinstance(data, _Rows):
        return data.split.tokens_per_sample
    return int(data.tokens_per_sample)


def lm_metrics(totals: dict[str, tuple[float, int]]) -> dict[str, Any]:
    """Loss, perplexity and tokens over all held-out text and per source."""
    import math

    def one(total: float, count: int) -> dict[str, Any]:
        loss = total / max(count, 1)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "tokens": count}

    per = [{"source": src, **one(*totals[src])} for src in totals]
    return {
        **one(sum(t for t, _ in totals.values()), sum(c for _, c in totals.values())),
        "per_source": per,
    }


def lm_gate(new: dict[str, Any], base: dict[str, Any], rise: float) -> list[Finding]:
    old = {row["source"]: row for row in base["per_source"]}
    out = [
        Finding(
            "gate-loss-rise",
            "error",
            f"source {row['source']}: loss {old[row['source']]['loss']:.3f} ->"
            f" {row['loss']:.3f} (+{row['loss'] / old[row['source']]['loss'] - 1:.0%} >"
            f" {rise:.0%})",
            "inspect stage 16's data and LR",
            "",
            row["source"],
        )
        for row in new["per_source"]
        if old[row["source"]]["loss"] > 0 and row["loss"] > old[row["source"]]["loss"] * (1 + rise)
    ]
    return out or [Finding("gate", "ok", "no text source's loss rose beyond the margin")]


def run_eval_lm(
    opts: StageOptions, run_dir: Path, inputs: StageInputs, plan: Plan
) -> dict[str, Any]:
    from wonderland_ds.eval import lm_report

    task, settings = inputs.task, inputs.settings
    spec = settings.eval
    assert plan.source is not None
    home = run_holding(plan.source) or run_dir
    base_dir = baseline(opts, home)
    sources = lm_sources(task)
    zero3 = construct.zero_stage(inputs.ds_dict) == 3
    result: dict[str, Any] = {}
    harness: dict[str, Any] = {}  # lm-eval's results, rank 0's (None on the others)
    lockstep: dict[str, Any] = {}
    seconds: dict[str, float] = {}
    for name, tag_dir in (("stage16", plan.source), ("stage15", base_dir)):
        with eval_model(task, tag_dir, inputs.ds_dict) as model:
            totals = {src: lm_source_losses(task, model, data) for src, data in sources.items()}
            if spec.tasks:
                assert task.hf_dir is not None  # the settings allow tasks for causal-lm only
                t0 = time.perf_counter()
                harness[name], counts = lm_eval.score(model, task.hf_dir, spec, zero3)
                seconds[name] = round(time.perf_counter() - t0, 3)
                if counts is not None:
                    lockstep[name] = dist.gather_all(counts)
        result[name] = lm_metrics(totals)
    verdict = lm_gate(result["stage16"], result["stage15"], spec.lm_loss_rise)
    rows: list[task_gate.TaskRow] = []
    if spec.tasks:
        if dist.is_main():
            rows = task_gate.judge(
                harness["stage16"], harness["stage15"], spec.task_drop, spec.task_alpha
            )
        rows = dist.broadcast(rows)
        verdict += task_gate.findings(rows, spec.task_drop, spec.task_alpha)
    failed = [f for f in verdict if f.severity == "error"]
    report: dict[str, Any] = {
        "checkpoint": str(plan.source),
        "baseline": str(base_dir),
        **result,
        "tasks": [r.model_dump() for r in rows],
        # ZeRO-3: each rank's own forward passes and the idle ones that paired its peers'.
        "lockstep": lockstep,
        "lm_eval_seconds": seconds,  # rank 0's wall time in lm-eval, per checkpoint
        "gate": {
            "verdict": "fail" if failed else "pass",
            "lm_loss_rise": spec.lm_loss_rise,
            "task_drop": spec.task_drop,
            "task_alpha": spec.task_alpha,
            "findings": [f.to_dict() for f in verdict],
        },
        "plots": [],
    }
    out = Path(opts.out) if opts.out else run_dir / "stage17"
    if dist.is_main():
        lm_report.write(out, report, harness, spec.log_samples)
        if failed:
            record_gate_failure(run_dir, opts.stage, out / "report.json", failed)
    dist.barrier()
    if failed:
        raise GuardStop(failed)
    return {
        "report": str(out / "report.json"),
        "gate": "pass",
        "loss": result["stage16"]["loss"],
        "perplexity": result["stage16"]["perplexity"],
    }
