"""The built-in tasks (imbalanced digits, a byte-level LM on the standard library's source) and
``load``: a task spec (a built-in name or ``module:function``) resolved to a :class:`Task`."""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import sysconfig
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from wonderland_ds.core.findings import Refused
from wonderland_ds.data.tasks import Source, Split, Task

if TYPE_CHECKING:
    from torch import nn


def _digits_splits(minority: tuple[int, ...], share: float) -> tuple[Split, Split]:
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = data.data.astype(np.float32), data.target.astype(np.int64)
    rng = np.random.default_rng(20261130)  # fixed: the dataset, not the run, decides the cut
    keep = np.ones(len(y), dtype=bool)
    for c in minority:
        idx = np.flatnonzero(y == c)
        keep[rng.permutation(idx)[int(round(len(idx) * share)) :]] = False
    x, y = x[keep], y[keep]
    heldout = np.zeros(len(y), dtype=bool)
    for c in range(10):  # stratified 25% held out
        idx = rng.permutation(np.flatnonzero(y == c))
        heldout[idx[: max(1, len(idx) // 4)]] = True
    return Split(x[~heldout], y[~heldout]), Split(x[heldout], y[heldout])


def _digits_model() -> nn.Module:
    from wonderland_ds.data.models import DigitsNet

    return DigitsNet()


def _code_key() -> str:
    """This file's bytes: any edit to how built-in data is made changes every source key."""
    return hashlib.sha256(Path(__file__).read_bytes()).hexdigest()


def _files_key(*parts: Any, files: list[Path]) -> str:
    h = hashlib.sha256(_code_key().encode())
    h.update(f"numpy {np.__version__}\0".encode())  # its RNG streams and array code make data
    h.update(repr(parts).encode())
    for path in files:
        st = path.stat()
        h.update(f"{path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()


def _digits_source_key(minority: tuple[int, ...], share: float) -> str:
    from importlib import metadata

    spec = importlib.util.find_spec("sklearn")  # finds, does not import, scikit-learn
    if spec is None or not spec.submodule_search_locations:
        return "no-sklearn"  # materializing refuses it properly
    data = Path(list(spec.submodule_search_locations)[0]) / "datasets" / "data" / "digits.csv.gz"
    return _files_key("digits", minority, share, metadata.version("scikit-learn"), files=[data])


def digits(minority: tuple[int, ...] = (3, 8), share: float = 0.12) -> Task:
    return Task(
        name="digits",
        num_classes=10,
        build_model=_digits_model,
        make_splits=Source(
            lambda: _digits_splits(minority, share), lambda: _digits_source_key(minority, share)
        ),
        minority_classes=minority,
        class_names=tuple(str(c) for c in range(10)),
    )


PYLM_CONTEXT = 128


PYLM_BYTES = 3_000_000


def _stdlib_files() -> list[Path]:
    """The standard library's ``.py`` files outside ``test`` and ``site-packages`` folders,
    sorted (a pruned walk: ``rglob`` then filtering visited the test suite's 14k entries)."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = [d for d in dirs if d not in ("test", "site-packages")]
        files += [Path(folder, n) for n in names if n.endswith(".py")]
    return sorted(f for f in files if "site-packages" not in f.parts)


def _pylm_used_files() -> list[Path]:
    """The files :func:`_pylm_splits` reads, decided by their sizes alone."""
    used, total = [], 0
    for path in _stdlib_files():
        size = path.stat().st_size
        used.append(path)
        if (size - 1) // PYLM_CONTEXT == 0:
            continue
        total += size
        if total > PYLM_BYTES:
            break
    return used


def _pylm_splits(meta: dict[str, Any]) -> tuple[Split, Split]:
    """Every 10th file is held out; sequences of 128 bytes predict the next byte."""
    root = Path(sysconfig.get_paths()["stdlib"])
    train_chunks, held_chunks, sources = [], [], []
    total = 0
    for i, path in enumerate(_stdlib_files()):
        data = np.frombuffer(path.read_bytes(), dtype=np.uint8).astype(np.int64)
        n = (len(data) - 1) // PYLM_CONTEXT
        if n == 0:
            continue
        seq = np.lib.stride_tricks.sliding_window_view(data, PYLM_CONTEXT + 1)[::PYLM_CONTEXT][:n]
        if i % 10 == 0:
            held_chunks.append(seq)
            package = path.relative_to(root).parts[0].removesuffix(".py")
            sources += [package] * len(seq)
        else:
            train_chunks.append(seq)
        total += len(data)
        if total > PYLM_BYTES:
            break
    train, held = np.concatenate(train_chunks), np.concatenate(held_chunks)
    meta["heldout_sources"] = sources
    return (
        Split(np.ascontiguousarray(train[:, :-1]), np.ascontiguousarray(train[:, 1:])),
        Split(np.ascontiguousarray(held[:, :-1]), np.ascontiguousarray(held[:, 1:])),
    )


def _pylm_model(dim: int, layers: int) -> nn.Module:
    from wonderland_ds.data.models import ByteGPT

    return ByteGPT(PYLM_CONTEXT, dim, layers)


def pylm(dim: int = 128, layers: int = 4) -> Task:
    meta: dict[str, Any] = {}
    return Task(
        name="pylm",
        num_classes=256,
        kind="lm",
        normalize=False,
        build_model=lambda: _pylm_model(dim, layers),
        make_splits=Source(
            lambda: _pylm_splits(meta),
            lambda: _files_key("pylm", PYLM_CONTEXT, PYLM_BYTES, files=_pylm_used_files()),
        ),
        meta=meta,
    )


BUILTIN: dict[str, Callable[[], Task]] = {"digits": digits, "pylm": pylm}


def load(spec: str) -> Task:
    """A built-in task name or ``module:function``; a bad spec is a refusal, not a traceback.
    (``causal-lm`` is configured by a config: ``lm.load_task``.)"""
    if spec == "causal-lm":
        raise Refused(
            "task causal-lm is configured in a config's wonderland section and reads its token"
            " files in place",
            'give "wonderland": {"task": "causal-lm", "model": {...}, "data": {...}} in the config',
        )
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise Refused(
            f"unknown task {spec!r}",
            f"use causal-lm, a built-in task ({', '.join(BUILTIN)}) or 'module:function'"
            " returning a Task",
        )
    module_name, func_name = spec.split(":", 1)
    try:
        func = getattr(importlib.import_module(module_name), func_name)
    except (ImportError, AttributeError) as exc:
        raise Refused(
            f"task {spec!r} cannot be loaded: {exc}",
            "check the module is importable (PYTHONPATH) and defines the function",
        ) from None
    task = func()
    if not isinstance(task, Task):
        raise Refused(
            f"task {spec!r} returned {type(task).__name__}, not a Task",
            "return wonderland_ds.data.tasks.Task(...)",
        )
    return task
