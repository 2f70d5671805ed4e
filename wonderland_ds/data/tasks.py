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
check the run's data before launching, and torch's import alone would add seconds to every
launch. Models and losses import it when first used.

A built-in task also has a ``source_key``: a cheap digest of what its data is made from (file
names, sizes and modification times, the code that builds it). The cache records it, so the
front proves a cache fresh without rebuilding the data; any difference falls back to the full
comparison (rebuild and fingerprint).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field
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
    document_eos: int | None = None
    """``"hf"`` language models with ``data.document_masking``: the token ending each document;
    attention and positions stay inside documents (``data/documents.py``). None: packed
    samples attend across documents."""

    def forward(self, model: Any, x: torch.Tensor, y: torch.Tensor) -> Any:
        if self.batch_format == "hf":
            from wonderland_ds.data.tokens import IGNORE

            if self.document_eos is not None:
                # No attention mask and no cache: transformers then builds the block-diagonal
                # mask from the restarted positions (a tail's padding comes last, under the
                # causal mask).
                from wonderland_ds.data.documents import positions

                pos, labels = positions(y, self.document_eos)
                return model(input_ids=x, position_ids=pos, labels=labels, use_cache=False)
            return model(input_ids=x, attention_mask=(y != IGNORE).long(), labels=y)
        return model(x)

    def labels(self, y: torch.Tensor) -> torch.Tensor:
        """The targets the loss counts: ``y``, with document masking less each document's
        first token (nothing is predicted across a document boundary)."""
        if self.document_eos is None:
            return y
        from wonderland_ds.data.documents import positions

        return positions(y, self.document_eos)[1]

    def loss(self, out: Any, y: torch.Tensor) -> torch.Tensor:
        """The mean loss of a batch (training's and stage 17's)."""
        y = self.labels(y)
        if self.loss_fn is not None:
            return self.loss_fn(out, y)
        return standard_loss(out, y, self.kind, self.batch_format == "hf")

    def aux_loss(self, out: Any) -> torch.Tensor | None:
        """A mixture-of-experts model's router load-balancing loss (``aux_loss`` in a
        ``transformers`` output; already in its ``loss``), detached, or None."""
        import torch

        aux = out.get("aux_loss") if hasattr(out, "keys") else getattr(out, "aux_loss", None)
        return aux.detach() if isinstance(aux, torch.Tensor) else None

    def targets(self, y: torch.Tensor) -> int:
        """How many targets :meth:`loss` averages over (stage 17 weighs batches by it)."""
        from wonderland_ds.data.tokens import IGNORE

        if self.kind != "lm":
            return int(y.shape[0])
        y = self.labels(y)
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
                from wonderland_ds.data.scans import fingerprint_of

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


def __getattr__(name: str) -> Any:
    if name == "Normalize":  # re-exported for user tasks; torch is imported on first use
        from wonderland_ds.data.models import Normalize

        return Normalize
    raise AttributeError(name)


def fingerprint(train: Split, name: str) -> str:
    """sha256 of the task name and the training data (x and y bytes)."""
    h = hashlib.sha256(name.encode())
    h.update(np.ascontiguousarray(train.x).tobytes())
    h.update(np.ascontiguousarray(train.y).tobytes())
    return h.hexdigest()
