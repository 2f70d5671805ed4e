"""Token files read where they lie: flat files of raw little-endian tokens, as nanoGPT and
OLMo-core write them (uint16 for vocabularies under 65,536, else uint32 or int32), and
Megatron's indexed files (``PREFIX.bin`` with ``PREFIX.idx`` beside it: ``indexed.py``),
whose dtype and token count come from the index.

Each file is memory-mapped; nothing is copied, cached or joined. A sample is a window of
``seq_len`` consecutive tokens inside one file (windows never cross files); sample ``i`` of a
set of files is found from a per-file count, so memory is O(files), not O(tokens). Tokens are
widened to int64 only for the micro-batch being built.

Labels follow ``transformers``' convention: ``labels`` equal ``input_ids`` (the loss shifts
them), with :data:`IGNORE` where a held-out file's last, shorter window is padded.

The fingerprint that resumes compare is cheap and independent of size: file names, sizes,
dtype, seq_len and the sha256 of a few blocks at fixed places of each file (start, end and
evenly between), so a change of size or a flipped byte inside a sampled block is caught
without reading a terabyte.

This module does not import torch: the front process checks data before launching.
"""

from __future__ import annotations

import glob
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data import indexed
from wonderland_ds.data.blend import Blend, Source
from wonderland_ds.data.sampler import GlobalSampler

DTYPES: dict[str, type[np.integer]] = {
    "uint8": np.uint8,
    "int8": np.int8,
    "int16": np.int16,
    "uint16": np.uint16,
    "int32": np.int32,
    "uint32": np.uint32,
    "int64": np.int64,
}
FLAT_DTYPE = "uint16"
"""A flat file's dtype when ``data.dtype`` is not given."""
IGNORE = -100
"""The label of a padded position (PyTorch's and ``transformers``' ignore index)."""
FINGERPRINT_BLOCKS = 16
"""Blocks hashed per file for the fingerprint (the first and last among them)."""
BLOCK_BYTES = 1 << 16
CHANGED = (1 << 40) - 1
"""The offset in a refused place (``file << 40 | offset``) that means: the file changed."""


def expand(patterns: list[str], where: str) -> list[Path]:
    """Files named by ``patterns`` (paths or globs), in the given order, each glob sorted.
    A Megatron prefix ``P`` (``P.bin`` and ``P.idx``) names ``P.bin``; a glob's ``.idx``
    files beside their ``.bin`` are the index, not data. A pattern that matches nothing is a
    refusal naming it."""
    files: list[Path] = []
    missing = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            hits = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)))
            hits = [p for p in hits if p.is_file()]
            bins = set(hits)
            hits = [p for p in hits if not (p.suffix == ".idx" and p.with_suffix(".bin") in bins)]
        else:
            p = Path(os.path.expanduser(pattern))
            prefix = Path(str(p) + ".bin")
            if not p.is_file() and prefix.is_file() and indexed.index_of(prefix).is_file():
                p = prefix
            hits = [p] if p.is_file() else []
        if not hits:
            missing.append(pattern)
        files += hits
    if missing:
        raise Refused(
            [
                Finding(
                    "data-missing",
                    "error",
                    f"token file {m!r} does not exist"
                    + (" (the glob matches no file)" if glob.has_magic(m) else ""),
                    "fix the path (relative paths are taken from the current directory)",
                    m,
                    where,
                )
                for m in missing
            ]
        )
    return files


def _stat(path: Path) -> tuple[int, int, int]:
    st = path.stat()
    return st.st_size, st.st_mtime_ns, st.st_ino


@dataclass(frozen=True)
class TokenFile:
    path: Path
    tokens: int
    dtype: str = FLAT_DTYPE
    index: Path | None = None
    """The Megatron ``.idx`` this file is read through (None: a flat file)."""


def open_files(paths: list[Path], dtype: str | None, where: str) -> list[TokenFile]:
    """Each file's token count and dtype. A file with a ``.idx`` beside it is read through
    the index, which is checked against the ``.bin`` and against ``dtype`` when one is given;
    a flat file is of ``dtype`` (default uint16), and a size that is not a whole number of
    its tokens is refused."""
    out, bad = [], []
    for path in paths:
        idx = indexed.index_of(path)
        if path.suffix == ".bin" and idx.is_file():
            index = indexed.read_index(idx, where)
            if dtype is not None and dtype != index.dtype:
                bad.append(
                    Finding(
                        "data-dtype",
                        "error",
                        f"data.dtype is {dtype} but the index {idx} says its tokens are"
                        f" {index.dtype}",
                        "leave data.dtype out (an indexed file's dtype comes from its index),"
                        " or set it to the index's",
                        str(idx),
                        "wonderland.data.dtype",
                    )
                )
                continue
            out.append(TokenFile(path, indexed.check_index(index, path, where), index.dtype, idx))
            continue
        flat = dtype or FLAT_DTYPE
        itemsize = np.dtype(DTYPES[flat]).itemsize
        size = path.stat().st_size
        if size % itemsize:
            bad.append(
                Finding(
                    "data-size",
                    "error",
                    f"{path} has {size} bytes, not a multiple of {flat}'s {itemsize}:"
                    " not a flat file of this dtype (or truncated)",
                    f"check data.dtype ({flat}) against how the file was written",
                    str(path),
                    where,
                )
            )
        out.append(TokenFile(path, size // itemsize, flat))
    if bad:
        raise Refused(bad)
    return out


class TokenData:
    """Windows of ``seq_len`` tokens over a list of token files, read in place.

    ``pad_tail``: a file's last window shorter than ``seq_len`` (at least 2 tokens) is a
    sample too, padded with :data:`IGNORE` labels (held-out sets count every token)."""

    def __init__(self, files: list[TokenFile], seq_len: int, pad_tail: bool = False) -> None:
        self.files, self.seq_len, self.pad_tail = files, seq_len, pad_tail
        self.dtype = ",".join(sorted({f.dtype for f in files}))
        """The files' dtype (several, comma-joined, where indexed files differ)."""
        counts = []
        for f in files:
            n = f.tokens // seq_len
            if pad_tail and f.tokens % seq_len >= 2:
                n += 1
            counts.append(n)
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._maps: list[np.ndarray | None] = [None] * len(files)
        self.vocab: int | None = None
        """Token ids must lie in ``[0, vocab)`` (set once the model's vocabulary is known):
        :meth:`check` and :meth:`take` refuse any other, naming file, offset and id."""
        self.checked_ahead = False
        """The step loop checks every step's samples before it reads them (:meth:`check`, one
        step ahead on every rank): :meth:`take` leaves the check to it, since the loader reads
        several steps at once and only the step's own check stops every rank together."""
        self._stats = [_stat(f.path) for f in files]
        self.where = ""
        """The config path of these files (``wonderland.data.train``), for findings."""
        self.sources: list[Source] = []
        """Named weighted sources (``blended``): the stream interleaves them by weight.
        Empty: one source, every sample equally likely."""

    @classmethod
    def blended(cls, parts: list[tuple[str, float, list[TokenFile]]], seq_len: int) -> TokenData:
        """One dataset over the files of named sources ``(name, weight, files)``, each source
        a contiguous range of samples; weights normalized."""
        files = [f for _, _, fs in parts for f in fs]
        data = cls(files, seq_len)
        total = sum(w for _, w, _ in parts)
        at = 0
        for name, weight, fs in parts:
            first = int(data._starts[at])
            at += len(fs)
            data.sources.append(Source(name, weight / total, first, int(data._starts[at]) - first))
        return data

    def sampler(self, seed: int) -> GlobalSampler | Blend:
        """The stream's order: the blend of the sources, or one seeded permutation."""
        if self.sources:
            return Blend(self.sources, seed)
        return GlobalSampler(len(self), seed)

    @property
    def layout(self) -> str:
        """The sources' names, weights and sizes ("" for one source), part of the
        fingerprint: another weight is another stream."""
        if not self.sources:
            return ""
        return json.dumps([[s.name, round(s.weight, 9), s.size] for s in self.sources])

    def __len__(self) -> int:
        return int(self._starts[-1])

    @property
    def tokens_per_sample(self) -> int:
        return self.seq_len

    @property
    def row_bytes(self) -> int:
        return 2 * 8 * self.seq_len  # int64 inputs and labels of one sample

    def _map(self, i: int) -> np.ndarray:
        m = self._maps[i]
        if m is None:
            f = self.files[i]
            m = np.memmap(f.path, dtype=DTYPES[f.dtype], mode="r", shape=(f.tokens,))
            m = self._maps[i] = np.asarray(m)  # a plain view: no memmap subclass per read
        return m

    def locate(self, sample: int, column: int = 0) -> tuple[int, int]:
        """(file index, token offset in that file) of token ``column`` of sample ``sample``."""
        f = int(np.searchsorted(self._starts, sample, side="right") - 1)
        return f, int((sample - self._starts[f]) * self.seq_len + column)

    def token_at(self, file: int, offset: int) -> int:
        return int(self._map(file)[offset])

    def describe(self, place: int) -> Finding:
        """The finding of a refused place (``file << 40 | offset``), read here: every rank
        names the same file, offset and id."""
        f, offset = place >> 40, place & CHANGED
        if offset == CHANGED:
            return self.changed(f) or Finding(
                "data-changed", "error", f"{self.files[f].path} changed on another rank's host"
            )
        return self.bad_token(f, offset)

    def bad_token(self, file: int, offset: int) -> Finding:
        """The finding for an out-of-vocabulary id at ``offset`` of file ``file``."""
        path = self.files[file].path
        return Finding(
            "data-token-range",
            "error",
            f"token id {self.token_at(file, offset)} at token offset {offset} of {path} is"
            f" outside the model's vocabulary [0, {self.vocab}): the stage stopped before the"
            " model read it",
            "fix the file (tokenize with the model's tokenizer; check data.dtype), then continue"
            " with --resume auto (with --allow-data-change if the preflight sees the change)",
            str(path),
            self.where,
        )

    def check(self, idx: np.ndarray) -> tuple[Finding, int] | None:
        """Samples ``idx`` before they are read for training: a file changed since it was
        opened, or a token id outside the vocabulary. (finding, its place ``file << 40 |
        offset``, offset :data:`CHANGED` for a changed file), or None when they are fine."""
        idx = np.asarray(idx, dtype=np.int64)
        files = np.searchsorted(self._starts, idx, side="right") - 1
        for f in np.unique(files):
            changed = self.changed(int(f))
            if changed is not None:
                return changed, (int(f) << 40) | CHANGED
        if self.vocab is None:
            return None
        x, _ = self._gather(idx, files)
        if x.size and (int(x.min()) < 0 or int(x.max()) >= self.vocab):
            row, col = np.argwhere((x < 0) | (x >= self.vocab))[0]
            f, offset = self.locate(int(idx[row]), int(col))
            return self.bad_token(f, offset), (f << 40) | offset
        return None

    def changed(self, f: int) -> Finding | None:
        """File ``f`` was replaced, grew, shrank or was written since it was opened."""
        path = self.files[f].path
        try:
            now = _stat(path)
        except OSError as exc:
            now = (-1, -1, -1)
            why = f"is gone ({exc.strerror})"
        else:
            why = f"changed under the running stage (size {self._stats[f][0]} -> {now[0]} bytes)"
        if now == self._stats[f]:
            return None
        return Finding(
            "data-changed",
            "error",
            f"{path} {why}: a memory-mapped token file must not change while a stage reads it",
            "restore the file (or write new data under another name), then continue with"
            " --resume auto (with --allow-data-change for new data)",
            str(path),
            self.where,
        )

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) of samples ``idx``, int64, shape ``(len(idx), seq_len)``. An id
        outside the vocabulary is refused (:meth:`check` looks before the step loop reads)."""
        idx = np.asarray(idx, dtype=np.int64)
        x, y = self._gather(idx, np.searchsorted(self._starts, idx, side="right") - 1)
        if self.vocab is not None and x.size and not self.checked_ahead:
            if int(x.min()) < 0 or int(x.max()) >= self.vocab:
                row, col = np.argwhere((x < 0) | (x >= self.vocab))[0]
                raise Refused(self.bad_token(*self.locate(int(idx[row]), int(col))))
        return x, y

    def _gather(self, idx: np.ndarray, file_of: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n, length = len(idx), self.seq_len
        x = np.zeros((n, length), dtype=np.int64)
        y = np.full((n, length), IGNORE, dtype=np.int64)
        if n == 0:
            return x, y
        for f in np.unique(file_of):
            sel = np.flatnonzero(file_of == f)
            data = self._map(int(f))
            offsets = (idx[sel] - self._starts[f]) * length
            full = offsets + length <= len(data)
            if full.any():
                rows = sel[full]
                win = data[offsets[full, None] + np.arange(length)]
                x[rows], y[rows] = win, win
            for row, off in zip(sel[~full], offsets[~full]):  # at most one a file: its tail
                tail = data[off:]
                x[row, : len(tail)], y[row, : len(tail)] = tail, tail
        return x, y

    def sample_blocks(self) -> list[tuple[Path, int, bytes]]:
        """The fingerprint's blocks: (file, offset, bytes) at fixed places of each file."""
        out = []
        for f in self.files:
            item = np.dtype(DTYPES[f.dtype]).itemsize
            size = f.path.stat().st_size
            block = min(BLOCK_BYTES, size)
            span = max(1, FINGERPRINT_BLOCKS - 1)
            # Token-aligned places, so each block decodes to whole tokens.
            places = sorted({k * (size - block) // span // item * item for k in range(span + 1)})
            with open(f.path, "rb") as fh:
                for off in places:
                    fh.seek(off)
                    out.append((f.path, off, fh.read(block)))
        return out

    def fingerprint(self, name: str) -> tuple[str, int]:
        """(sha256 of names, sizes, dtype, seq_len and the sampled blocks, largest sampled
        token): what stage 16 compares with stage 15's checkpoint."""
        fp, _, high = self.read_blocks(name)
        return fp, high

    def smallest_token(self) -> int:
        """The smallest token among the sampled blocks (a negative int32 id is bad data)."""
        return self.read_blocks("")[1]

    def read_blocks(self, name: str) -> tuple[str, int, int]:
        """One read of the sampled blocks: (fingerprint, smallest token or 0, largest)."""
        h = hashlib.sha256(f"{name}\0{self.dtype}\0{self.seq_len}\0".encode())
        if self.sources:
            h.update(f"mix\0{self.layout}\0".encode())
        dtypes = {}
        for f in self.files:
            h.update(f"{f.path.name}\0{f.path.stat().st_size}\n".encode())
            dtypes[f.path] = DTYPES[f.dtype]
            if f.index is not None:  # the document boundaries: the index's size and ends
                size = f.index.stat().st_size
                h.update(f"{f.index.name}\0{size}\n".encode())
                with open(f.index, "rb") as fh:
                    h.update(fh.read(BLOCK_BYTES))
                    fh.seek(max(0, size - BLOCK_BYTES))
                    h.update(fh.read(BLOCK_BYTES))
        low, high = 0, -1
        for path, off, data in self.sample_blocks():
            h.update(f"{path.name}@{off}\0".encode())
            h.update(data)
            item = np.dtype(dtypes[path]).itemsize
            usable = len(data) - len(data) % item
            if usable:
                tokens = np.frombuffer(data[:usable], dtypes[path])
                low, high = min(low, int(tokens.min())), max(high, int(tokens.max()))
        return h.hexdigest(), low, high
