"""A judged step's metrics row, and ``metrics.csv`` (one row per optimizer step).

A :class:`StepRow` holds its numbers at the precision ``metrics.csv`` keeps (the loss and LR
to 8 significant digits, times to micro- or ten-microseconds), so the CSV, the progress line
and the metrics sink (DeepSpeed's CSV monitor, TensorBoard) all show the same numbers.
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: metrics.csv's columns, in order.
COLUMNS = (
    "step",
    "loss",
    "lr",
    "grad_norm",
    "samples",
    "sample_digest",
    "step_s",
    "data_wait_s",
    "wall",
    "aux_loss",
)


def _sig(x: float, fmt: str) -> float:
    # The value metrics.csv shows, as a float: rounding by its own format keeps both equal.
    return float(format(x, fmt))


def _num(value: Any) -> float | None:
    if value is None or value == "":
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None  # NaN and inf parse as they are: a NaN loss is news


@dataclass(slots=True)
class StepRow:
    """One optimizer step as metrics.csv, the progress display and the metrics sink see it.
    Every field but ``step`` may be missing (None) in a row read from elsewhere."""

    step: int
    loss: float | None = None
    lr: float | None = None
    grad_norm: float | None = None
    samples: float | None = None
    sample_digest: int | None = None
    step_s: float | None = None
    data_wait_s: float | None = None
    wall: float | None = None
    aux_loss: float | None = None
    """A mixture-of-experts model's router load-balancing loss (mean over ranks and
    micro-batches, before its coefficient); None for other models."""
    source_tokens: dict[str, int] | None = None
    """Weighted sources: the tokens each source gave the step (columns ``tokens_NAME``)."""

    @classmethod
    def measured(
        cls,
        step: int,
        loss: float,
        lr: float,
        grad_norm: float | None,
        samples: int,
        sample_digest: int,
        step_s: float,
        data_wait_s: float,
        wall: float,
        aux_loss: float | None = None,
    ) -> StepRow:
        """A row of the step loop's numbers, at metrics.csv's precision."""
        return cls(
            step,
            _sig(loss, ".8g"),
            _sig(lr, ".8g"),
            None if grad_norm is None else _sig(grad_norm, ".6g"),
            samples,
            sample_digest,
            _sig(step_s, ".5f"),
            _sig(data_wait_s, ".6f"),
            _sig(wall, ".6f"),
            None if aux_loss is None else _sig(aux_loss, ".8g"),
        )

    @classmethod
    def parse(cls, row: Mapping[str, Any]) -> StepRow:
        """A row from a mapping of numbers or strings (a metrics.csv line, a test's row)."""
        digest = _num(row.get("sample_digest"))
        samples = row.get("samples")
        return cls(
            int(float(row["step"])),
            _num(row.get("loss")),
            _num(row.get("lr")),
            _num(row.get("grad_norm")),
            samples if isinstance(samples, int) else _num(samples),
            None if digest is None else int(digest),
            _num(row.get("step_s")),
            _num(row.get("data_wait_s")),
            _num(row.get("wall")),
            _num(row.get("aux_loss")),
        )

    def csv(self) -> dict[str, Any]:
        """The row as metrics.csv writes it."""
        return {
            "step": self.step,
            "loss": "" if self.loss is None else f"{self.loss:.8g}",
            "lr": "" if self.lr is None else f"{self.lr:.8g}",
            "grad_norm": "" if self.grad_norm is None else f"{self.grad_norm:.6g}",
            "samples": "" if self.samples is None else self.samples,
            "sample_digest": "" if self.sample_digest is None else self.sample_digest,
            "step_s": "" if self.step_s is None else f"{self.step_s:.5f}",
            "data_wait_s": "" if self.data_wait_s is None else f"{self.data_wait_s:.6f}",
            "wall": "" if self.wall is None else f"{self.wall:.6f}",
            "aux_loss": "" if self.aux_loss is None else f"{self.aux_loss:.8g}",
        } | {f"tokens_{name}": n for name, n in (self.source_tokens or {}).items()}


def write_metrics(
    stage_dir: Path,
    rows: list[StepRow],
    keep_upto: int | None,
    sources: list[str] = (),  # type: ignore[assignment]
) -> None:
    """Append step rows to metrics.csv; on resume drop rows past the restored step first.
    ``sources``: weighted sources' names, a ``tokens_NAME`` column each after the others."""
    path = stage_dir / "metrics.csv"
    old: list[dict[str, str]] = []
    if keep_upto is not None and path.exists():
        with open(path, newline="") as fh:
            old = [r for r in csv.DictReader(fh) if int(r["step"]) <= keep_upto]
    mode = "w" if keep_upto is not None or not path.exists() else "a"
    with open(path, mode, newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=[*COLUMNS, *(f"tokens_{n}" for n in sources)])
        if mode == "w":
            w.writeheader()
            w.writerows(old)
        w.writerows(r.csv() for r in rows)
