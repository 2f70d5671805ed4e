"""Reading torch.save files without torch (pickles.py): the same answers as torch, no code run."""

from __future__ import annotations

import io
import os
import pickle
import subprocess
import sys
import zipfile
from collections import OrderedDict

import numpy as np
import pytest
import torch

from wonderland_ds.checkpoint import pickles
from wonderland_ds.checkpoint.describe import peek_states, scan_pickles


def test_the_allowlist_is_the_installed_torchs():
    from torch import _weights_only_unpickler as wou

    assert pickles.TORCH_SAFE_GLOBALS == frozenset(wou._get_allowed_globals())


class Boom:
    def __reduce__(self):
        return (os.system, ("touch BOOM",))


def _saved(tmp_path, name, obj):
    path = tmp_path / name
    torch.save(obj, path)
    return path


@pytest.mark.parametrize(
    "obj",
    [
        {"w": torch.ones(3), "shape": torch.Size([2, 3]), "od": OrderedDict(a=torch.zeros(2))},
        {"np": np.arange(4, dtype=np.uint32), "s": {1, 2}, "b": b"bytes", "c": 1 + 2j},
        {"p": torch.nn.Parameter(torch.ones(2, dtype=torch.bfloat16)), "i": 2**40},
        {"boom": Boom()},
    ],
    ids=["tensors", "numpy-and-builtins", "parameter", "code"],
)
def test_unsafe_globals_agree_with_torch(tmp_path, obj):
    path = _saved(tmp_path, "x.pt", obj)
    assert pickles.unsafe_globals(path) == sorted(
        torch.serialization.get_unsafe_globals_in_checkpoint(str(path))
    )


def test_peek_reads_structure_not_data_and_runs_nothing(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    path = _saved(
        tmp_path,
        "m.pt",
        {
            "module": OrderedDict(w=torch.ones(4, 3, dtype=torch.bfloat16)),
            "lr_scheduler": {"last_batch_iteration": 499},
            "param_shapes": [OrderedDict(w=torch.Size([4, 3]))],
            "boom": Boom(),
        },
    )
    with pytest.raises(pickle.UnpicklingError, match="posix.system|os.system"):
        pickles.peek(path)  # not allowlisted and not trusted: refused
    got = pickles.peek(path, trust=True)  # trusted: still nothing is called
    assert not (tmp_path / "BOOM").exists()
    assert isinstance(got["boom"], pickles.Opaque)
    stub = got["module"]["w"]
    assert stub.shape == (4, 3) and stub.numel() == 12 and stub.storage == "BFloat16Storage"
    assert got["lr_scheduler"]["last_batch_iteration"] == 499
    assert got["param_shapes"][0]["w"] == (4, 3)
    states, why = peek_states(path)
    assert states is None and "refused to unpickle global" in why


def test_files_the_static_reader_cannot_follow_fail_closed(tmp_path):
    legacy = tmp_path / "legacy.pt"
    torch.save({"w": torch.ones(2)}, legacy, _use_new_zipfile_serialization=False)
    with pytest.raises(ValueError, match="torch.save"):
        pickles.unsafe_globals(legacy)
    proto5 = tmp_path / "proto5.pt"  # a zip whose pickle uses opcodes torch's reader rejects
    with zipfile.ZipFile(proto5, "w") as zf:
        zf.writestr("archive/data.pkl", pickle.dumps({"a": [1, 2]}, protocol=5))
        zf.writestr("archive/version", "3\n")
    with pytest.raises(pickle.UnpicklingError, match="Unsupported operand"):
        pickles.unsafe_globals(proto5)
    with pytest.raises(pickle.UnpicklingError):
        torch.serialization.get_unsafe_globals_in_checkpoint(str(proto5))  # torch agrees
    found = scan_pickles(tmp_path)
    assert {(f.rule, f.path) for f in found} == {
        ("ckpt-unreadable", "legacy.pt"),
        ("ckpt-untrusted", "proto5.pt"),
    }


def test_the_front_process_never_imports_torch(tmp_path):
    """`wonderland train --dry-run` (the preflight every launch runs first) without torch:
    its import was 2 s of every launch."""
    code = (
        "import sys\n"
        "from wonderland_ds.cli import main as cli\n"
        f"rc = cli.main(['train', '--stage', '15', '--run-dir', {str(tmp_path / 'r')!r},"
        " '--dry-run'])\n"
        "print('rc', rc, 'torch' in sys.modules, 'deepspeed' in sys.modules)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    assert out.strip().splitlines()[-1] == "rc 0 False False", out[-2000:]


def test_peek_of_a_real_model_states_file_matches_torch_load(tmp_path):
    obj = {
        "module": OrderedDict((f"l{i}", torch.randn(3, i + 1)) for i in range(3)),
        "global_steps": 7,
        "ds_config": {"zero_optimization": {"stage": 2}},
        "nested": [(torch.zeros(1), "s")],
    }
    path = _saved(tmp_path, "mp_rank_00_model_states.pt", obj)
    real, peeked = torch.load(path, weights_only=True), pickles.peek(path)
    assert peeked["global_steps"] == real["global_steps"]
    assert peeked["ds_config"] == real["ds_config"]
    assert [v.shape for v in peeked["module"].values()] == [
        tuple(v.shape) for v in real["module"].values()
    ]
    assert peeked["nested"][0][1] == "s"
    buf = io.BytesIO(zipfile.ZipFile(path).read("mp_rank_00_model_states/data.pkl"))
    assert buf.getbuffer().nbytes < 2000  # only the pickle record is read, not tensor bytes


def _zip_with(path, entries, prefix=b""):
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries:
            zf.writestr(name, data)
    path.write_bytes(prefix + buf.getvalue())
    return path


def test_crafted_zips_torch_would_read_differently_are_refused(tmp_path):
    """The scan must read the pickle torch.load would run: a legacy pickle in front of a
    harmless zip (torch unpickles the front bytes), another folder's data.pkl listed first,
    or names differing only in case are refused, never guessed at."""
    good, evil = pickle.dumps({"a": 1}, protocol=2), pickle.dumps(Boom(), protocol=2)
    ok = [("archive/data.pkl", good), ("archive/version", b"3\n")]
    prefixed = _zip_with(tmp_path / "prefixed.pt", ok, prefix=evil)
    with pytest.raises(ValueError):
        torch.serialization.get_unsafe_globals_in_checkpoint(str(prefixed))  # torch refuses too
    crafted = [
        prefixed,
        _zip_with(
            tmp_path / "two-folders.pt",
            [("a/x", b""), ("b/data.pkl", good), ("b/version", b"3\n")]
            + [("a/data.pkl", evil), ("a/version", b"3\n")],
        ),
        _zip_with(tmp_path / "case.pt", [*ok, ("archive/DATA.pkl", evil)]),
    ]
    for path in crafted:
        with pytest.raises(ValueError):
            pickles.unsafe_globals(path)
        with pytest.raises(ValueError):
            pickles.peek(path, trust=True)
    found = {f.path: f.rule for f in scan_pickles(tmp_path)}
    assert found == {p.name: "ckpt-unreadable" for p in crafted}
    (tmp_path / "sub").mkdir()
    plain = _zip_with(tmp_path / "sub" / "plain.pt", ok)
    assert pickles.unsafe_globals(plain) == []  # the same layout, uncrafted, reads fine
