"""Async checkpoint saves: the snapshot is immune to later steps; writer errors surface."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict

import pytest
import torch

from wonderland_ds.async_ckpt import Writer, snapshot


def test_snapshot_keeps_sharing_types_and_is_immune_to_later_updates():
    flat = torch.arange(10.0)
    state = {
        "a": flat[:5],
        "b": flat[5:],
        "shape": torch.Size([3, 4]),
        "od": OrderedDict(x=1),
        "nested": [flat, (flat[:2], "s")],
    }
    snap = snapshot(state)
    flat += 100  # the next optimizer step
    assert snap["a"].tolist() == [0, 1, 2, 3, 4] and snap["b"][0] == 5
    assert snap["a"].untyped_storage().data_ptr() == snap["b"].untyped_storage().data_ptr()
    assert isinstance(snap["shape"], torch.Size) and snap["shape"].numel() == 12
    assert isinstance(snap["od"], OrderedDict) and snap["nested"][1][1] == "s"


def test_writer_writes_atomically(tmp_path):
    w = Writer()
    w.write({"x": torch.ones(3)}, str(tmp_path / "a.pt"), True)
    w.wait()
    w.close()
    assert torch.load(tmp_path / "a.pt")["x"].sum() == 3
    assert not list(tmp_path.glob("*.tmp"))


def test_writer_error_surfaces_and_leaves_no_partial_file(tmp_path):
    w = Writer()
    w.write({"x": torch.ones(3)}, str(tmp_path / "missing-dir" / "a.pt"), True)
    w.write({"x": torch.ones(3)}, str(tmp_path / "b.pt"), True)  # skipped after the error
    with pytest.raises(OSError, match="could not write"):
        w.wait()
    w.close()
    assert not (tmp_path / "b.pt").exists() and not list(tmp_path.rglob("*.tmp"))


def test_disk_full_is_an_error_not_a_partial_file(tmp_path):
    """RLIMIT_FSIZE (the diskfull fault): the kernel refuses the write with EFBIG."""
    code = f"""
import resource, signal, torch
from wonderland_ds.async_ckpt import Writer
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, resource.RLIM_INFINITY))
w = Writer()
w.write({{"x": torch.ones(1 << 20)}}, {str(tmp_path / "big.pt")!r}, True)
try:
    w.wait()
except Exception as exc:
    print("ERROR", type(exc).__name__, exc)
"""
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
    ).stdout
    assert "ERROR OSError could not write" in out and "disk full" in out, out
    assert list(tmp_path.iterdir()) == []  # no big.pt, no big.pt.tmp
