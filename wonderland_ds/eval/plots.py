"""Stage 17's figures, written next to report.json with matplotlib's Agg backend (no display).

* ``recall_per_class.png``: per-class recall of the baseline and the checkpoint side by side;
  minority classes shaded and labelled, the minority floor drawn, gate failures marked.
* ``confusion_matrix.png``: the checkpoint's confusion matrix, coloured by the share of each
  true class (so a 5-sample minority row is as visible as a 45-sample one), counts written in.
* ``training_curves.png``: loss and LR against the global step for stages 15 and 16, read
  from their ``metrics.csv`` (left out when neither exists).
* Language models: ``loss_per_source.png`` and, with downstream tasks, ``tasks.png``.
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

MINORITY = "#d62728"
COLORS = {"baseline": "#7f7f7f", "checkpoint": "#1f77b4", 15: "#ff7f0e", 16: "#1f77b4"}


def _pyplot() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only: no display, safe on every rank and node
    import matplotlib.pyplot as plt

    return plt


def label(path: str) -> str:
    """``stage16/global_step70`` for a checkpoint inside a run, else the folder's name."""
    p = Path(path)
    return f"{p.parent.parent.name}/{p.name}" if p.parent.name == "checkpoints" else p.name


def _class_ticks(ax: Any, rows: list[dict[str, Any]], axis: str = "x") -> None:
    labels = [f"{r['class']}\nminority" if r["minority"] else str(r["class"]) for r in rows]
    ticks = range(len(rows))
    if axis == "x":
        ax.set_xticks(ticks, labels)
        tick_labels = ax.get_xticklabels()
    else:
        ax.set_yticks(ticks, [t.replace("\n", " ") for t in labels])
        tick_labels = ax.get_yticklabels()
    for t, r in zip(tick_labels, rows):
        if r["minority"]:
            t.set_color(MINORITY)
            t.set_fontweight("bold")


def recall_bars(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    new, base = report["stage16"]["per_class"], report["stage15"]["per_class"]
    failed = report["gate"]["failed_classes"]
    fig, ax = plt.subplots(figsize=(10, 5.2))
    for r in new:
        if r["minority"]:
            ax.axvspan(r["class"] - 0.5, r["class"] + 0.5, color=MINORITY, alpha=0.08, lw=0)
    w = 0.38
    for rows, side, who in ((base, -1, "baseline"), (new, 1, "checkpoint")):
        xs = [r["class"] + side * w / 2 for r in rows]
        name = f"{who} {label(report[who])}"
        ax.bar(xs, [r["recall"] for r in rows], w, color=COLORS[who], label=name)
        for x, r in zip(xs, rows):
            value = f"{r['recall']:.2f}"
            ax.text(x, r["recall"] + 0.01, value, ha="center", va="bottom", fontsize=6.5)
    for c in failed:
        ax.text(c, 1.1, "FAIL", ha="center", color=MINORITY, fontweight="bold")
    floor = report["gate"]["minority_recall_floor"]
    ax.axhline(floor, color=MINORITY, ls="--", lw=1, label=f"minority recall floor {floor}")
    ax.set_ylim(0, 1.18)
    ax.set_xlim(-0.6, len(new) - 0.4)
    _class_ticks(ax, new)
    ax.set_ylabel("recall on the held-out split")
    title = f"Per-class recall (support {sum(r['support'] for r in new)})"
    title += f" - gate {report['gate']['verdict'].upper()}"
    ax.set_title(title + (f", failing classes: {', '.join(map(str, failed))}" if failed else ""))
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=3, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def confusion(report: dict[str, Any], path: Path) -> None:
    plt = _pyplot()
    cm = report["stage16"]["confusion_matrix"]
    rows = report["stage16"]["per_class"]
    share = [[v / max(sum(row), 1) for v in row] for row in cm]
    fig, ax = plt.subplots(figsize=(7, 6))
    im = ax.imshow(share, cmap="Blues", vmin=0, vmax=1)
    for i, row in enumerate(cm):
        for j, v in enumerate(row):
            if v:
                color = "white" if share[i][j] > 0.6 else "black"
                ax.text(j, i, str(v), ha="center", va="center", fontsize=8, color=color)
    _class_ticks(ax, rows, "x")
    _class_ticks(ax, rows, "y")
    ax.set_xlabel("predicted class")
    ax.set_ylabel("true class")
    ax.set_title(f"Confusion matrix of {label(report['checkpoint'])} (counts)")
    fig.colorbar(im, ax=ax, label="share of the true class")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def read_metrics(path: Path) -> dict[str, list[float]]:
    with open(path, newline="") as fh:
        rows = [r for r in csv.DictReader(fh) if r.get("loss") and r.get("lr")]
    return {k: [float(r[k]) for r in rows] for k in ("step", "loss", "lr")}


def training_curves(curves: dict[int, dict[str, list[float]]], path: Path) -> None:
    plt = _pyplot()
    fig, (ax_loss, ax_lr) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    for stage, m in sorted(curves.items()):
        ax_loss.plot(m["step"], m["loss"], color=COLORS[stage], lw=1, label=f"stage {stage}")
        ax_lr.plot(m["step"], m["lr"], color=COLORS[stage], lw=1.5, label=f"stage {stage}")
    if 16 in curves and curves[16]["step"]:
        for ax in (ax_loss, ax_lr):
            ax.axvline(curves[16]["step"][0] - 1, color="black", ls=":", lw=1)
    ax_loss.set_yscale("log")
    ax_loss.set_ylabel("training loss (log)")
    ax_lr.set_ylabel("learning rate")
    ax_lr.set_xlabel("global step")
    ax_loss.set_title("Training loss and LR, stages 15 and 16 (metrics.csv)")
    for ax in (ax_loss, ax_lr):
        ax.legend(fontsize=8)
        ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_plots(out: Path, report: dict[str, Any], metrics_csv: dict[int, Path]) -> list[str]:
    """Write the figures into ``out``; returns their file names (relative to ``out``)."""
    names = ["recall_per_class.png", "confusion_matrix.png"]
    recall_bars(report, out / names[0])
    confusion(report, out / names[1])
    curves = {n: read_metrics(p) for n, p in metrics_csv.items() if p.is_file()}
    if curves:
        names.append("training_curves.png")
        training_curves(curves, out / names[-1])
    return names


def lm_source_plot(out: Path, report: dict[str, Any]) -> list[str]:
    """``loss_per_source.png``: held-out loss per text source, stage 15 beside stage 16, with
    the gate's limit (stage 15's loss raised by ``lm_loss_rise``) drawn over each source."""
    plt = _pyplot()
    old = {r["source"]: r for r in report["stage15"]["per_source"]}
    rows = report["stage16"]["per_source"]
    failed = {f["path"] for f in report["gate"]["findings"] if f["severity"] == "error"}
    rise = report["gate"]["lm_loss_rise"]
    fig, ax = plt.subplots(figsize=(max(4.0, 1.2 * len(rows) + 2), 3.6))
    xs = range(len(rows))
    ax.bar(
        [x - 0.2 for x in xs],
        [old[r["source"]]["loss"] for r in rows],
        0.4,
        label=f"stage 15 ({label(report['baseline'])})",
        color=COLORS[15],
    )
    ax.bar(
        [x + 0.2 for x in xs],
        [r["loss"] for r in rows],
        0.4,
        label=f"stage 16 ({label(report['checkpoint'])})",
        color=COLORS[16],
    )
    for x, r in zip(xs, rows):
        limit = old[r["source"]]["loss"] * (1 + rise)
        ax.hlines(
            limit,
            x - 0.4,
            x + 0.4,
            colors=MINORITY if r["source"] in failed else "k",
            linestyles="dashed",
            linewidth=1,
        )
    ax.set_xticks(
        list(xs), [r["source"] + (" (FAIL)" if r["source"] in failed else "") for r in rows]
    )
    ax.set_ylabel("held-out loss (nats/token)")
    ax.set_title(f"Stage 17: loss per source (dashed: gate, +{rise:.0%})")
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(out / "loss_per_source.png", dpi=100)
    plt.close(fig)
    return ["loss_per_source.png"]


def task_plot(out: Path, report: dict[str, Any]) -> list[str]:
    """``tasks.png``: each downstream task's metric, stage 15 beside stage 16, with lm-eval's
    standard errors as error bars; failed metrics marked. Metrics between 0 and 1 on the left
    axis, unbounded ones (perplexities) in a panel of their own."""
    plt = _pyplot()
    rows = report["tasks"]
    panels = [
        p for p in ([r for r in rows if r["bounded"]], [r for r in rows if not r["bounded"]]) if p
    ]
    fig, axes = plt.subplots(
        1,
        len(panels),
        figsize=(max(5.0, 1.1 * len(rows) + 3), 3.8),
        squeeze=False,
        gridspec_kw={"width_ratios": [len(p) for p in panels]},
    )
    for ax, part in zip(axes[0], panels):
        xs = range(len(part))
        for shift, key, stage in ((-0.2, "stage15", 15), (0.2, "stage16", 16)):
            errs = [r[f"{key}_stderr"] or 0.0 for r in part]
            ax.bar(
                [x + shift for x in xs],
                [r[key] for r in part],
                0.4,
                yerr=errs,
                capsize=3,
                color=COLORS[stage],
                label=f"stage {stage} ({label(report['baseline' if stage == 15 else 'checkpoint'])})",
            )
        names = [f"{r['task']}\n{r['metric']}" + ("\nFAIL" if r["failed"] else "") for r in part]
        ax.set_xticks(list(xs), names, fontsize=7)
        for tick, r in zip(ax.get_xticklabels(), part):
            if r["failed"]:
                tick.set_color(MINORITY)
        ax.set_ylabel("score (0 to 1)" if part[0]["bounded"] else "value")
    axes[0][0].legend(fontsize=7, loc="lower right")
    fig.suptitle("Stage 17: downstream tasks (error bars: lm-eval's standard error)", fontsize=9)
    fig.tight_layout()
    fig.savefig(out / "tasks.png", dpi=100)
    plt.close(fig)
    return ["tasks.png"]
