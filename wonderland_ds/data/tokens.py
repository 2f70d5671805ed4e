"""Flat token files read where they lie: raw little-endian tokens, as nanoGPT and Megatron
write them (``.bin``; uint16 for vocabularies under 65,536, else uint32 or int32).

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

DTYPES: dict[str, type[np.integer]] = {"uint16": np.uint16, "uint32": np.uint32, "int32": np.int32}
IGNORE = -100
"""The label of a padded position (PyTorch's and ``transformers``' ignore index)."""
FINGERPRINT_BLOCKS = 16
"""Blocks hashed per file for the fingerprint (the first and last among them)."""
BLOCK_BYTES = 1 << 16


def expand(patterns: list[str], where: str) -> list[Path]:
    """Files named by ``patterns`` (paths or globs), in the given order, each glob sorted.
    A pattern that matches nothing is a refusal naming it."""
    files: list[Path] = []
    missing = []
    for pattern in patterns:
        if glob.has_magic(pattern):
            hits = sorted(Path(p) for p in glob.glob(os.path.expanduser(pattern)))
            hits = [p for p in hits if p.is_file()]
        else:
            p = Path(os.path.expanduser(pattern))
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


@dataclass(frozen=True)
class TokenFile:
    path: Path
    tokens: int


def open_files(paths: list[Path], dtype: str, where: str) -> list[TokenFile]:
    """Each file's token count; a size that is not a whole number of tokens is refused."""
    itemsize = np.dtype(DTYPES[dtype]).itemsize
    out, bad = [], []
    for path in paths:
        size = path.stat().st_size
        if size % itemsize:
            bad.append(
                Finding(
                    "data-size",
                    "error",
                    f"{path} has {size} bytes, not a multiple of {dtype}'s {itemsize}:"
                    " not a flat file of this dtype (or truncated)",
                    f"check data.dtype ({dtype}) against how the file was written",
                    str(path),
                    where,
                )
            )
        out.append(TokenFile(path, size // itemsize))
    if bad:
        raise Refused(bad)
    return out


class TokenData:
    """Windows of ``seq_len`` tokens over a list of token files, read in place.

    ``pad_tail``: a file's last window shorter than ``seq_len`` (at least 2 tokens) is a
    sample too, padded with :data:`IGNORE` labels (held-out sets count every token)."""

    def __init__(
        self, files: list[TokenFile], dtype: str, seq_len: int, pad_tail: bool = False
    ) -> None:
        self.files, self.dtype, self.seq_len, self.pad_tail = files, dtype, seq_len, pad_tail
        counts = []
        for f in files:
            n = f.tokens // seq_len
            if pad_tail and f.tokens % seq_len >= 2:
                n += 1
            counts.append(n)
        self._starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])
        self._maps: list[np.ndarray | None] = [None] * len(files)

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
            m = np.memmap(f.path, dtype=DTYPES[self.dtype], mode="r", shape=(f.tokens,))
            m = self._maps[i] = np.asarray(m)  # a plain view: no memmap subclass per read
        return m

    def take(self, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) of samples ``idx``, int64, shape ``(len(idx), seq_len)``."""
        idx = np.asarray(idx, dtype=np.int64)
        n, length = len(idx), self.seq_len
        x = np.zeros((n, length), dtype=np.int64)
        y = np.full((n, length), IGNORE, dtype=np.int64)
        if n == 0:
            return x, y
        file_of = np.searchsorted(self._starts, idx, side="right") - 1
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
        item = np.dtype(DTYPES[self.dtype]).itemsize
        for f in self.files:
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
        for f in self.files:
            h.update(f"{f.path.name}\0{f.path.stat().st_size}\n".encode())
        low, high = 0, -1
        item = np.dtype(DTYPES[self.dtype]).itemsize
        for path, off, data in self.sample_blocks():
            h.update(f"{path.name}@{off}\0".encode())
            h.update(data)
            usable = len(data) - len(data) % item
            if usable:
                tokens = np.frombuffer(data[:usable], DTYPES[self.dtype])
                low, high = min(low, int(tokens.min())), max(high, int(tokens.max()))
        return h.hexdigest(), low, high


#: Scans of unchanged files (keyed by names, sizes, mtimes and inodes), so a stage's data is
#: fingerprinted once: by the front process, whose results rank 0 receives (stage.py).
_SCANS: dict[str, tuple[str, int, int]] = {}


def _scan_key(data: TokenData, name: str) -> str:
    parts: list[object] = [name, data.dtype, data.seq_len]
    for f in data.files:
        st = f.path.stat()
        parts.append([str(f.path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    return json.dumps(parts)


def scan(data: TokenData, name: str) -> tuple[str, int, int]:
    """(fingerprint, smallest and largest sampled token) of ``data``, computed once while the
    files are unchanged."""
    key = _scan_key(data, name)
    if key not in _SCANS:
        _SCANS[key] = data.read_blocks(name)
    return _SCANS[key]


def fingerprint_of(data: TokenData, name: str) -> str:
    return scan(data, name)[0]


def export_scans() -> dict[str, list[object]]:
    return {k: list(v) for k, v in _SCANS.items()}


def import_scans(scans: dict[str, list[object]]) -> None:
    for k, (fp, low, high) in scans.items():
        _SCANS[k] = (str(fp), int(low), int(high))  # type: ignore[call-overload]
