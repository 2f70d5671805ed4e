"""Findings: the one shape every check in wonderland_ds reports in.

A check is a pure function that returns findings; the CLI, the preflight and the tests all
share them. A finding names what is wrong (``message``), where (``file`` and ``path``, a JSON
path or a checkpoint file) and how to fix it (``fix``).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any, Literal

Severity = Literal["ok", "info", "warn", "error"]

#: Exit codes: 0 success, 2 refused input, 3 a health guard stopped the run, 4 stopped on a
#: signal or the job's time limit with everything trained in a complete checkpoint (resumable).
EXIT_OK = 0
EXIT_REFUSED = 2
EXIT_GUARD = 3
EXIT_STOPPED = 4
#: 5: stopped because the checkpoint storage is full (or failing): the newest complete
#: checkpoint is intact and a half-written one removed; continue once there is room.
EXIT_DISK = 5
#: 6: a rank left because a peer on another host stopped beating (a lost host); the front
#: restarts the stage without that host when ``--min-nodes`` allows.
EXIT_LOST = 6


@dataclass(frozen=True)
class Finding:
    """One result of one check."""

    rule: str
    """Stable rule name, e.g. ``batch-triangle`` or ``ckpt-optimizer-state``."""
    severity: Severity
    message: str
    """What is wrong (or what was verified, for ``ok``)."""
    fix: str = ""
    """How to fix it; empty for ``ok`` findings."""
    file: str = ""
    """The file the finding is about (config, hostfile, checkpoint file)."""
    path: str = ""
    """JSON path inside ``file`` (``zero_optimization.stage``), or a sub-file."""

    def to_dict(self) -> dict[str, str]:
        return asdict(self)

    def line(self) -> str:
        where = self.file + (f": {self.path}" if self.path else "") if self.file else self.path
        head = f"{self.severity.upper():5} [{self.rule}]"
        text = f"{head} {where}: {self.message}" if where else f"{head} {self.message}"
        return text + (f"\n      fix: {self.fix}" if self.fix else "")


class Refused(Exception):
    """A user mistake: printed as findings, exit code 2, never a traceback."""

    def __init__(self, findings: Iterable[Finding] | Finding | str, fix: str = "") -> None:
        if isinstance(findings, str):
            findings = [Finding("refused", "error", findings, fix)]
        elif isinstance(findings, Finding):
            findings = [findings]
        self.findings = list(findings)
        super().__init__("; ".join(f.message for f in self.findings))


class GuardStop(Exception):
    """A health guard stopped the run: exit code 3 with a report."""

    def __init__(self, findings: Iterable[Finding]) -> None:
        self.findings = list(findings)
        super().__init__("; ".join(f.message for f in self.findings))


class Stopped(Exception):
    """A stage stopped on a signal or the time limit: exit code 4. ``checkpoint``: the complete
    checkpoint that holds every trained step (None: the stage has none yet); ``step``: the
    global step it holds; ``saved``: whether the stop wrote it; ``agreed``: every rank stops
    at the same point (a training stage's stop), so they tear down together."""

    def __init__(
        self,
        request: Any,
        step: int | None = None,
        checkpoint: str | None = None,
        saved: bool = False,
        agreed: bool = False,
    ) -> None:
        self.request, self.step, self.checkpoint, self.saved = request, step, checkpoint, saved
        self.agreed = agreed
        super().__init__(f"stopped on {request.describe()}")


def has_errors(findings: Iterable[Finding]) -> bool:
    return any(f.severity == "error" for f in findings)


def render(findings: list[Finding], as_json: bool, stream=None) -> None:
    """Print findings as lines (errors first) or as a JSON list."""
    stream = stream or sys.stdout
    if as_json:
        json.dump([f.to_dict() for f in findings], stream, indent=2)
        stream.write("\n")
        return
    order = {"error": 0, "warn": 1, "info": 2, "ok": 3}
    for f in sorted(findings, key=lambda f: order[f.severity]):
        print(f.line(), file=stream)
