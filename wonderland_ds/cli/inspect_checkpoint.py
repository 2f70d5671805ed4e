"""``wonderland inspect CKPT``: what a checkpoint holds and lacks, checksums verified; never
runs code from it. (Not named ``inspect.py``: run as a script from this folder, that would
shadow the standard library's ``inspect``.)"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK, EXIT_REFUSED, has_errors, render


def cmd_inspect(args: argparse.Namespace) -> int:
    from wonderland_ds.checkpoint.describe import describe

    info, found = describe(Path(args.checkpoint))
    if args.json:
        print(
            json.dumps(
                {"checkpoint": info, "findings": [f.to_dict() for f in found]},
                indent=2,
                default=str,
            )
        )
    else:
        for key in (
            "path",
            "written_by",
            "complete",
            "stage",
            "global_step",
            "skipped_steps",
            "warmup_progress",
            "has_optimizer_state",
            "has_scheduler_state",
            "world_size",
            "zero_stage",
            "precision",
            "loss_scale",
            "data",
            "versions",
            "deepspeed_version",
            "optimizer_state_files",
            "client_state_keys",
        ):
            if key in info:
                print(f"{key:>22}: {info[key]}")
        render(found, False)
    return EXIT_REFUSED if has_errors(found) else EXIT_OK


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("inspect", help="what a checkpoint holds and lacks (never runs its code)")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_inspect)
