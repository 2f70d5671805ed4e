"""Third-party messages known to be harmless here, filtered once at the source, each with why.

Everything else is still shown. Installed by ``train.py`` on every rank before DeepSpeed is
imported; the list is the only place to add one.
"""

from __future__ import annotations

import logging
import re
import warnings

#: (category, message regex, why it is harmless).
WARNINGS: tuple[tuple[type[Warning], str, str], ...] = (
    (
        FutureWarning,
        r"`torch\.distributed\.all_gather_into_tensor` is deprecated",
        "DeepSpeed's own ZeRO code calls it (torch 2.13 renamed it); nothing a user can change",
    ),
)

#: (logger name, message regex, why it is harmless).
LOG_LINES: tuple[tuple[str, str, str], ...] = (
    (
        "DeepSpeed",
        r"Attempting to get learning rate from scheduler before it has started",
        "DeepSpeed's engine asks for the LR while it builds the scheduler, before step 0",
    ),
)


class _Drop(logging.Filter):
    def __init__(self, pattern: str) -> None:
        super().__init__()
        self.pattern = re.compile(pattern)

    def filter(self, record: logging.LogRecord) -> bool:
        return not self.pattern.search(record.getMessage())


def install() -> None:
    """Filter the listed warnings and log lines in this process."""
    for category, pattern, _ in WARNINGS:
        warnings.filterwarnings("ignore", message=pattern, category=category)
    for name, pattern, _ in LOG_LINES:
        logging.getLogger(name).addFilter(_Drop(pattern))
