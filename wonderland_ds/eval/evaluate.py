"""Stage 17, the final evaluation sweep: per-class metrics of stage 16 against stage 15.

Held-out samples are cut into fixed blocks of ``BLOCK`` consecutive rows and the blocks are dealt
to ranks round-robin: every sample is counted exactly once (no padding duplicates), and each
block goes through the model as the same batch whatever the world size, so 1, 2 or 3 ranks give
the same predictions. Metrics come from scikit-learn; figures from ``plots.py``.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint.describe import resolve_tag_dir
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.distributed import log
from wonderland_ds.core.findings import Finding, GuardStop, Refused
from wonderland_ds.data.tasks import Split, Task
from wonderland_ds.eval.plots import label
from wonderland_ds.run import manifest
from wonderland_ds.run.preflight import Plan, stage_ckpt_root

BLOCK = 64
"""Rows per forward pass; a block is the unit dealt to ranks."""


def consolidated_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights, buffers and frozen parameters via DeepSpeed's zero_to_fp32 (any ZeRO stage).
    The checkpoint's checksums were verified by the preflight before this unpickles it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def heldout(task: Task) -> Split:
    if task.heldout is None:
        raise Refused(f"task {task.name!r} has no held-out split", "give the task held-out data")
    if not isinstance(task.heldout, Split):
        raise Refused(
            f"task {task.name!r}: a classifier's held-out set must be arrays (a Split)",
            "give the task heldout=Split(x, y)",
        )
    return task.heldout


def shard(n: int, rank: int, world: int) -> list[np.ndarray]:
    """This rank's blocks of ``range(n)``: block ``b`` goes to rank ``b % world``."""
    starts = range(rank * BLOCK, n, world * BLOCK)
    return [np.arange(s, min(s + BLOCK, n)) for s in starts]


def sweep(
    task: Task,
    state: dict[str, torch.Tensor],
    per_block: Callable[[torch.nn.Module, Split, np.ndarray], np.ndarray],
    dtype: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Load ``state`` into the task's model and run ``per_block`` over this rank's blocks of
    the held-out split: (sample indices, one value per sample)."""
    model = task.build_model()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise Refused(
            f"checkpoint does not fit the task's model: missing {missing[:3]},"
            f" unexpected {unexpected[:3]}",
            "evaluate with the task it was trained on",
        )
    model.eval()
    split = heldout(task)
    blocks = shard(len(split), dist.rank(), dist.world_size())
    values = [np.zeros(0, dtype=dtype)]
    with torch.no_grad():
        values += [per_block(model, split, idx) for idx in blocks]
    idx_all = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
    return idx_all, np.concatenate(values)


def predict(task: Task, state: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """This rank's shard of the held-out split: (sample indices, predicted classes)."""

    def classes(model: torch.nn.Module, split: Split, idx: np.ndarray) -> np.ndarray:
        logits = model(torch.from_numpy(np.asarray(split.x[idx], dtype=np.float32)))
        return logits.argmax(-1).numpy().astype(np.int64)

    return sweep(task, state, classes, np.int64)


def gather_once(n: int, idx: np.ndarray, values: np.ndarray, fill: Any) -> np.ndarray:
    """Every rank's (indices, values) into one array of ``n``, each index exactly once."""
    out = np.full(n, fill, dtype=values.dtype)
    seen = np.zeros(n, dtype=np.int64)
    for i, v in dist.gather_all((idx, values)):
        out[i] = v
        seen[i] += 1
    if not (seen == 1).all():  # a sharding bug, never a user mistake: fail loudly
        raise RuntimeError(f"held-out samples evaluated {seen.min()}..{seen.max()} times, not once")
    return out


def gathered_predictions(task: Task, tag_dir: Path) -> np.ndarray:
    idx, pred = predict(task, consolidated_state(tag_dir))
    return gather_once(len(heldout(task)), idx, pred, -1)


def metrics(task: Task, pred: np.ndarray) -> dict[str, Any]:
    from sklearn.metrics import (
        accuracy_score,
        balanced_accuracy_score,
        confusion_matrix,
        f1_score,
        precision_recall_fscore_support,
    )

    y = np.asarray(heldout(task).y)
    labels = list(range(task.num_classes))
    p, r, f, s = precision_recall_fscore_support(y, pred, labels=labels, zero_division=0)
    per_class = [
        {
            "class": c,
            "precision": float(p[c]),
            "recall": float(r[c]),
            "f1": float(f[c]),
            "support": int(s[c]),
            "minority": c in task.minority_classes,
        }
        for c in labels
    ]
    worst = min(per_class, key=lambda row: row["recall"])
    return {
        "accuracy": float(accuracy_score(y, pred)),
        "balanced_accuracy": float(balanced_accuracy_score(y, pred)),
        "macro_f1": float(f1_score(y, pred, labels=labels, average="macro", zero_division=0)),
        "worst_class": {"class": worst["class"], "recall": worst["recall"]},
        "per_class": per_class,
        "confusion_matrix": confusion_matrix(y, pred, labels=labels).tolist(),
        "samples": int(len(y)),
    }


def gate(
    task: Task, new: dict[str, Any], base: dict[str, Any], margin: float, floor: float
) -> tuple[list[Finding], list[int]]:
    """The gate's findings, and the classes that failed it (sorted)."""
    out, failed = [], set()
    for row, old in zip(new["per_class"], base["per_class"]):
        c, drop = row["class"], old["recall"] - row["recall"]
        if drop > margin:
            failed.add(c)
            out.append(
                Finding(
                    "gate-recall-drop",
                    "error",
                    f"class {c}: recall {old['recall']:.3f} -> {row['recall']:.3f}"
                    f" (drop {drop:.3f} > margin {margin})",
                    "inspect stage 16's data and LR; re-run from stage 15",
                )
            )
        if c in task.minority_classes and row["recall"] < floor:
            failed.add(c)
            out.append(
                Finding(
                    "gate-minority-floor",
                    "error",
                    f"minority class {c}: recall {row['recall']:.3f} < floor {floor}",
                    "stage 16 collapsed a minority class",
                )
            )
    return out or [Finding("gate", "ok", "no class regressed beyond the margin")], sorted(failed)


def run_holding(path: Path) -> Path | None:
    """The run directory (with a ``run.json``) a checkpoint lies in, if any."""
    for parent in path.resolve().parents:
        if (parent / manifest.NAME).exists():
            return parent
    return None


def _baseline(args: argparse.Namespace, home: Path) -> Path:
    if args.baseline:
        v = ck.verify(resolve_tag_dir(Path(args.baseline)))
    else:
        found = ck.newest_complete(stage_ckpt_root(home, 15))
        if found is None:
            raise Refused(
                f"stage 17 found no complete stage-15 checkpoint in {home} to compare with",
                "pass --baseline PATH",
            )
        v = found
    if not v.complete:
        raise Refused(v.findings)
    return v.tag_dir


def table(report: dict[str, Any]) -> list[str]:
    """The per-class table a person reads first (stdout and report.md share it)."""
    failed = set(report["gate"]["failed_classes"])
    rows = [
        "| class | minority | support | recall (baseline) | recall (checkpoint) | f1 | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for new, old in zip(report["stage16"]["per_class"], report["stage15"]["per_class"]):
        mark = "FAIL" if new["class"] in failed else ""
        rows.append(
            f"| {new['class']} | {'yes' if new['minority'] else ''} | {new['support']}"
            f" | {old['recall']:.3f} | {new['recall']:.3f} | {new['f1']:.3f} | {mark} |"
        )
    return rows


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Stage 17: final evaluation sweep",
        "",
        f"Checkpoint: `{report['checkpoint']}`  ",
        f"Baseline: `{report['baseline']}`",
        "",
        f"Gate: **{report['gate']['verdict']}** (recall-drop margin"
        f" {report['gate']['recall_drop_margin']}, minority floor"
        f" {report['gate']['minority_recall_floor']})",
        "",
        *table(report),
        "",
        "| metric | baseline | checkpoint |",
        "|---|---|---|",
    ]
    for key in ("accuracy", "balanced_accuracy", "macro_f1"):
        lines.append(f"| {key} | {report['stage15'][key]:.4f} | {report['stage16'][key]:.4f} |")
    lines.append("")
    for f in report["gate"]["findings"]:
        lines.append(f"- {f['severity']}: {f['message']}")
    if report["plots"]:
        lines += ["", "## Plots", ""]
        lines += [f"![{name}]({name})" for name in report["plots"]]
    return "\n".join(lines) + "\n"


def run_eval(
    args: argparse.Namespace, run_dir: Path, decided: dict[str, Any], plan: Plan
) -> dict[str, Any]:
    task: Task = decided["task"]
    if task.kind == "lm":
        return run_eval_lm(args, run_dir, decided, plan)
    settings = decided["settings"]
    assert plan.source is not None
    # Baseline and training curves come from the run the checkpoint was trained in, which is
    # not run_dir when `wonderland eval --out DIR` keeps its records in DIR.
    home = run_holding(plan.source) or run_dir
    base_dir = _baseline(args, home)
    new = metrics(task, gathered_predictions(task, plan.source))
    base = metrics(task, gathered_predictions(task, base_dir))
    verdict, failed_classes = gate(
        task, new, base, settings.eval.recall_drop_margin, settings.eval.minority_recall_floor
    )
    failed = [f for f in verdict if f.severity == "error"]
    report: dict[str, Any] = {
        "checkpoint": str(plan.source),
        "baseline": str(base_dir),
        "stage16": new,
        "stage15": base,
        "gate": {
            "verdict": "fail" if failed else "pass",
            "recall_drop_margin": settings.eval.recall_drop_margin,
            "minority_recall_floor": settings.eval.minority_recall_floor,
            "failed_classes": failed_classes,
            "findings": [f.to_dict() for f in verdict],
        },
        "plots": [],
    }
    out = Path(args.out) if getattr(args, "out", None) else run_dir / "stage17"
    if dist.is_main():
        from wonderland_ds.eval.plots import write_plots

        out.mkdir(parents=True, exist_ok=True)
        curves = {n: home / f"stage{n}" / "metrics.csv" for n in (15, 16)}
        report["plots"] = write_plots(out, report, curves)
        ck.atomic_write_text(out / "report.json", json.dumps(report, indent=2))
        ck.atomic_write_text(out / "report.md", _markdown(report))
        log(f"stage 17: {label(report['checkpoint'])} against {label(report['baseline'])}")
        for row in table(report):
            log(row)
        log(
            f"stage 17 summary: accuracy {base['accuracy']:.3f} -> {new['accuracy']:.3f},"
            f" macro-F1 {base['macro_f1']:.3f} -> {new['macro_f1']:.3f}, worst class"
            f" {new['worst_class']['class']} recall {new['worst_class']['recall']:.3f};"
            f" gate {report['gate']['verdict']} ({out / 'report.md'})"
        )
        if failed:
            # The deepspeed launcher kills every rank as soon as one exits non-zero: record the
            # verdict before the barrier, so rank 0 is never killed with it unwritten.
            manifest.update_stage(
                run_dir,
                args.stage,
                status="gate-failed",
                finished=manifest.now(),
                report=str(out / "report.json"),
                gate="fail",
                error="; ".join(f.message for f in failed)[:500],
            )
    dist.barrier()
    if failed:
        raise GuardStop(failed)
    return {
        "report": str(out / "report.json"),
        "gate": "pass",
        "accuracy": new["accuracy"],
        "macro_f1": new["macro_f1"],
    }


# ---------------------------------------------------------------- language models


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
    with torch.no_grad():
        for s in starts:
            x, y = data.take(np.arange(s, min(s + rows, n)))
            tx, ty = torch.from_numpy(x), torch.from_numpy(y)
            count = task.targets(ty)
            loss = task.batch_loss(model, tx, ty) if count else torch.zeros(())
            mine.append((s, float(loss.double()) * count, count))
    blocks = sorted(b for part in dist.gather_all(mine) for b in part)
    if [b[0] for b in blocks] != list(range(0, n, rows)):  # a sharding bug: fail loudly
        raise RuntimeError("held-out blocks were not each evaluated exactly once")
    return float(sum(b[1] for b in blocks)), int(sum(b[2] for b in blocks))


def data_tokens(data: Any) -> int:
    if isinstance(data, _Rows):
        return data.split.tokens_per_sample
    return int(data.tokens_per_sample)


def lm_eval_model(task: Task, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    model = (task.build_empty_model or task.build_model)()
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in _tied(model)]
    if missing or unexpected:
        raise Refused(
            f"checkpoint does not fit the task's model: missing {missing[:3]},"
            f" unexpected {unexpected[:3]}",
            "evaluate with the task it was trained on",
        )
    return model.eval()


def _tied(model: torch.nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier one (tied embeddings)."""
    seen: dict[int, str] = {}
    tied = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            tied.add(name)
        seen.setdefault(id(p), name)
    return tied


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
    args: argparse.Namespace, run_dir: Path, decided: dict[str, Any], plan: Plan
) -> dict[str, Any]:
    task: Task = decided["task"]
    settings = decided["settings"]
    assert plan.source is not None
    home = run_holding(plan.source) or run_dir
    base_dir = _baseline(args, home)
    sources = lm_sources(task)
    result = {}
    for name, tag_dir in (("stage16", plan.source), ("stage15", base_dir)):
        model = lm_eval_model(task, consolidated_state(tag_dir))
        totals = {src: lm_source_losses(task, model, data) for src, data in sources.items()}
        result[name] = lm_metrics(totals)
        del model
    verdict = lm_gate(result["stage16"], result["stage15"], settings.eval.lm_loss_rise)
    failed = [f for f in verdict if f.severity == "error"]
    report: dict[str, Any] = {
        "checkpoint": str(plan.source),
        "baseline": str(base_dir),
        **result,
        "gate": {
            "verdict": "fail" if failed else "pass",
            "lm_loss_rise": settings.eval.lm_loss_rise,
            "findings": [f.to_dict() for f in verdict],
        },
        "plots": [],
    }
    out = Path(args.out) if getattr(args, "out", None) else run_dir / "stage17"
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        lines = [
            "# Stage 17: language-model sweep",
            "",
            f"Gate: **{report['gate']['verdict']}**",
            "",
            "| source | tokens | loss (15) | loss (16) | perplexity (16) |",
            "|---|---|---|---|---|",
        ]
        old = {r["source"]: r for r in result["stage15"]["per_source"]}
        for r in result["stage16"]["per_source"]:
            lines.append(
                f"| {r['source']} | {r['tokens']} | {old[r['source']]['loss']:.4f} |"
                f" {r['loss']:.4f} | {r['perplexity']:.2f} |"
            )
        from wonderland_ds.eval.plots import lm_source_plot

        report["plots"] = lm_source_plot(out, report)
        lines += ["", *[f"![{name}]({name})" for name in report["plots"]]]
        ck.atomic_write_text(out / "report.json", json.dumps(report, indent=2))
        ck.atomic_write_text(out / "report.md", "\n".join(lines) + "\n")
        log(
            f"stage 17 summary: loss {result['stage15']['loss']:.4f} ->"
            f" {result['stage16']['loss']:.4f}, perplexity {result['stage16']['perplexity']:.2f}"
            f" over {len(old)} text sources; gate {report['gate']['verdict']}"
        )
    dist.barrier()
    if failed:
        raise GuardStop(failed)
    return {
        "report": str(out / "report.json"),
        "gate": "pass",
        "loss": result["stage16"]["loss"],
        "perplexity": result["stage16"]["perplexity"],
    }
