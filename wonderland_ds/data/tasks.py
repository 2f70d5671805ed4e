"""Tasks: a model, its data splits and its loss, behind one small typed interface.

A user task is any ``module:function`` returning a :class:`Task` (``wonderland.task`` in the
config, or ``--task``). Built-in tasks use data that ships with installed packages, nothing is
downloaded:

* ``digits``: scikit-learn's handwritten digits with classes 3 and 8 cut to a minority share,
  so that stage 17's per-class sweep has minority classes to watch (the default).
* ``pylm``: a byte-level language model (a small GPT) over the Python standard library's own
  source files, for throughput benchmarks; held-out text is whole files, tagged by package.

Training never reads ``make_splits`` directly: the splits are written once to a cache of
tensor shards (``cache.py``) and every stage reads the memory-mapped cache.

This module does not import torch: the front process (``wonderland train``) loads tasks to
check the run's data before launching, and torch's import alone was 2 s of every launch
(BENCHMARKS.md section 5). Models and losses import it when first used.

A built-in task also has a ``source_key``: a cheap digest of what its data is made from (file
names, sizes and modification times, the code that builds it). The cache records it, so the
front proves a cache fresh without rebuilding the data; any difference falls back to the full
comparison (rebuild and fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib
import importlib
import importlib.util
import os
import sysconfig
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

from wonderland_ds.core.findings import Refused

if TYPE_CHECKING:
    import torch
    from torch import nn

    from wonderland_ds.data.tokens import TokenData

__all__ = [
    "Normalize",  # noqa: F822 - provided lazily by __getattr__ (no torch import here)
    "Source",
    "Split",
    "Task",
    "digits",
    "pylm",
    "load",
    "normalization_stats",
]  # noqa: F822


@dataclass(frozen=True)
class Split:
    x: np.ndarray
    """Model inputs, one row per sample (float32 features, or int64 tokens)."""
    y: np.ndarray
    """int64 targets: a class per row, or a next token per position."""

    def __len__(self) -> int:
        return len(self.y)

    @property
    def tokens_per_sample(self) -> int:
        return int(self.y.shape[1])


@dataclass(frozen=True)
class Source:
    """``make_splits`` with a cheap digest of everything the splits are made from (file names,
    sizes and modification times, library versions, this module's code): equal keys are taken
    to mean equal data. Only for sources whose every input ``key`` covers."""

    build: Callable[[], tuple[Split, Split]]
    key: Callable[[], str]

    def __call__(self) -> tuple[Split, Split]:
        return self.build()


@dataclass(frozen=True)
class Task:
    """A model, its data and its loss.

    The model contract: the model is called as ``model(x)`` (``batch_format="tensor"``) or
    as a ``transformers`` model is (``"hf"``: ``model(input_ids=x, attention_mask=...,
    labels=y)``, labels equal to the inputs, :data:`IGNORE` on padding, shifted by the loss).
    It may return a tensor (logits), or a ``ModelOutput``/dict with ``logits`` or ``loss``.
    :meth:`loss` is the one loss used by training and by stage 17."""

    name: str
    num_classes: int
    build_model: Callable[[], nn.Module]
    """A fresh model. With ``normalize``, its ``.norm`` is a :class:`Normalize` that stage 15's
    pre-normalization pass fills."""
    make_splits: Callable[[], tuple[Split, Split]] | None = None
    """Produces (train, held-out) from the raw source; only the cache writer calls it."""
    kind: Literal["classify", "lm"] = "classify"
    normalize: bool = True
    minority_classes: tuple[int, ...] = ()
    class_names: tuple[str, ...] = ()
    meta: dict[str, Any] = field(default_factory=dict)
    """Task facts that travel with the cache (e.g. the source of each held-out row)."""
    train: Split | TokenData | None = None
    """Training data: arrays (cached once as ``.npy`` shards) or token files read in place."""
    heldout: Split | TokenData | None = None
    fingerprint_value: str | None = None
    source_key_value: str | None = None
    """The key of the source this task's data was built from (recorded in its cache)."""
    batch_format: Literal["tensor", "hf"] = "tensor"
    """How the model is called (see the class docstring)."""
    loss_fn: Callable[[Any, torch.Tensor], torch.Tensor] | None = None
    """The mean loss from the model's output and the targets; default :func:`standard_loss`."""
    heldout_sources: dict[str, TokenData] = field(default_factory=dict)
    """Language models: stage 17's held-out sets by source name (default: ``heldout``, with
    ``meta["heldout_sources"]`` naming each row's source)."""
    build_empty_model: Callable[[], nn.Module] | None = None
    """The model to load a checkpoint's weights into (default ``build_model``): a model that
    ``build_model`` loads from pretrained weights need not load them to be overwritten."""
    hf_dir: str | None = None
    """The Hugging Face model directory (stage 18 exports a ``save_pretrained`` folder)."""

    def forward(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        if self.batch_format == "hf":
            from wonderland_ds.data.tokens import IGNORE

            return model(input_ids=x, attention_mask=(y != IGNORE).long(), labels=y)
        return model(x)

    def loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch (training's and stage 17's)."""
        if self.loss_fn is not None:
            return self.loss_fn(out, y)
        return standard_loss(out, y, self.kind, self.batch_format == "hf")

    def targets(self, y: torch.Tensor) -> int:
        """How many targets :meth:`loss` averages over (stage 17 weighs batches by it)."""
        from wonderland_ds.data.tokens import IGNORE

        if self.kind != "lm":
            return int(y.shape[0])
        return int((y[:, 1:] if self.batch_format == "hf" else y).ne(IGNORE).sum())

    def batch_loss(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.loss(self.forward(model, x, y), y)

    @property
    def source_key(self) -> Callable[[], str] | None:
        """The cheap source digest of ``make_splits`` when it is a :class:`Source` (built-in
        tasks); None otherwise, also when a task replaced a built-in's ``make_splits``."""
        return self.make_splits.key if isinstance(self.make_splits, Source) else None

    @property
    def fingerprint(self) -> str:
        """sha256 of the task name and its training data: stage 16 must see stage 15's."""
        if self.fingerprint_value is None:
            raise RuntimeError("task data not loaded")
        return self.fingerprint_value

    def with_data(self, train: Split, heldout: Split, fingerprint: str) -> Task:
        return dataclasses.replace(
            self, train=train, heldout=heldout, fingerprint_value=fingerprint
        )

    def materialize(self) -> Task:
        """The task with its raw splits loaded (in memory, not from the cache)."""
        if self.train is not None and (self.heldout is not None or self.heldout_sources):
            if self.fingerprint_value is not None:
                return self
            if not isinstance(self.train, Split):  # token files: the cheap fingerprint
                from wonderland_ds.data.tokens import fingerprint_of

                fp = fingerprint_of(self.train, self.name)
                return dataclasses.replace(self, fingerprint_value=fp)

            assert isinstance(self.heldout, Split)
            return self.with_data(self.train, self.heldout, fingerprint(self.train, self.name))
        if self.make_splits is None:
            raise Refused(f"task {self.name!r} has no data source", "give it make_splits")

        key = self.source_key() if self.source_key is not None else None  # before reading
        train, heldout = self.make_splits()
        task = self.with_data(train, heldout, fingerprint(train, self.name))
        return dataclasses.replace(task, source_key_value=key)


class ModelContractError(TypeError):
    """A model's output that the task's loss cannot use (named in the message)."""


def output_parts(out: Any) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(logits, loss) of a model's output: a tensor is logits; a ``ModelOutput`` or dict
    gives its ``logits`` and ``loss`` entries."""
    import torch

    if isinstance(out, torch.Tensor):
        return out, None
    if isinstance(out, dict) or hasattr(out, "keys"):  # ModelOutput is an OrderedDict
        logits, loss = out.get("logits"), out.get("loss")
    elif isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor):
        return out[0], None
    else:
        logits, loss = getattr(out, "logits", None), getattr(out, "loss", None)
    if logits is None and loss is None:
        raise ModelContractError(
            f"the model returned {type(out).__name__} without logits or loss: return a tensor"
            " of logits, or a ModelOutput/dict with 'logits' or 'loss'"
        )
    return logits, loss


def standard_loss(out: Any, y: torch.Tensor, kind: str, shift: bool) -> torch.Tensor:
    """Cross-entropy in fp32 with :data:`~wonderland_ds.data.tokens.IGNORE` ignored; the output's
    own ``loss`` when it has one (a ``transformers`` model given ``labels``). ``shift``:
    labels equal the inputs and position ``t`` predicts label ``t + 1``."""
    import torch.nn.functional as F

    from wonderland_ds.data.tokens import IGNORE

    logits, loss = output_parts(out)
    if loss is not None:
        return loss.float()
    assert logits is not None
    logits = logits.float()
    if kind != "lm":
        return F.cross_entropy(logits, y)
    if shift:
        logits, y = logits[:, :-1], y[:, 1:]
    if logits.shape[:-1] != y.shape:
        raise ModelContractError(
            f"logits of shape {tuple(logits.shape)} do not fit targets of shape"
            f" {tuple(y.shape)}: a language model returns (batch, tokens, vocabulary)"
        )
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), ignore_index=IGNORE)


def normalization_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0, dtype=np.float64)
    std = x.std(axis=0, dtype=np.float64)
    return mean.astype(np.float32), np.where(std < 1e-3, 1.0, std).astype(np.float32)


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


def __getattr__(name: str) -> Any:
    if name == "Normalize":  # re-exported for user tasks; torch is imported on first use
        from wonderland_ds.data.models import Normalize

        return Normalize
    raise AttributeError(name)


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


def fingerprint(train: Split, name: str) -> str:
    """sha256 of the task name and the training data (x and y bytes)."""
    h = hashlib.sha256(name.encode())
    h.update(np.ascontiguousarray(train.x).tobytes())
    h.update(np.ascontiguousarray(train.y).tobytes())
    return h.hexdigest()
