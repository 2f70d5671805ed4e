"""Universal conversion with DeepSpeed's fragments kept in memory (wonderland_ds/universal.py).

The fast path must write exactly what ``python -m deepspeed.checkpoint.ds_to_universal``
writes, must really keep the fragments off the disk, must put DeepSpeed's modules back even
when the converter raises, and must fall back to the stock converter, saying so, when it
cannot run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.helpers.util import REPO, same
from wonderland_ds.checkpoint import universal
from wonderland_ds.core.findings import Refused

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source(stage15_fp32) -> Path:
    """The last save of the shared stage-15 run (2 gloo ranks, ZeRO-2, fp32, frozen params)."""
    root = stage15_fp32 / "stage15" / "checkpoints"
    return root / (root / "latest").read_text().strip()


@pytest.fixture(scope="module")
def stock(source, tmp_path_factory) -> Path:
    """DeepSpeed's converter run by hand, keeping its fragment folder to compare against."""
    out = tmp_path_factory.mktemp("stock") / f"{source.name}_universal"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    cmd += ["--input_folder", str(source), "--output_folder", str(out)]
    cmd += ["--num_extract_workers", "1", "--num_merge_workers", "1", "--keep_temp_folder"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    return out


def listing(folder: Path, skip: str | None = None) -> list[str]:
    return sorted(
        p.relative_to(folder).as_posix()
        for p in folder.rglob("*")
        if skip is None or p.relative_to(folder).parts[0] != skip
    )


@contextlib.contextmanager
def captured_store():
    """The FragmentStore of the next conversion, for a look while it runs."""
    real = universal.in_memory_fragments
    seen: dict = {}

    @contextlib.contextmanager
    def spy(output_folder):
        with real(output_folder) as store:
            seen["store"] = store
            yield store

    universal.in_memory_fragments = spy
    try:
        yield seen
    finally:
        universal.in_memory_fragments = real


def test_fast_conversion_equals_stock_and_keeps_fragments_in_memory(
    source, stock, tmp_path, monkeypatch
):
    from deepspeed.checkpoint import ds_to_universal as d2u

    out = tmp_path / f"{source.name}_universal"
    real_merge = d2u._merge_tp_slice_files
    during: dict = {}

    def merge(args, *rest, **kw):  # between extraction and merge: where the fragments are
        during["tmp_exists"] = (out / "tmp").exists()
        during["on_disk"] = listing(out)
        store = seen["store"]
        during["fragments"] = {p[len(store.prefix) :]: obj for p, obj in store.objects.items()}
        return real_merge(args, *rest, **kw)

    monkeypatch.setattr(d2u, "_merge_tp_slice_files", merge)
    with captured_store() as seen:
        failure, how = universal._run_ds_to_universal(source, out)
    assert failure is None, failure

    # The fast path ran, and no fragment ever reached the disk.
    assert how["fragments"] == "memory" and "stock_because" not in how
    assert during["tmp_exists"] is False and during["on_disk"] == []
    stock_fragments = {
        p.relative_to(stock / "tmp").as_posix(): p
        for p in (stock / "tmp").rglob("*")
        if p.is_file()
    }
    assert how["fragments_in_memory"] == len(stock_fragments) > 0
    assert during["fragments"].keys() == stock_fragments.keys()
    for rel, path in stock_fragments.items():
        assert same(torch.load(path, weights_only=False), during["fragments"][rel]), rel
    assert seen["store"].loaded == len(stock_fragments) and not seen["store"].objects

    # The same files and folders as the stock converter (less the fragment folder it kept),
    # every tensor equal.
    assert listing(out) == listing(stock, skip="tmp")
    frozen_fallbacks = 0
    for rel in listing(out):
        a, b = stock / rel, out / rel
        if a.is_dir():
            continue
        if a.suffix == ".pt":
            want = torch.load(a, weights_only=False)
            assert same(want, torch.load(b, weights_only=False)), rel
            frozen_fallbacks += rel.endswith("fp32.pt") and not (a.parent / "exp_avg.pt").exists()
        else:
            assert a.read_bytes() == b.read_bytes(), rel
    assert frozen_fallbacks > 0  # the model-state fallback for frozen parameters was covered
    assert (tmp_path / "latest_universal").read_text() == out.name


def test_patches_are_removed_even_when_the_converter_raises(source, tmp_path, monkeypatch):
    from deepspeed.checkpoint import deepspeed_checkpoint as dsc
    from deepspeed.checkpoint import ds_to_universal as d2u
    from deepspeed.checkpoint import zero_checkpoint as zc

    before = (d2u.torch, d2u.glob, d2u.os, d2u._aggregate_autoep_zero12_metadata)
    assert before[:3] == (torch, glob, os) and zc.torch is torch and dsc.torch is torch
    inside: dict = {}

    def boom(*args, **kwargs):
        inside["patched"] = d2u.torch is not torch and zc.torch is not torch
        raise RuntimeError("merge exploded")

    monkeypatch.setattr(d2u, "_merge_tp_slice_files", boom)
    failure, how = universal._run_ds_to_universal(
        source, tmp_path / "x" / "global_step40_universal"
    )
    assert failure is not None and "merge exploded" in failure
    assert inside["patched"] is True
    assert (d2u.torch, d2u.glob, d2u.os, d2u._aggregate_autoep_zero12_metadata) == before
    assert zc.torch is torch and dsc.torch is torch
    assert not universal._convert_lock.locked()

    # convert() keeps its contract: a refusal, nothing left behind.
    out_root = tmp_path / "universal"
    with pytest.raises(Refused) as exc:
        universal.convert(source, out_root)
    assert "merge exploded" in exc.value.findings[0].message
    assert sorted(p.name for p in out_root.iterdir()) == []
    assert (d2u.torch, d2u.glob, d2u.os) == before[:3] and zc.torch is torch


@pytest.mark.parametrize("why", ["version", "autoep", "memory"])
def test_stock_converter_when_the_fast_path_cannot_run(source, stock, tmp_path, monkeypatch, why):
    from deepspeed.checkpoint import ds_to_universal as d2u

    if why == "version":
        monkeypatch.setattr(universal, "FAST_PATH_DEEPSPEED", "0.0.0")
    elif why == "memory":
        monkeypatch.setattr(universal, "_mem_available", lambda: 1024)
    else:  # the first look at the model states reports AutoEP layers: start over, stock
        real = d2u._aggregate_autoep_zero12_metadata
        calls = []

        def autoep_once(*args, **kwargs):
            shapes, autoep, before = real(*args, **kwargs)
            calls.append(1)
            return shapes, ([{"expert_key_prefix": "x"}] if len(calls) == 1 else autoep), before

        monkeypatch.setattr(d2u, "_aggregate_autoep_zero12_metadata", autoep_once)
    wrote_fragments = []
    real_dump = d2u.dump_param_fragment

    def dump(*args, **kwargs):
        real_dump(*args, **kwargs)
        wrote_fragments.append(glob.glob(os.path.join(args[0], "**", "*.*"), recursive=True))

    monkeypatch.setattr(d2u, "dump_param_fragment", dump)

    final, found = universal.convert(source, tmp_path / "universal")
    how = json.loads((final / "wonderland_meta.json").read_text())["conversion"]
    assert how["fragments"] == "disk (stock converter)"
    reason = {"version": "DeepSpeed", "autoep": "AutoEP", "memory": "GB available"}[why]
    assert reason in how["stock_because"] and "stock converter" in found[0].message
    assert wrote_fragments and wrote_fragments[-1]  # the stock way: fragment files on disk
    assert listing(final) == sorted(listing(stock, skip="tmp") + ["wonderland_meta.json"])
    assert (universal.fast_path_unavailable() is None) == (why != "version")


@pytest.mark.nightly
def test_fast_conversion_equals_stock_under_zero3(tmp_path):
    """ZeRO-3 goes through another extraction (extract_zero_shards_stage3) and merge
    (merge_zero3_slices); the same fragment store serves it."""
    from tests.helpers.util import wonderland

    cfg = json.loads((REPO / "tests" / "configs" / "tiny_zero2_fp32.json").read_text())
    cfg["zero_optimization"]["stage"] = 3
    cfg["wonderland"].update(train_steps=4, save_interval=4, min_warmup_steps=0)
    path = tmp_path / "zero3.json"
    path.write_text(json.dumps(cfg))
    r = wonderland(
        "train", "--stage", "15", "--config", str(path), "--run-dir", str(tmp_path / "run")
    )
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    src = tmp_path / "run" / "stage15" / "checkpoints" / "global_step4"
    stock_out = tmp_path / "stock" / "global_step4_universal"
    cmd = [sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal"]
    cmd += ["--input_folder", str(src), "--output_folder", str(stock_out)]
    cmd += ["--num_extract_workers", "1", "--num_merge_workers", "1"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=180, cwd=REPO)
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    out = tmp_path / "ours" / "global_step4_universal"
    failure, how = universal._run_ds_to_universal(src, out)
    assert failure is None and how["fragments"] == "memory" and how["fragments_in_memory"] > 0
    assert listing(out) == listing(stock_out)
    for rel in listing(out):
        if (out / rel).is_file():
            a = torch.load(stock_out / rel, weights_only=False)
            assert same(a, torch.load(out / rel, weights_only=False)), rel
