"""Where each tensor of a ``torch.save`` file lies, for reading it range by range without torch.

:func:`map_tensors` unpickles a file with the inert stand-ins of :mod:`pickles` (no global is
imported or called) and gives every tensor as a :class:`TensorRef`: its file, the byte offset
of its first element in the zip's stored record, its element type and shape. The ZeRO layout
reader (``zero_layout.py``) maps a checkpoint's partitions through it, and the load-time
reshard copies element ranges at those offsets (``shard_reads.py``).
"""

from __future__ import annotations

import pickle
import zipfile
from dataclasses import dataclass
from pathlib import Path
from struct import unpack
from typing import Any

from wonderland_ds.checkpoint.pickles import (
    REBUILDS,
    Global,
    OpaqueObject,
    Peeker,
    StorageRecord,
    data_pkl,
)

#: numpy's dtype and the element size of each storage type (bfloat16 has no numpy dtype: its
#: bits as uint16).
_ELEMENTS = {
    "FloatStorage": ("float32", 4),
    "DoubleStorage": ("float64", 8),
    "HalfStorage": ("float16", 2),
    "BFloat16Storage": ("uint16", 2),
    "LongStorage": ("int64", 8),
    "IntStorage": ("int32", 4),
    "ShortStorage": ("int16", 2),
    "CharStorage": ("int8", 1),
    "ByteStorage": ("uint8", 1),
    "BoolStorage": ("bool", 1),
}


@dataclass(frozen=True)
class TensorRef:
    """Where a contiguous tensor of a ``torch.save`` file lies: the file, the byte offset of
    its first element and its element type. :meth:`array` maps it (no bytes read until used)."""

    path: str
    offset: int
    storage: str
    shape: tuple[int, ...]
    contiguous: bool

    @property
    def dtype(self) -> str:
        return _ELEMENTS.get(self.storage, ("", 0))[0]

    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    def array(self) -> Any:
        """The tensor's elements as a flat, read-only ``numpy.memmap`` (copy-on-write, so a
        ``torch.from_numpy`` view of it is legal); nothing is read until sliced."""
        import numpy as np

        if not self.dtype or not self.contiguous:
            raise ValueError(
                f"cannot map a {self.storage} tensor (non-contiguous or no numpy type)"
            )
        if self.numel() == 0:
            return np.zeros(0, dtype=self.dtype)
        return np.memmap(
            self.path, dtype=self.dtype, mode="c", offset=self.offset, shape=(self.numel(),)
        )


def _record_offsets(path: Path | str) -> tuple[bytes, dict[str, int]]:
    """``data.pkl`` and the byte offset of every stored (uncompressed) record's data, by name."""
    data = data_pkl(path)
    offsets: dict[str, int] = {}
    with open(path, "rb") as fh, zipfile.ZipFile(fh) as zf:
        for info in zf.infolist():
            if info.compress_type != zipfile.ZIP_STORED:
                continue
            fh.seek(info.header_offset)
            local = fh.read(30)
            if local[:4] != b"PK\x03\x04":
                raise ValueError(f"{path}: damaged zip record {info.filename}")
            name_len, extra_len = unpack("<HH", local[26:30])
            offsets[info.filename] = info.header_offset + 30 + name_len + extra_len
    return data, offsets


class _Mapper(Peeker):
    """:class:`Peeker` whose tensors are :class:`TensorRef` (their place in the file)."""

    def __init__(self, path: Path | str, allowed: frozenset[str], trust: bool) -> None:
        data, self.offsets = _record_offsets(path)
        super().__init__(data, allowed, trust)
        self.path = str(path)
        self.folder = next(iter(self.offsets), "archive/").split("/")[0]

    def find_class(self, module: str, name: str) -> Any:
        if f"{module}.{name}" in REBUILDS:
            return self._rebuild
        found = super().find_class(module, name)
        if isinstance(found, Global):  # a type, so NEWOBJ (enums, named tuples) builds it too
            return type(name, (OpaqueObject,), {"qualname": found.name})
        return found

    def _rebuild(
        self, storage: Any, offset: Any = 0, size: Any = (), stride: Any = (), *rest: Any
    ) -> TensorRef:
        if not isinstance(storage, StorageRecord):
            raise pickle.UnpicklingError("a tensor without a storage record")
        shape = tuple(int(d) for d in size)
        want: list[int] = []
        step = 1
        for d in reversed(shape):  # the strides of a contiguous tensor of this shape
            want.insert(0, step)
            step *= d
        record = f"{self.folder}/data/{storage.key}"
        if record not in self.offsets:
            raise pickle.UnpicklingError(f"tensor data {record} is missing or compressed")
        item = _ELEMENTS.get(storage.kind, ("", 0))[1]
        return TensorRef(
            self.path,
            self.offsets[record] + int(offset) * item,
            storage.kind,
            shape,
            all(a == b for a, b, d in zip(stride, want, shape) if d > 1),
        )


def map_tensors(
    path: Path | str, allowed: frozenset[str] = frozenset(), trust: bool = False
) -> Any:
    """Like :func:`~wonderland_ds.checkpoint.pickles.peek`, with every tensor a
    :class:`TensorRef`: the data can then be read range by range, memory-mapped, without torch
    and without reading the rest of the file."""
    return _Mapper(path, allowed, trust).load()
