"""``wonderland tokenize INPUT... --tokenizer MODEL_DIR --out PREFIX``: raw text to Megatron's
indexed files, streaming and resumable (``data/tokenize.py``)."""

from __future__ import annotations

import argparse
import time

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK
from wonderland_ds.launch.flags import positive


def cmd_tokenize(args: argparse.Namespace) -> int:
    from wonderland_ds.data import tokenize

    t0 = time.perf_counter()
    state = tokenize.run(args.inputs, args.tokenizer, args.out, args.text_key, args.batch_size)
    seconds = time.perf_counter() - t0
    print(
        f"wrote {args.out}.bin and {args.out}.idx: {state.documents:,} documents,"
        f" {state.tokens:,} {state.dtype} tokens from {len(state.inputs)} files"
        f" ({state.text_bytes / 1e6:.1f} MB of text) in {seconds:.1f} s"
    )
    return EXIT_OK


def add_parser(sub: Commands) -> None:
    p = sub.add_parser(
        "tokenize",
        help="raw text (jsonl, parquet, txt) to Megatron's .bin/.idx with the model's tokenizer",
        description="Tokenize documents with the model's Hugging Face fast tokenizer, EOS after"
        " each, into PREFIX.bin and PREFIX.idx (Megatron's indexed format; uint16 for"
        " vocabularies up to 65,536, else int32). A stopped run goes on when started again with"
        " the same command; the same inputs give the same bytes.",
    )
    p.add_argument(
        "inputs",
        nargs="+",
        metavar="INPUT",
        help="files or globs: .jsonl (.jsonl.gz), .parquet, .txt (one document a file)",
    )
    p.add_argument("--tokenizer", required=True, metavar="MODEL_DIR", help="the model's folder")
    p.add_argument("--out", required=True, metavar="PREFIX", help="writes PREFIX.bin, PREFIX.idx")
    p.add_argument("--text-key", default="text", help="the text's key (jsonl) or column (parquet)")
    p.add_argument(
        "--batch-size",
        type=positive,
        default=1000,
        help="documents tokenized, written and recorded at a time (default 1000; a batch also"
        " ends at 2 million characters)",
    )
    p.set_defaults(func=cmd_tokenize)
