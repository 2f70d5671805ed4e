from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def wonderland(*args: str, timeout: int = 240, env: dict[str, str] | None = None):
    """Run the `wonderland` command as a user would (a separate process)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "wonderland_ds.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=REPO,
        env=full_env,
    )


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every path under root with its size and mtime: 'nothing was written' is equality."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(root.rglob("*"))
    }


def losses(stage_dir: Path) -> dict[int, float]:
    import csv

    with open(stage_dir / "metrics.csv", newline="") as fh:
        return {int(r["step"]): float(r["loss"]) for r in csv.DictReader(fh)}


def digests(stage_dir: Path) -> dict[int, int]:
    """Per step, the digest of the sample indices the ranks really consumed (all-reduced)."""
    import csv

    with open(stage_dir / "metrics.csv", newline="") as fh:
        return {int(r["step"]): int(r["sample_digest"]) for r in csv.DictReader(fh)}
