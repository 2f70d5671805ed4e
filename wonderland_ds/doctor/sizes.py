"""Byte counts as the report prints them."""

from __future__ import annotations

GIB = 1 << 30


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"
