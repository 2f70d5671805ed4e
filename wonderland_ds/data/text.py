"""Raw text as teams keep it, read one document at a time: jsonl (one JSON object a line, the
text under a key; ``.jsonl.gz`` too), parquet (a string column, read a row group's batch at a
time through pyarrow) and plain text (a ``.txt`` file is one document).

Every reader streams: memory holds one batch of documents, whatever the file's size. Bad
input is a refusal naming the file, the line or row, and the fix.
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterator
from pathlib import Path
from typing import IO

from wonderland_ds.core.findings import Finding, Refused

SUFFIXES = (".jsonl", ".json", ".jsonl.gz", ".json.gz", ".parquet", ".txt")
WHERE = "wonderland tokenize INPUT"


def kind(path: Path) -> str:
    name = path.name.lower()
    for suffix in SUFFIXES:
        if name.endswith(suffix):
            return suffix.split(".")[1]  # jsonl, json, parquet, txt
    raise Refused(
        Finding(
            "text-format",
            "error",
            f"{path}: not a text file this command reads (its name ends in none of"
            f" {', '.join(SUFFIXES)})",
            "give jsonl, parquet or txt files (rename a jsonl file to end in .jsonl)",
            str(path),
            WHERE,
        )
    )


def _bad(path: Path, where: str, what: str, fix: str) -> Refused:
    return Refused(
        Finding("text-record", "error", f"{path} {where}: {what}", fix, str(path), WHERE)
    )


def _open(path: Path) -> IO[str]:
    if path.name.lower().endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _jsonl(path: Path, key: str, skip: int) -> Iterator[str]:
    seen = 0
    with _open(path) as fh:
        for number, line in enumerate(fh, 1):
            if not line.strip():
                continue
            seen += 1
            if seen <= skip:
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                raise _bad(
                    path, f"line {number}", f"not JSON ({exc.msg})", "fix the line"
                ) from None
            text = record.get(key) if isinstance(record, dict) else None
            if not isinstance(text, str):
                keys = ", ".join(sorted(record)) if isinstance(record, dict) else "none"
                raise _bad(
                    path,
                    f"line {number}",
                    f"no string under {key!r} (keys: {keys})",
                    "name the text's key with --text-key",
                )
            yield text


def _parquet(path: Path, key: str, skip: int) -> Iterator[str]:
    import pyarrow.parquet as pq

    try:
        pf = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow's errors for a file that is not parquet
        raise _bad(path, "", f"not a parquet file ({exc})", "give a parquet file") from None
    names = pf.schema_arrow.names
    if key not in names:
        raise _bad(
            path, "", f"no column {key!r} (columns: {', '.join(names)})", "name it with --text-key"
        )
    row = 0
    for batch in pf.iter_batches(batch_size=1024, columns=[key]):
        column = batch.column(0)
        if row + len(column) <= skip:
            row += len(column)
            continue
        for i, text in enumerate(column.to_pylist()):
            if row + i < skip:
                continue
            if not isinstance(text, str):
                raise _bad(
                    path, f"row {row + i}", f"{key!r} is {text!r}, not a string", "fix the row"
                )
            yield text
        row += len(column)


def _txt(path: Path, skip: int) -> Iterator[str]:
    if skip < 1:
        with open(path, encoding="utf-8") as fh:
            yield fh.read()


def documents(path: Path, key: str, skip: int = 0) -> Iterator[str]:
    """The documents of ``path`` in order, after its first ``skip``."""
    try:
        match kind(path):
            case "parquet":
                yield from _parquet(path, key, skip)
            case "txt":
                yield from _txt(path, skip)
            case _:
                yield from _jsonl(path, key, skip)
    except UnicodeDecodeError as exc:
        raise _bad(
            path, f"at byte {exc.start}", "not UTF-8 text", "re-encode it as UTF-8"
        ) from None
