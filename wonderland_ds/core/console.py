"""Where a rank's output goes: all of it to its log file, ``RUN/stageN/logs/rankR.log``; to
the console only the engine's own lines.

The console shows rank 0's ``[wonderland]`` lines, progress, findings and tables, and any
rank's ``[wonderland]`` and ``FAULT INJECTED`` lines. DeepSpeed's per-rank INFO and WARNING
lines, Python warnings, C++ messages (gloo, NCCL) and tracebacks go to the log file only
(the front names the first rank that failed and where its log is). ``--verbose`` (the
``WONDERLAND_VERBOSE`` variable on the ranks) shows everything as well.

Installed by ``train.py`` before torch and DeepSpeed are imported, so their loggers write
through it; the process's file descriptors 1 and 2 point at the log file, so what C++ code
prints lands there too.
"""

from __future__ import annotations

import io
import os
import sys
import time
from pathlib import Path
from typing import TextIO

#: Lines every rank shows on the console.
EVERY_RANK = ("[wonderland]", "FAULT INJECTED")
#: Lines rank 0 also shows: findings (core.findings.Finding.line) and the refusal's last line.
RANK0 = ("ERROR ", "WARN  ", "OK    ", "INFO  ", "      fix:", "refused:", "\r", "\x1b[")
VERBOSE_ENV = "WONDERLAND_VERBOSE"


def log_dir(stage_dir: Path) -> Path:
    return stage_dir / "logs"


class Routed(io.TextIOBase):
    """A text stream that writes everything to ``log`` and the engine's lines to
    ``console``. A ``write`` that starts a line decides for the whole line, and for every
    further line in the same call (a table printed at once)."""

    def __init__(self, log: TextIO, console: TextIO, main: bool, verbose: bool) -> None:
        self.log, self.console, self.main, self.verbose = log, console, main, verbose
        self.at_line_start, self.passing = True, False

    def _shows(self, text: str) -> bool:
        return text.startswith(EVERY_RANK) or (self.main and text.startswith(RANK0))

    def write(self, text: str) -> int:
        if not text:
            return 0
        self.log.write(text)
        if self.at_line_start:
            self.passing = self.verbose or self._shows(text)
        if self.passing:
            self.console.write(text)
            if text.endswith("\n"):
                self.console.flush()
        self.at_line_start = text.endswith("\n")
        return len(text)

    def flush(self) -> None:
        self.log.flush()
        self.console.flush()

    def isatty(self) -> bool:
        return self.main and self.console.isatty()

    def fileno(self) -> int:
        return self.log.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return "utf-8"

    def writable(self) -> bool:
        return True


def route(stage_dir: Path, rank: int) -> Path | None:
    """Send this process's output to its log file, the engine's lines to the console as well.
    Returns the log file (None where it cannot be opened: the output stays as it was)."""
    path = log_dir(stage_dir) / f"rank{rank}.log"
    new = [p for p in (path.parent, *path.parent.parents) if not p.exists()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        log = open(path, "a", buffering=1, encoding="utf-8", errors="replace")
    except OSError:
        return None
    sys.stdout.flush()
    sys.stderr.flush()
    console_out = open(os.dup(1), "w", buffering=1, encoding="utf-8", errors="replace")
    console_err = open(os.dup(2), "w", buffering=1, encoding="utf-8", errors="replace")
    log.write(f"== rank {rank}, pid {os.getpid()}, {time.strftime('%Y-%m-%dT%H:%M:%S%z')}\n")
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    verbose = os.environ.get(VERBOSE_ENV, "") not in ("", "0")
    sys.stdout = Routed(log, console_out, rank == 0, verbose)
    sys.stderr = Routed(log, console_err, rank == 0, verbose)
    _ROUTED[:] = [path, *new]
    return path


#: The routed log file and the folders ``route`` created for it (deepest first).
_ROUTED: list[Path] = []


def drop_log() -> None:
    """A refused stage writes nothing: remove this rank's log file, then the log folder and the
    stage folder when they are empty (whichever rank goes last empties them; a folder holding
    anything stays), and the run folder if this rank made it and it is empty."""
    if not _ROUTED:
        return
    path, *made = _ROUTED
    path.unlink(missing_ok=True)
    logs = path.parent
    for folder in (logs, logs.parent, *(p for p in made if p not in (logs, logs.parent))):
        try:
            folder.rmdir()
        except OSError:
            break  # another rank's log is still there, or the folder holds something else


def launch_rank(env: dict[str, str] | os._Environ[str] | None = None) -> int | None:
    """This process's rank as its launcher gave it, before the process group exists."""
    env = os.environ if env is None else env
    for key in ("RANK", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK", "PMI_RANK"):
        value = env.get(key)
        if value is not None and value.isdigit():
            if key == "SLURM_PROCID" and "SLURM_STEP_NUM_TASKS" not in env:
                continue  # the batch script's own variables, not a task's
            return int(value)
    return None
