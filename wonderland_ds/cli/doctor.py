"""``wonderland doctor``: this machine, DeepSpeed, the hosts and the disk, checked before a run."""

from __future__ import annotations

import argparse

from wonderland_ds.cli.common import Commands


def cmd_doctor(args: argparse.Namespace) -> int:
    from wonderland_ds.doctor import doctor

    ops = None
    if args.prebuild is not None:
        ops = [o.strip() for o in args.prebuild.split(",") if o.strip()]
    return doctor.main(args.hostfile, args.checkpoint, args.run_dir, ops, args.json, args.config)


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("doctor", help="check this machine, DeepSpeed, hosts and disk before a run")
    p.add_argument("--hostfile", help="check every host in it is reachable by ssh")
    p.add_argument("--config", help="a wonderland config: its timeout and the ops it needs")
    p.add_argument(
        "--checkpoint", help="compare the versions it was saved with to the installed ones"
    )
    p.add_argument("--run-dir", help="where checkpoints will be written (free space; default .)")
    p.add_argument(
        "--prebuild",
        nargs="?",
        const="",
        metavar="OPS",
        help="build DeepSpeed's JIT ops now (default: the ones a stage needs here;"
        " or a comma-separated list of op names)",
    )
    p.add_argument("--json", action="store_true", help="print the checks as a JSON object")
    p.set_defaults(func=cmd_doctor)
