"""Megatron's indexed token format: ``PREFIX.bin`` (the tokens of every sequence, end to end)
and ``PREFIX.idx`` (``MMIDIDX``: version, dtype, sequence lengths, byte pointers, document
starts), as megatron-core's ``IndexedDatasetBuilder`` and Megatron-LM's
``preprocess_data.py`` write them.

The index is memory-mapped like the tokens: reading, checking and writing stay O(1) in
memory whatever the number of documents. This module reads and writes the format with numpy
alone (megatron-core needs torch and is a test dependency: the tests prove the two agree).

This module does not import torch: the front process checks data before launching.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np

from wonderland_ds.core.findings import Finding, Refused

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER = len(MAGIC) + 8 + 1 + 8 + 8
"""Bytes before the arrays: magic, version (<Q), dtype code (<B), sequences (<Q), documents
(<Q)."""
#: megatron-core's ``DType`` codes (``indexed_dataset.py``).
CODES: dict[int, str] = {
    1: "uint8",
    2: "int8",
    3: "int16",
    4: "int32",
    5: "int64",
    6: "float64",
    7: "float32",
    8: "uint16",
}
TOKEN_CODES = {name: code for code, name in CODES.items() if not name.startswith("float")}
CHUNK = 1 << 20
"""Index entries checked at a time (bounded memory for an index of any size)."""


def index_of(path: Path) -> Path:
    """The ``.idx`` beside a token file ``PREFIX.bin`` (it may not exist)."""
    return path.with_suffix(".idx")


@dataclass(frozen=True)
class Index:
    """One ``.idx``, memory-mapped: ``lengths`` (int32, tokens of each sequence),
    ``pointers`` (int64, byte offset of each sequence in the ``.bin``) and ``documents``
    (int64, the first sequence of each document, then the sequence count)."""

    path: Path
    dtype: str
    lengths: np.ndarray
    pointers: np.ndarray
    documents: np.ndarray

    @property
    def tokens(self) -> int:
        return int(self.lengths.sum(dtype=np.int64)) if len(self.lengths) else 0


def _bad(path: Path, what: str, fix: str, where: str) -> Refused:
    return Refused(Finding("data-index", "error", f"{path}: {what}", fix, str(path), where))


REWRITE = "rewrite it with `wonderland tokenize` or megatron-core's IndexedDatasetBuilder"


def read_index(path: Path, where: str) -> Index:
    """The index at ``path``; a file that is not a version-1 ``MMIDIDX`` index of integer
    tokens, or whose arrays do not fit its size, is refused naming what is wrong."""
    size = path.stat().st_size
    with open(path, "rb") as fh:
        head = fh.read(HEADER)
    if len(head) < HEADER or head[: len(MAGIC)] != MAGIC:
        raise _bad(path, "not a Megatron index (no MMIDIDX header)", REWRITE, where)
    (version,) = struct.unpack("<Q", head[9:17])
    if version != VERSION:
        raise _bad(path, f"index version {version}; only version {VERSION} is read", REWRITE, where)
    code = head[17]
    if code not in CODES:
        raise _bad(path, f"unknown dtype code {code}", REWRITE, where)
    if code not in TOKEN_CODES.values():
        raise _bad(
            path, f"dtype {CODES[code]}: token ids must be integers", "tokenize the text", where
        )
    sequences, documents = struct.unpack("<QQ", head[18:HEADER])
    want = HEADER + 4 * sequences + 8 * sequences + 8 * documents
    if size != want:
        raise _bad(
            path,
            f"{size} bytes, but its header's {sequences} sequences and {documents} documents"
            f" need {want}: truncated or not written to the end",
            REWRITE,
            where,
        )
    m = np.memmap(path, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(m, np.int32, sequences, HEADER)
    pointers = np.frombuffer(m, np.int64, sequences, HEADER + 4 * sequences)
    docs = np.frombuffer(m, np.int64, documents, HEADER + 12 * sequences)
    return Index(path, CODES[code], lengths, pointers, docs)


def check_index(index: Index, bin_path: Path, where: str) -> int:
    """The token count of ``bin_path`` read through ``index``, after checking that lengths
    are positive, pointers lay the sequences end to end from byte 0, document starts rise
    from 0 to the sequence count, and the ``.bin`` holds exactly those tokens."""
    item = np.dtype(index.dtype).itemsize
    n = len(index.lengths)
    expect = 0  # the byte offset the next sequence must start at
    for lo in range(0, n, CHUNK):
        lengths = index.lengths[lo : lo + CHUNK].astype(np.int64)
        pointers = index.pointers[lo : lo + CHUNK]
        if int(lengths.min()) < 0:
            i = lo + int(np.argmax(lengths < 0))
            raise _bad(index.path, f"sequence {i} has a negative length", REWRITE, where)
        starts = expect + np.concatenate([[0], np.cumsum(lengths[:-1] * item)])
        if not np.array_equal(starts, pointers):
            i = lo + int(np.argmax(starts != pointers))
            raise _bad(
                index.path,
                f"sequence {i} starts at byte {int(index.pointers[i])}, not"
                f" {int(starts[i - lo])} where the sequence before it ends",
                REWRITE,
                where,
            )
        expect = int(starts[-1] + lengths[-1] * item)
    docs = index.documents
    if len(docs) == 0 or int(docs[0]) != 0 or int(docs[-1]) != n:
        raise _bad(
            index.path,
            f"document starts must run from 0 to the sequence count {n}",
            REWRITE,
            where,
        )
    for lo in range(0, len(docs), CHUNK):
        block = docs[lo : lo + CHUNK + 1]
        if len(block) > 1 and bool((np.diff(block) < 0).any()):
            raise _bad(index.path, "document starts go backwards", REWRITE, where)
    size = bin_path.stat().st_size
    if size != expect:
        raise Refused(
            Finding(
                "data-size",
                "error",
                f"{bin_path} has {size} bytes but its index {index.path.name} describes"
                f" {expect} ({expect // item} {index.dtype} tokens): the .bin and .idx do not"
                " belong together, or one is truncated",
                "write the pair again in one go (or restore both from the same copy)",
                str(bin_path),
                where,
            )
        )
    return expect // item


class IndexWriter:
    """Appends documents to ``PREFIX.bin`` and their lengths to a side file, then writes the
    ``.idx`` from the side file in bounded memory. One sequence per document, as
    ``preprocess_data.py`` writes without sentence splitting."""

    def __init__(self, bin_fh: BinaryIO, lengths_fh: BinaryIO, dtype: str) -> None:
        self.bin, self.lengths, self.dtype = bin_fh, lengths_fh, dtype

    def add(self, docs: list[np.ndarray]) -> int:
        """Appends ``docs`` (one token array each); returns the tokens written."""
        if not docs:
            return 0
        lengths = np.fromiter((len(d) for d in docs), np.int32, len(docs))
        self.bin.write(np.concatenate(docs).astype(self.dtype, copy=False).tobytes())
        self.lengths.write(lengths.tobytes())
        return int(lengths.sum(dtype=np.int64))


def _chunks(path: Path, dtype: type[np.integer]) -> Iterator[np.ndarray]:
    item = np.dtype(dtype).itemsize
    with open(path, "rb") as fh:
        while block := fh.read(CHUNK * item):
            yield np.frombuffer(block, dtype)


def write_index(out: Path, lengths_path: Path, dtype: str) -> None:
    """Writes the ``.idx`` for the int32 lengths in ``lengths_path`` (one document each) to
    ``out``, durably, streaming the lengths twice (lengths, then pointers)."""
    item = np.dtype(dtype).itemsize
    n = lengths_path.stat().st_size // 4
    with open(out, "wb") as fh:
        fh.write(MAGIC + struct.pack("<Q", VERSION) + bytes([TOKEN_CODES[dtype]]))
        fh.write(struct.pack("<QQ", n, n + 1))
        for block in _chunks(lengths_path, np.int32):
            fh.write(block.tobytes())
        offset = 0
        for block in _chunks(lengths_path, np.int32):
            ends = offset + np.cumsum(block.astype(np.int64) * item)
            fh.write(np.concatenate([[offset], ends[:-1]]).astype(np.int64).tobytes())
            offset = int(ends[-1])
        for lo in range(0, n + 1, CHUNK):
            fh.write(np.arange(lo, min(n + 1, lo + CHUNK), dtype=np.int64).tobytes())
        fh.flush()
        os.fsync(fh.fileno())
