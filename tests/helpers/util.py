from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def same(a, b) -> bool:
    """Loaded checkpoint contents are equal: tensors by torch.equal (and dtype, shape),
    containers item by item, plain objects (DeepSpeed's LossScaler) by their attributes."""
    import torch

    if torch.is_tensor(a):
        return (
            torch.is_tensor(b) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if hasattr(a, "__dict__") and not isinstance(a, type):
        return type(a) is type(b) and same(vars(a), vars(b))
    return a == b


def wonderland(*args: str, timeout: int = 240, env: dict[str, str] | None = None):
    """Run the `wonderland` command as a user would (a separate process)."""
    full_env = dict(os.environ, **(env or {}))
    return subprocess.run(
        [sys.executable, "-m", "wonderland_ds.cli.main", *args],
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
