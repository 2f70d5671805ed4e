"""``wonderland convert CKPT``: a universal checkpoint through DeepSpeed's ``ds_to_universal``,
only from a verified checkpoint unless ``--unverified``."""

from __future__ import annotations

import argparse
from pathlib import Path

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK, Finding, Refused, render


def cmd_convert(args: argparse.Namespace) -> int:
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint.describe import resolve_tag_dir
    from wonderland_ds.checkpoint.universal import convert

    source = resolve_tag_dir(Path(args.checkpoint))
    v = ck.verify(source)
    if not v.complete and not args.unverified:
        raise Refused(
            v.findings
            + [
                Finding(
                    "convert",
                    "error",
                    "refusing to convert an unverified checkpoint",
                    "pass --unverified for plain DeepSpeed checkpoints you trust",
                    str(source),
                )
            ]
        )
    out, found = convert(source, Path(args.out) if args.out else source.parent)
    render(found, False)
    print(out)
    return EXIT_OK


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("convert", help="make a universal checkpoint (ds_to_universal)")
    p.add_argument("checkpoint", metavar="CKPT")
    p.add_argument("--out", help="folder for the universal checkpoint (default: beside it)")
    p.add_argument(
        "--unverified", action="store_true", help="convert a checkpoint without wonderland metadata"
    )
    p.set_defaults(func=cmd_convert)
