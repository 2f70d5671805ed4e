"""Stage 17, the final evaluation sweep: per-class metrics of stage 16 against stage 15.

Held-out samples are cut into fixed blocks of ``BLOCK`` consecutive rows and the blocks are dealt
to ranks round-robin: every sample is counted exactly once (no padding duplicates), and each
block goes through the model as the same batch whatever the world size, so 1, 2 or 3 ranks give
the same predictions. Metrics come from scikit-learn; figures from ``plots.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.distributed import log
from wonderland_ds.core.findings import Finding, GuardStop
from wonderland_ds.data.tasks import Split, Task
from wonderland_ds.eval.lm_loss import run_eval_lm
from wonderland_ds.eval.plots import label
from wonderland_ds.eval.sweep import (
    baseline,
    consolidated_state,
    gather_once,
    heldout,
    record_gate_failure,
    run_holding,
    sweep,
)
from wonderland_ds.eval.weights import eval_model, load_into
from wonderland_ds.run.inputs import StageInputs
from wonderland_ds.run.preflight import Plan

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions


def predict(task: Task, model: torch.nn.Module) -> tuple[np.ndarray, np.ndarray]:
    """This rank's shard of the held-out split: (sample indices, predicted classes), on the
    model's device and in its dtype."""
    p = next(model.parameters())

    def classes(model: torch.nn.Module, split: Split, idx: np.ndarray) -> np.ndarray:
        x = torch.from_numpy(np.asarray(split.x[idx], dtype=np.float32))
        logits = model(x.to(device=p.device, dtype=p.dtype))
        return logits.argmax(-1).cpu().numpy().astype(np.int64)

    return sweep(task, model, classes, np.int64)


def gathered_predictions(task: Task, tag_dir: Path, ds_dict: dict[str, Any]) -> np.ndarray:
    """Every held-out prediction of the checkpoint, each rank evaluating its blocks on its
    accelerator in the training dtype."""
    with eval_model(task, tag_dir, ds_dict) as model:
        idx, pred = predict(task, model)
    return gather_once(len(heldout(task)), idx, pred, -1)


def reference_predictions(task: Task, tag_dir: Path) -> np.ndarray:
    """One process, the CPU, DeepSpeed's consolidated fp32 weights: what stage 17's sharded
    evaluation must equal for an fp32 run."""
    model = load_into(task.build_model(), consolidated_state(tag_dir))
    idx, pred = predict(task, model)
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


def run_eval(opts: StageOptions, run_dir: Path, inputs: StageInputs, plan: Plan) -> dict[str, Any]:
    task = inputs.task
    if task.kind == "lm":
        return run_eval_lm(opts, run_dir, inputs, plan)
    settings = inputs.settings
    assert plan.source is not None
    # Baseline and training curves come from the run the checkpoint was trained in, which is
    # not run_dir when `wonderland eval --out DIR` keeps its records in DIR.
    home = run_holding(plan.source) or run_dir
    base_dir = baseline(opts, home)
    new = metrics(task, gathered_predictions(task, plan.source, inputs.ds_dict))
    base = metrics(task, gathered_predictions(task, base_dir, inputs.ds_dict))
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
    out = Path(opts.out) if opts.out else run_dir / "stage17"
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
            record_gate_failure(run_dir, opts.stage, out / "report.json", failed)
    dist.barrier()
    if failed:
        raise GuardStop(failed)
    return {
        "report": str(out / "report.json"),
        "gate": "pass",
        "accuracy": new["accuracy"],
        "macro_f1": new["macro_f1"],
    }
