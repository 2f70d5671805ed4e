"""Reading element ranges of a ZeRO checkpoint's saved shards into tensors.

:class:`Sources` holds the old shards of one kind (optimizer or model states, one file per
saving rank) and fills a destination tensor from the ranges a
:class:`~wonderland_ds.checkpoint.zero_partitions.Copy` list names: plain sequential reads at
the offsets the files record for plain float tensors, ``torch.load(mmap=True)`` for the rest.
:class:`Report` counts what a rank read (and :func:`storage_reads` what the process read from
storage meanwhile). The load-time reshard and the ZeRO-3 weight gather of ``eval/weights.py``
read through it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.checkpoint.zero_partitions import Copy
from wonderland_ds.core.findings import Refused


@dataclass
class Report:
    """What this rank read to reshard."""

    bytes_read: int = 0
    """Bytes of the old shards' tensors copied (fp32 weights, states, frozen fragments)."""
    io_read_bytes: int | None = None
    """What this process read from storage meanwhile (``/proc/self/io``; None elsewhere):
    the bytes above plus the pickles and the kernel's readahead around each range."""
    files: list[str] = field(default_factory=list)
    seconds: float = 0.0


#: torch's element type of each storage a saved tensor can have (its bytes are copied as is).
_TORCH_DTYPES = {
    "FloatStorage": torch.float32,
    "DoubleStorage": torch.float64,
    "HalfStorage": torch.float16,
    "BFloat16Storage": torch.bfloat16,
}


#: Bytes per read: large enough for the disk, small enough to stay in the kernel's readahead.
_CHUNK = 8 << 20


class Sources:
    """The old shards. Tensor ranges are read with plain sequential reads at the offsets the
    files record (``tensor_map.map_tensors``: a memory map would fault them in page by page);
    the rest of a file (scalars, the loss scaler) through ``torch.load(mmap=True)``.
    Counts the bytes copied."""

    def __init__(self, files: list[Path], report: Report) -> None:
        self.files, self.report = files, report
        self._open: dict[int, Any] = {}
        self._refs: dict[int, Any] = {}
        self._handles: dict[str, Any] = {}

    def get(self, rank: int) -> Any:
        if rank not in self._open:
            # weights_only=False as DeepSpeed loads; the front scanned every pickle's globals.
            self._open[rank] = torch.load(
                self.files[rank], map_location="cpu", mmap=True, weights_only=False
            )
        return self._open[rank]

    def refs(self, rank: int) -> Any:
        if rank not in self._refs:
            self._refs[rank] = zl.map_file(self.files[rank])
            self.report.files.append(self.files[rank].name)
        return self._refs[rank]

    def fill(self, dest: torch.Tensor, copies: list[Copy], pick: Any) -> None:
        """Copy each range into ``dest`` (flat) from ``pick(shard)`` of its source rank."""
        flat = dest.detach().view(-1)
        for c in copies:
            ref = pick(self.refs(c.rank))
            dtype = _TORCH_DTYPES.get(getattr(ref, "storage", ""))
            if dtype is None or not ref.contiguous:  # not a plain float tensor: torch reads it
                src = pick(self.get(c.rank)).view(-1)
                flat.narrow(0, c.dst, c.numel).copy_(src.narrow(0, c.src, c.numel))
            else:
                self._read(ref, dtype, c.src, flat.narrow(0, c.dst, c.numel))
            self.report.bytes_read += c.numel * flat.element_size()

    def _read(self, ref: Any, dtype: torch.dtype, start: int, out: torch.Tensor) -> None:
        """Elements ``[start, start + out.numel())`` of ``ref`` into ``out``: straight into its
        memory when it is a host tensor of the same type, else through a host buffer."""
        direct = out.device.type == "cpu" and out.dtype == dtype and out.is_contiguous()
        host = out if direct else torch.empty(out.numel(), dtype=dtype)
        view = host.view(torch.uint8).numpy().data.cast("B")
        fh = self._handles.get(ref.path)
        if fh is None:
            fh = self._handles[ref.path] = open(ref.path, "rb", buffering=0)  # noqa: SIM115
        pos, done = ref.offset + start * host.element_size(), 0
        while done < len(view):
            n = os.preadv(fh.fileno(), [view[done : done + _CHUNK]], pos + done)
            if n <= 0:
                raise Refused(
                    f"{ref.path}: the file ends inside a tensor", "inspect the checkpoint"
                )
            done += n
        if not direct:
            out.copy_(host)

    def close(self) -> None:
        for fh in self._handles.values():
            fh.close()
        self._handles.clear()


def storage_reads() -> int | None:
    """Bytes this process has read from storage so far (``/proc/self/io``; None elsewhere)."""
    try:
        for line in Path("/proc/self/io").read_text().splitlines():
            if line.startswith("read_bytes:"):
                return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None
