"""Stage 17's gate on downstream tasks: stage 16 against stage 15, paired on the same documents.

lm-eval's standard errors treat the two runs as unpaired samples, which overstates the noise of
a difference: both checkpoints answered the same documents. So each (task, metric) is judged
from lm-eval's per-document values of both runs:

* right/wrong metrics (every value 0 or 1, averaged: accuracy, exact match): McNemar's exact
  test on the documents the two checkpoints disagree on;
* any other metric: a paired bootstrap over documents, each resample aggregated with the
  metric's own lm-eval aggregation (perplexities, bits per byte, F1 ...).

Both give a one-sided p-value for "stage 16 is worse". The p-values of every task and metric
judged are Holm-corrected together, so the chance that noise alone fails a healthy run stays
below ``task_alpha`` however many tasks there are. A metric fails when it is significantly worse
*and* worse by more than ``task_drop`` (absolute for metrics between 0 and 1, relative to stage
15 otherwise). Leaf tasks are judged one by one, so a group whose average looks fine still
fails on the one subtask that collapsed, named with its group.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict

from wonderland_ds.core.findings import Finding

BOOTSTRAP = 10_000
"""Paired resamples for metrics with a vectorised aggregation (mean, perplexities)."""
BOOTSTRAP_SLOW = 1_000
"""...and for any other aggregation (called once per resample)."""
SEED = 20261205


class TaskRow(BaseModel):
    """One task's metric in stage 17's report: both values, the paired test and the verdict."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    task: str
    group: str | None
    metric: str
    filter: str
    stage15: float
    stage15_stderr: float | None
    stage16: float
    stage16_stderr: float | None
    higher_is_better: bool
    bounded: bool
    """Every per-document value lies in [0, 1] and they are averaged: the drop is absolute."""
    worse_by: float
    """How much stage 16 is worse: absolute (``bounded``) or a fraction of stage 15's value."""
    test: str
    documents: int
    p_value: float
    p_holm: float = 1.0
    failed: bool = False


def _number(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else None


def _aggregation(results: dict[str, Any], task: str, metric: str) -> Callable[[list[Any]], float]:
    """The metric's aggregation as lm-eval ran it: the task config's, else lm-eval's default."""
    from lm_eval.api.registry import get_aggregation, get_metric_aggregation

    for entry in results.get("configs", {}).get(task, {}).get("metric_list") or []:
        if entry.get("metric") == metric and isinstance(entry.get("aggregation"), str):
            fn = get_aggregation(entry["aggregation"])
            if fn is not None:
                return fn
    fn = get_metric_aggregation(metric)
    if fn is None:
        raise KeyError(metric)
    return fn


def per_document(results: dict[str, Any], task: str, metric: str, filt: str) -> dict[int, Any]:
    """doc_id -> the metric's per-document value, from lm-eval's logged samples."""
    return {
        int(s["doc_id"]): s[metric]
        for s in results["samples"].get(task, [])
        if s.get("filter") == filt and metric in s
    }


def _aggregate_many(
    fn: Callable[[list[Any]], float], name: str, items: list[Any], picks: np.ndarray
) -> np.ndarray:
    """The aggregate of each resample (a row of ``picks``)."""
    if name == "mean" and all(isinstance(v, (int, float)) for v in items):
        values = np.asarray(items, dtype=np.float64)
        return values[picks].mean(axis=1)
    if name in ("weighted_perplexity", "bits_per_byte") and all(
        isinstance(v, (list, tuple)) and len(v) == 2 for v in items
    ):
        ll = np.asarray([v[0] for v in items], dtype=np.float64)[picks].sum(axis=1)
        weight = np.asarray([v[1] for v in items], dtype=np.float64)[picks].sum(axis=1)
        mean = ll / weight
        return np.exp(-mean) if name == "weighted_perplexity" else -mean / math.log(2)
    return np.asarray([fn([items[i] for i in row]) for row in picks], dtype=np.float64)


def _worse(new: float | np.ndarray, base: float, higher: bool, bounded: bool) -> Any:
    diff = (base - new) if higher else (new - base)
    return diff if bounded else diff / max(abs(base), 1e-12)


def mcnemar(base: np.ndarray, new: np.ndarray, higher: bool) -> float:
    """One-sided exact McNemar p-value that ``new`` is worse than ``base`` (0/1 per document)."""
    from scipy.stats import binomtest

    good_base, good_new = (base, new) if higher else (1 - base, 1 - new)
    lost = int(((good_base == 1) & (good_new == 0)).sum())
    won = int(((good_base == 0) & (good_new == 1)).sum())
    if lost + won == 0:
        return 1.0
    return float(binomtest(lost, lost + won, 0.5, alternative="greater").pvalue)


def paired_bootstrap(
    fn: Callable[[list[Any]], float],
    name: str,
    base: list[Any],
    new: list[Any],
    higher: bool,
) -> float:
    """One-sided paired-bootstrap p-value that ``new`` is worse: the share of resamples of the
    documents (the same ones for both runs) in which it is not."""
    fast = name in ("mean", "weighted_perplexity", "bits_per_byte")
    reps = BOOTSTRAP if fast else BOOTSTRAP_SLOW
    picks = np.random.default_rng(SEED).integers(0, len(base), size=(reps, len(base)))
    b = _aggregate_many(fn, name, base, picks)
    n = _aggregate_many(fn, name, new, picks)
    worse = (b - n) if higher else (n - b)
    return float((np.count_nonzero(worse <= 0) + 1) / (reps + 1))


def _stderr(results: dict[str, Any], task: str, metric: str, filt: str) -> float | None:
    return _number(results["results"][task].get(f"{metric}_stderr,{filt}"))


def _parents(results: dict[str, Any]) -> dict[str, str]:
    return {t: g for g, subs in (results.get("group_subtasks") or {}).items() for t in subs}


def judge(
    new: dict[str, Any], base: dict[str, Any], task_drop: float, alpha: float
) -> list[TaskRow]:
    """Every leaf task's every metric, stage 16 (``new``) against stage 15 (``base``)."""
    rows: list[TaskRow] = []
    parents = _parents(new)
    for task in sorted(new["samples"]):
        higher = new["higher_is_better"].get(task, {})
        for key, value in sorted(new["results"][task].items()):
            if "," not in key or "_stderr," in key:
                continue
            metric, filt = key.split(",", 1)
            now, then = _number(value), _number(base["results"][task].get(key))
            if metric not in higher or now is None or then is None:
                continue
            a = per_document(base, task, metric, filt)
            b = per_document(new, task, metric, filt)
            if sorted(a) != sorted(b) or not a:  # a scoring bug, never a user's: fail loudly
                raise RuntimeError(f"task {task}: the two checkpoints scored other documents")
            docs = sorted(a)
            items_a, items_b = [a[d] for d in docs], [b[d] for d in docs]
            fn = _aggregation(new, task, metric)
            name = getattr(fn, "__name__", "")
            numeric = all(isinstance(v, (int, float)) for v in items_a + items_b)
            bounded = numeric and name == "mean" and all(0 <= v <= 1 for v in items_a + items_b)
            binary = bounded and all(v in (0, 1) for v in items_a + items_b)
            hib = bool(higher[metric])
            if binary:
                test = "mcnemar"
                p = mcnemar(np.asarray(items_a), np.asarray(items_b), hib)
            else:
                test = "paired-bootstrap"
                p = paired_bootstrap(fn, name, items_a, items_b, hib)
            rows.append(
                TaskRow(
                    task=task,
                    group=parents.get(task),
                    metric=metric,
                    filter=filt,
                    stage15=then,
                    stage15_stderr=_stderr(base, task, metric, filt),
                    stage16=now,
                    stage16_stderr=_stderr(new, task, metric, filt),
                    higher_is_better=hib,
                    bounded=bounded,
                    worse_by=float(_worse(now, then, hib, bounded)),
                    test=test,
                    documents=len(docs),
                    p_value=p,
                )
            )
    return holm(rows, task_drop, alpha)


def holm(rows: list[TaskRow], task_drop: float, alpha: float) -> list[TaskRow]:
    """Holm's step-down correction over every row; a row fails when its corrected p-value is
    below ``alpha`` and it is worse by more than ``task_drop``."""
    order = sorted(range(len(rows)), key=lambda i: rows[i].p_value)
    adjusted = [1.0] * len(rows)
    running = 0.0
    for k, i in enumerate(order):
        running = max(running, min(1.0, (len(rows) - k) * rows[i].p_value))
        adjusted[i] = running
    return [
        r.model_copy(
            update={"p_holm": adjusted[i], "failed": adjusted[i] < alpha and r.worse_by > task_drop}
        )
        for i, r in enumerate(rows)
    ]


def describe(row: TaskRow) -> str:
    change = f"{row.worse_by:.3f}" if row.bounded else f"{row.worse_by:.1%}"
    where = f"task {row.task}" + (f" (in group {row.group})" if row.group else "")
    return (
        f"{where}: {row.metric} {row.stage15:.4f} -> {row.stage16:.4f} (worse by {change},"
        f" p {row.p_holm:.2g} Holm-corrected, {row.test} over {row.documents} documents)"
    )


def findings(rows: list[TaskRow], task_drop: float, alpha: float) -> list[Finding]:
    out = [
        Finding(
            "gate-task-drop",
            "error",
            describe(r),
            "inspect stage 16's data mix and LR against this task; re-run stage 16 from stage 15",
            "",
            "wonderland.eval.tasks",
        )
        for r in rows
        if r.failed
    ]
    if out or not rows:
        return out
    return [
        Finding(
            "gate",
            "ok",
            f"no task got significantly worse by more than {task_drop} (alpha {alpha},"
            f" {len(rows)} task metrics judged paired)",
        )
    ]
