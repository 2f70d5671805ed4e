from __future__ import annotations

import os
import signal
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
    """Run the `wonderland` command as a user would (a separate process). Past ``timeout``
    the command and everything it started (launcher, ranks) are killed, and the failure
    carries the tail of each rank's log, so a hang says where it hung."""
    full_env = dict(os.environ, **(env or {}))
    with subprocess.Popen(
        [sys.executable, "-m", "wonderland_ds.cli.main", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        env=full_env,
        start_new_session=True,  # its own process group: the ranks go with it on a timeout
    ) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(
                f"wonderland {' '.join(args)}: still running after {timeout} s\n"
                f"{out[-3000:]}{err[-3000:]}{rank_logs(args)}"
            ) from None
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)


def rank_logs(args: tuple[str, ...], tail: int = 3000) -> str:
    """The end of every rank log under the command's ``--run-dir``, newest stage first."""
    if "--run-dir" not in args:
        return ""
    run_dir = Path(args[args.index("--run-dir") + 1])
    logs = sorted(run_dir.glob("stage*/logs/*.log"), key=lambda p: -p.stat().st_mtime)
    return "".join(f"\n--- {p}:\n{p.read_text(errors='replace')[-tail:]}" for p in logs)


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
