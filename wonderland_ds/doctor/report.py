"""The doctor's report: one line a finding and a summary, or one JSON object (``--json``)."""

from __future__ import annotations

import json
import platform
import time
from typing import TextIO

from wonderland_ds.core.findings import Finding


def summary(findings: list[Finding]) -> dict[str, int]:
    return {s: sum(f.severity == s for f in findings) for s in ("ok", "info", "warn", "error")}


def write(findings: list[Finding], code: int, t0: float, as_json: bool, stdout: TextIO) -> None:
    """Print the report; ``t0`` (``time.perf_counter``) is when the checks began."""
    counts = summary(findings)
    if as_json:
        json.dump(
            {
                "host": platform.node(),
                "checks": [f.to_dict() for f in findings],
                "summary": counts,
                "exit_code": code,
                "seconds": round(time.perf_counter() - t0, 2),
            },
            stdout,
            indent=2,
        )
        stdout.write("\n")
        return
    for f in findings:
        print(f.line(), file=stdout)
    print(
        f"doctor: {counts['ok']} ok, {counts['info']} info, {counts['warn']} warning(s),"
        f" {counts['error']} failure(s) in {time.perf_counter() - t0:.1f} s",
        file=stdout,
    )
