"""Stage 17's task gate on lm-eval's per-document results: paired tests, Holm's correction,
subtasks judged one by one, and a default that noise does not fail."""

from __future__ import annotations

import math

import numpy as np
import pytest

from wonderland_ds.eval import task_gate

pytest.importorskip("lm_eval")


def results(values: dict[str, list], metric: str = "acc", groups=None, higher=True) -> dict:
    """lm-eval's results shape for tasks with one metric and per-document ``values``."""
    from lm_eval.api.registry import get_metric_aggregation

    agg = get_metric_aggregation(metric)
    return {
        "results": {
            t: {f"{metric},none": agg(v), f"{metric}_stderr,none": 0.01} for t, v in values.items()
        },
        "samples": {
            t: [{"doc_id": i, "filter": "none", metric: x} for i, x in enumerate(v)]
            for t, v in values.items()
        },
        "higher_is_better": {t: {metric: higher} for t in values},
        "configs": {t: {"metric_list": [{"metric": metric}]} for t in values},
        "group_subtasks": groups or {},
    }


def test_mcnemar_counts_only_the_documents_the_two_disagree_on():
    base = np.array([1] * 40 + [0] * 10)
    lost_ten = base.copy()
    lost_ten[:10] = 0  # 10 lost, none won
    assert task_gate.mcnemar(base, lost_ten, True) == pytest.approx(0.5**10)
    swapped = base.copy()
    swapped[:5], swapped[40:45] = 0, 1  # 5 lost, 5 won: no evidence either way
    tail = sum(math.comb(10, k) for k in range(5, 11)) / 2**10
    assert task_gate.mcnemar(base, swapped, True) == pytest.approx(tail)
    assert task_gate.mcnemar(base, base, True) == 1.0
    # Lower is better (an error rate): losing means going up.
    assert task_gate.mcnemar(1 - base, 1 - lost_ten, False) == pytest.approx(0.5**10)


def test_holm_corrects_over_every_metric_judged():
    rows = [
        task_gate.TaskRow(
            task=t,
            group=None,
            metric="acc",
            filter="none",
            stage15=0.9,
            stage15_stderr=None,
            stage16=0.5,
            stage16_stderr=None,
            higher_is_better=True,
            bounded=True,
            worse_by=0.4,
            test="mcnemar",
            documents=50,
            p_value=p,
        )
        for t, p in (("a", 0.01), ("b", 0.04), ("c", 0.03))
    ]
    judged = task_gate.holm(rows, 0.02, 0.05)
    assert [r.p_holm for r in judged] == pytest.approx([0.03, 0.06, 0.06])
    assert [r.failed for r in judged] == [True, False, False]  # uncorrected, all three would


def test_a_group_that_averages_fine_fails_on_its_collapsed_subtask():
    groups = {"suite": ["easy", "hard"]}
    base = results({"easy": [1] * 15 + [0] * 15, "hard": [1] * 30}, groups=groups)
    new = results({"easy": [1] * 30, "hard": [1] * 15 + [0] * 15}, groups=groups)
    rows = task_gate.judge(new, base, 0.02, 0.05)
    # The group's mean is 0.75 before and after; its subtask "hard" fell from 1.0 to 0.5.
    assert {r.task: r.failed for r in rows} == {"easy": False, "hard": True}
    found = task_gate.findings(rows, 0.02, 0.05)
    assert [f.rule for f in found] == ["gate-task-drop"]
    assert found[0].message.startswith("task hard (in group suite): acc 1.0000 -> 0.5000")


def test_a_significant_drop_smaller_than_task_drop_passes():
    n = 2000
    base = results({"t": [1] * n})
    new = results({"t": [0] * 30 + [1] * (n - 30)})  # 1.5 points, p ~ 1e-9
    (row,) = task_gate.judge(new, base, 0.02, 0.05)
    assert row.p_holm < 1e-6 and row.worse_by == pytest.approx(0.015) and not row.failed
    (row,) = task_gate.judge(new, base, 0.01, 0.05)
    assert row.failed


def test_perplexity_is_judged_relative_with_a_paired_bootstrap():
    rng = np.random.default_rng(0)
    ll = -rng.uniform(5, 15, 60)
    words = rng.integers(5, 12, 60)
    base = results(
        {"ppl": [[float(a), int(w)] for a, w in zip(ll, words)]}, "word_perplexity", higher=False
    )
    worse = results(
        {"ppl": [[float(a) * 1.1, int(w)] for a, w in zip(ll, words)]},
        "word_perplexity",
        higher=False,
    )
    (row,) = task_gate.judge(worse, base, 0.02, 0.05)
    assert row.test == "paired-bootstrap" and not row.bounded and row.failed
    expect = math.exp(-1.1 * ll.sum() / words.sum()) / math.exp(-ll.sum() / words.sum()) - 1
    assert row.worse_by == pytest.approx(expect)
    (same,) = task_gate.judge(base, base, 0.02, 0.05)
    assert same.p_value == 1.0 and not same.failed


def test_noise_does_not_fail_a_run_but_a_real_drop_does():
    """Four tasks of 300 documents; each checkpoint answers each document right with the same
    chance, drawn independently (the noise of a healthy stage 16, and more: real checkpoints
    agree on most documents). Over 200 such runs the default gate fails at most alpha of them;
    with a real 15-point fall on one task it fails nearly all."""
    rng = np.random.default_rng(1)

    def run(drop: float) -> bool:
        p = rng.uniform(0.4, 0.9, 4)
        base = {f"t{i}": (rng.random(300) < p[i]).astype(int).tolist() for i in range(4)}
        new = {
            f"t{i}": (rng.random(300) < p[i] - (drop if i == 0 else 0)).astype(int).tolist()
            for i in range(4)
        }
        rows = task_gate.judge(results(new), results(base), 0.02, 0.05)
        return any(r.failed for r in rows)

    false_alarms = sum(run(0.0) for _ in range(200))
    assert false_alarms <= 0.05 * 200, false_alarms
    caught = sum(run(0.15) for _ in range(50))
    assert caught >= 45, caught
