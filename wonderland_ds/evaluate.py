"""Stage 17, the final evaluation sweep: per-class metrics of stage 16 against stage 15.

Held-out samples are sharded across ranks by index (``i % world == rank``) and gathered, so
every sample is counted exactly once. Metrics come from scikit-learn.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint as ck
from . import distributed as dist
from .findings import Finding, GuardStop, Refused
from .preflight import Plan, stage_ckpt_root
from .stage import log
from .tasks import Task


def consolidated_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights, buffers and frozen parameters via DeepSpeed's zero_to_fp32 (any ZeRO stage).
    The checkpoint's checksums were verified by the preflight before this unpickles it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def predict(task: Task, state: dict[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """This rank's shard of the held-out split: (sample indices, predicted classes)."""
    model = task.build_model()
    missing, unexpected = model.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise Refused(
            f"checkpoint does not fit the task's model: missing {missing[:3]},"
            f" unexpected {unexpected[:3]}",
            "evaluate with the task it was trained on",
        )
    model.eval()
    idx = np.arange(dist.rank(), len(task.heldout), dist.world_size())
    with torch.no_grad():
        logits = model(torch.from_numpy(task.heldout.x[idx]))
    return idx, logits.argmax(-1).numpy()


def gathered_predictions(task: Task, tag_dir: Path) -> np.ndarray:
    idx, pred = predict(task, consolidated_state(tag_dir))
    out = np.full(len(task.heldout), -1, dtype=np.int64)
    seen = np.zeros(len(task.heldout), dtype=np.int64)
    for i, p in dist.gather_all((idx, pred)):
        out[i] = p
        seen[i] += 1
    assert (seen == 1).all(), "every held-out sample must be evaluated exactly once"
    return out


def metrics(task: Task, pred: np.ndarray) -> dict[str, Any]:
    from sklearn.metrics import (
        accuracy_score,
        balanced_accuracy_score,
        confusion_matrix,
        f1_score,
        precision_recall_fscore_support,
    )

    y = task.heldout.y
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
) -> list[Finding]:
    out = []
    for row, old in zip(new["per_class"], base["per_class"]):
        c, drop = row["class"], old["recall"] - row["recall"]
        if drop > margin:
            out.append(
                Finding(
                    "gate-recall-drop",
                    "error",
                    f"class {c}: recall {old['recall']:.3f} -> {row['recall']:.3f}"
                    f" (drop {drop:.3f} > margin {margin})",
                    "inspect stage 16's data and LR; re-run from stage 15",
                    "",
                    f"class {c}",
                )
            )
        if c in task.minority_classes and row["recall"] < floor:
            out.append(
                Finding(
                    "gate-minority-floor",
                    "error",
                    f"minority class {c}: recall {row['recall']:.3f} < floor {floor}",
                    "stage 16 collapsed a minority class",
                    "",
                    f"class {c}",
                )
            )
    return out or [Finding("gate", "ok", "no class regressed beyond the margin")]


def _baseline(args: argparse.Namespace, run_dir: Path) -> Path:
    if args.baseline:
        v = ck.verify(Path(args.baseline))
    else:
        found = ck.newest_complete(stage_ckpt_root(run_dir, 15))
        if found is None:
            raise Refused(
                "stage 17 found no complete stage-15 checkpoint to compare with",
                "pass --baseline PATH",
            )
        v = found
    if not v.complete:
        raise Refused(v.findings)
    return v.tag_dir


def _markdown(report: dict[str, Any]) -> str:
    lines = [
        "# Stage 17: final evaluation sweep",
        "",
        f"Gate: **{report['gate']['verdict']}**",
        "",
        "| class | minority | support | recall (stage 15) | recall (stage 16) | f1 (16) |",
        "|---|---|---|---|---|---|",
    ]
    for new, old in zip(report["stage16"]["per_class"], report["stage15"]["per_class"]):
        lines.append(
            f"| {new['class']} | {'yes' if new['minority'] else ''} | {new['support']}"
            f" | {old['recall']:.3f} | {new['recall']:.3f} | {new['f1']:.3f} |"
        )
    for key in ("accuracy", "balanced_accuracy", "macro_f1"):
        lines.append(
            f"\n{key}: stage 15 {report['stage15'][key]:.4f}, stage 16 {report['stage16'][key]:.4f}"
        )
    for f in report["gate"]["findings"]:
        lines.append(f"- {f['severity']}: {f['message']}")
    return "\n".join(lines) + "\n"


def run_eval(
    args: argparse.Namespace, run_dir: Path, decided: dict[str, Any], plan: Plan
) -> dict[str, Any]:
    task: Task = decided["task"]
    settings = decided["settings"]
    assert plan.source is not None
    base_dir = _baseline(args, run_dir)
    new = metrics(task, gathered_predictions(task, plan.source))
    base = metrics(task, gathered_predictions(task, base_dir))
    verdict = gate(
        task, new, base, settings.eval.recall_drop_margin, settings.eval.minority_recall_floor
    )
    failed = any(f.severity == "error" for f in verdict)
    report: dict[str, Any] = {
        "checkpoint": str(plan.source),
        "baseline": str(base_dir),
        "stage16": new,
        "stage15": base,
        "gate": {
            "verdict": "fail" if failed else "pass",
            "recall_drop_margin": settings.eval.recall_drop_margin,
            "minority_recall_floor": settings.eval.minority_recall_floor,
            "findings": [f.to_dict() for f in verdict],
        },
    }
    out = run_dir / "stage17"
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        ck.atomic_write_text(out / "report.json", json.dumps(report, indent=2))
        ck.atomic_write_text(out / "report.md", _markdown(report))
        log(
            f"stage 17 summary: accuracy {base['accuracy']:.3f} -> {new['accuracy']:.3f},"
            f" macro-F1 {base['macro_f1']:.3f} -> {new['macro_f1']:.3f}, worst class"
            f" {new['worst_class']['class']} recall {new['worst_class']['recall']:.3f};"
            f" gate {report['gate']['verdict']} ({out / 'report.md'})"
        )
    if failed:
        raise GuardStop([f for f in verdict if f.severity == "error"])
    return {
        "report": str(out / "report.json"),
        "gate": "pass",
        "accuracy": new["accuracy"],
        "macro_f1": new["macro_f1"],
    }
