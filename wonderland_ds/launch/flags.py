"""The flags of a stage, shared by ``wonderland train`` and the per-rank ``train.py``."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from wonderland_ds.config import shipped
from wonderland_ds.config.shipped import DEFAULT_CONFIG, DEFAULT_HOSTFILE
from wonderland_ds.training import faults

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions

__all__ = ["DEFAULT_CONFIG", "DEFAULT_HOSTFILE", "add_stage_flags"]


def positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be >= 1")
    return value


def non_negative(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} must be >= 0")
    return value


def stage_number(text: str) -> int:
    value = positive(text)
    if value > 18:
        raise argparse.ArgumentTypeError(f"stage {value} does not exist (stages are 1..18)")
    return value


def fault_spec(text: str) -> str:
    try:
        faults.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_stage_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stage", type=stage_number, required=True, help="stage number (15, 16, 17)")
    p.add_argument(
        "--config",
        type=shipped.config_path,
        default=str(DEFAULT_CONFIG),
        help="DeepSpeed JSON config with a 'wonderland' section, a path or a shipped config's"
        " name (`wonderland configs`; default: %(default)s)",
    )
    # Internal: the plan `wonderland train` decided, and what it verified, for rank 0 (stage.py).
    p.add_argument("--verified", help=argparse.SUPPRESS)
    p.add_argument(
        "--run-dir",
        help="run directory (default: the run of --resume, else a new runs/run-TIMESTAMP)",
    )
    p.add_argument(
        "--resume",
        metavar="PATH|auto",
        help="checkpoint to resume (folder, its parent, or 'auto': newest complete)",
    )
    p.add_argument(
        "--optimizer-state",
        action="store_true",
        help="require optimizer state in the checkpoint (always required for stage 16)",
    )
    p.add_argument(
        "--scheduler-state",
        action="store_true",
        help="require LR-scheduler state in the checkpoint (always for stage 16)",
    )
    p.add_argument(
        "--grad-acc-steps",
        type=positive,
        help="override gradient_accumulation_steps; train_batch_size is re-derived",
    )
    p.add_argument("--steps", type=positive, help="optimizer steps for this stage")
    p.add_argument("--seed", type=non_negative, help="override wonderland.seed")
    p.add_argument(
        "--min-warmup-steps",
        type=non_negative,
        help="override wonderland.min_warmup_steps (stage-16 preflight)",
    )
    p.add_argument(
        "--allow-seed-change",
        action="store_true",
        help="accept a data seed different from the checkpoint's (recorded)",
    )
    p.add_argument(
        "--allow-data-change",
        action="store_true",
        help="accept training data different from the checkpoint's (recorded)",
    )
    p.add_argument(
        "--task",
        metavar="NAME|MODULE:FUNCTION",
        help="task of this stage: built-in name or module:function (overrides wonderland.task)",
    )
    p.add_argument("--baseline", help="stage 17: baseline checkpoint (default: stage 15's newest)")
    p.add_argument(
        "--out",
        metavar="DIR",
        help="stage 17: folder for report.json, report.md and the plots (default RUN_DIR/stage17)",
    )
    p.add_argument(
        "--fault",
        type=fault_spec,
        default=os.environ.get("WONDERLAND_FAULT") or None,
        help="fault injection (default: $WONDERLAND_FAULT), see README",
    )
    p.add_argument(
        "--trust-checkpoint",
        action="store_true",
        help="resume a checkpoint whose files would run code when unpickled (recorded)",
    )
    p.add_argument("--json", action="store_true", help="print the preflight report as JSON")


def overrides(args: argparse.Namespace | StageOptions) -> set[str]:
    """The ``--allow-*`` and ``--trust-checkpoint`` switches that are on."""
    return {
        name
        for name in ("allow-seed-change", "allow-data-change", "trust-checkpoint")
        if getattr(args, name.replace("-", "_"))
    }
