"""Sub-commands beyond ``check``; filled in by the stage engine."""

from __future__ import annotations

import argparse


def add_commands(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    return None
