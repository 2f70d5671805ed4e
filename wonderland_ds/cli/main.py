"""The ``wonderland`` command: one sub-command per concern, all refusals exit 2.

Each command is a module of this folder with its ``add_parser``; heavy imports (torch,
deepspeed) happen inside the commands that need them, so ``check`` and ``status`` answer in
well under a second.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence

from wonderland_ds.cli import (
    cache,
    check,
    configs,
    convert,
    doctor,
    inspect_checkpoint,
    pipeline,
    status,
    tokenize,
    train,
)
from wonderland_ds.cli import eval as evaluate  # named so as not to hide the builtin
from wonderland_ds.core.findings import (
    EXIT_GUARD,
    EXIT_REFUSED,
    EXIT_STOPPED,
    GuardStop,
    Refused,
    Stopped,
    render,
)

#: In the order ``wonderland --help`` lists them.
COMMANDS = [check, configs, cache, doctor, train, pipeline, status, inspect_checkpoint]
COMMANDS += [convert, evaluate, tokenize]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="wonderland",
        description="Run and guard the Wonderland pipeline's stages on DeepSpeed.",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in COMMANDS:
        command.add_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.invoked = list(sys.argv[1:] if argv is None else argv)  # for hints naming it
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except Refused as exc:
        if getattr(args, "json", False):
            json.dump({"refused": [f.to_dict() for f in exc.findings]}, sys.stdout, indent=2)
            print()
        else:
            render(exc.findings, False, sys.stderr)
            print("refused: nothing was started, written or deleted", file=sys.stderr)
        return EXIT_REFUSED
    except GuardStop as exc:
        render(exc.findings, False, sys.stderr)
        return EXIT_GUARD
    except Stopped as exc:
        print(f"stopped on {exc.request.describe()}: nothing was started", file=sys.stderr)
        return EXIT_STOPPED
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
