"""Stage 17's language-model report, written by rank 0: ``report.json`` and ``report.md``,
lm-eval's own results file per checkpoint (``lm_eval/stage16.json``, ``lm_eval/stage15.json``,
as ``lm_eval --output_path`` writes it, so its tools read them) and the figures."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core.distributed import log
from wonderland_ds.eval.lm_eval import results_json

LM_EVAL_DIR = "lm_eval"


def _value(value: float, stderr: float | None) -> str:
    return f"{value:.4f}" + (f" ± {stderr:.4f}" if stderr is not None else "")


def task_table(report: dict[str, Any]) -> list[str]:
    """Each task's metric for stage 15 and 16 with its standard error, the paired test's
    Holm-corrected p-value and the verdict."""
    if not report["tasks"]:
        return []
    lines = [
        "| task | metric | stage 15 | stage 16 | worse by | p (Holm) | gate |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in report["tasks"]:
        name = r["task"] + (f" ({r['group']})" if r["group"] else "")
        metric = r["metric"] + (f", {r['filter']}" if r["filter"] != "none" else "")
        worse = f"{r['worse_by']:.4f}" if r["bounded"] else f"{r['worse_by']:.1%}"
        lines.append(
            f"| {name} | {metric} | {_value(r['stage15'], r['stage15_stderr'])} |"
            f" {_value(r['stage16'], r['stage16_stderr'])} | {worse} | {r['p_holm']:.3g} |"
            f" {'FAIL' if r['failed'] else ''} |"
        )
    return lines


def _markdown(report: dict[str, Any]) -> str:
    gate = report["gate"]
    lines = [
        "# Stage 17: language-model sweep",
        "",
        f"Checkpoint: `{report['checkpoint']}`  ",
        f"Baseline: `{report['baseline']}`",
        "",
        f"Gate: **{gate['verdict']}**",
        "",
        "| source | tokens | loss (15) | loss (16) | perplexity (16) |",
        "|---|---|---|---|---|",
    ]
    old = {r["source"]: r for r in report["stage15"]["per_source"]}
    for r in report["stage16"]["per_source"]:
        lines.append(
            f"| {r['source']} | {r['tokens']} | {old[r['source']]['loss']:.4f} |"
            f" {r['loss']:.4f} | {r['perplexity']:.2f} |"
        )
    if report["tasks"]:
        lines += [
            "",
            f"Downstream tasks (lm-eval; a metric fails when worse by more than"
            f" {gate['task_drop']} and significant at {gate['task_alpha']}, paired):",
            "",
            *task_table(report),
        ]
    lines.append("")
    lines += [f"- {f['severity']}: {f['message']}" for f in gate["findings"]]
    lines += ["", *[f"![{name}]({name})" for name in report["plots"]]]
    return "\n".join(lines) + "\n"


def write(out: Path, report: dict[str, Any], harness: dict[str, Any], with_samples: bool) -> None:
    from wonderland_ds.eval.plots import lm_source_plot, task_plot

    out.mkdir(parents=True, exist_ok=True)
    if harness:
        folder = out / LM_EVAL_DIR
        folder.mkdir(exist_ok=True)
        report["lm_eval"] = {}
        for name, results in harness.items():
            ck.atomic_write_text(folder / f"{name}.json", results_json(results, with_samples))
            report["lm_eval"][name] = str(folder / f"{name}.json")
    report["plots"] = lm_source_plot(out, report) + (task_plot(out, report) if harness else [])
    ck.atomic_write_text(out / "report.json", json.dumps(report, indent=2))
    ck.atomic_write_text(out / "report.md", _markdown(report))
    for row in task_table(report):
        log(row)
    new, old = report["stage16"], report["stage15"]
    tasks = report["tasks"]
    worst = (
        f"; {sum(r['failed'] for r in tasks)} of {len(tasks)} task metrics failed" if tasks else ""
    )
    log(
        f"stage 17 summary: loss {old['loss']:.4f} -> {new['loss']:.4f}, perplexity"
        f" {new['perplexity']:.2f} over {len(new['per_source'])} text sources{worst};"
        f" gate {report['gate']['verdict']} ({out / 'report.md'})"
    )
