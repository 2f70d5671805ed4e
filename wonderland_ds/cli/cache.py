"""``wonderland cache SOURCE --out DIR``: a task's dataset written once as verified,
memory-mappable tensor shards."""

from __future__ import annotations

import argparse
import json

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK, render


def cmd_cache(args: argparse.Namespace) -> int:
    from pathlib import Path

    from wonderland_ds.data import builtin, cache

    task = builtin.load(args.source).materialize()
    index, found = cache.write(task, Path(args.out))
    if args.json:
        summary = {k: index[k] for k in ("task", "fingerprint", "rows")}
        print(
            json.dumps(
                {
                    **summary,
                    "path": str(Path(args.out).resolve()),
                    "shards": sum(len(v) for v in index["splits"].values()),
                },
                indent=2,
            )
        )
    else:
        render(found, False)
        print(f"fingerprint {index['fingerprint']}")
    return EXIT_OK


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("cache", help="write a dataset once as verified tensor shards")
    p.add_argument(
        "source",
        metavar="SOURCE",
        help="a built-in task (digits, pylm) or module:function returning a Task",
    )
    p.add_argument("--out", required=True, help="cache folder (created; never overwritten)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_cache)
