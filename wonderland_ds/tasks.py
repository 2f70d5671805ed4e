"""Tasks: a model, its data splits and its loss, behind one small typed interface.

A user task is any ``module:function`` returning a :class:`Task` (``"task"`` in the config's
``wonderland`` section). The built-in ``digits`` task is scikit-learn's handwritten digits
(shipped inside scikit-learn, nothing is downloaded) with classes 3 and 8 cut to a minority
share, so that stage 17's per-class sweep has minority classes to watch.
"""

from __future__ import annotations

import hashlib
import importlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from .findings import Refused


@dataclass(frozen=True)
class Split:
    x: np.ndarray
    """float32 features, one row per sample."""
    y: np.ndarray
    """int64 class labels."""

    def __len__(self) -> int:
        return len(self.y)


@dataclass(frozen=True)
class Task:
    name: str
    train: Split
    heldout: Split
    num_classes: int
    build_model: Callable[[], nn.Module]
    """A fresh model whose first module is a :class:`Normalize` (stage 15 fills its stats)."""
    minority_classes: tuple[int, ...] = ()
    class_names: tuple[str, ...] = field(default_factory=tuple)

    @property
    def fingerprint(self) -> str:
        """sha256 of the task name and its training data: stage 16 must see stage 15's."""
        h = hashlib.sha256(self.name.encode())
        h.update(np.ascontiguousarray(self.train.x).tobytes())
        h.update(np.ascontiguousarray(self.train.y).tobytes())
        return h.hexdigest()


class Normalize(nn.Module):
    """Input normalization whose statistics are buffers: computed once by stage 15's
    pre-normalization pass, saved with every checkpoint, never trained."""

    mean: torch.Tensor
    std: torch.Tensor

    def __init__(self, features: int) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("std", torch.ones(features))

    def set_stats(self, mean: np.ndarray, std: np.ndarray) -> None:
        with torch.no_grad():
            self.mean.copy_(torch.as_tensor(mean, dtype=self.mean.dtype))
            self.std.copy_(torch.as_tensor(std, dtype=self.std.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x - self.mean.to(x.dtype)) / self.std.to(x.dtype)


def normalization_stats(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    mean = x.mean(axis=0, dtype=np.float64)
    std = x.std(axis=0, dtype=np.float64)
    return mean.astype(np.float32), np.where(std < 1e-3, 1.0, std).astype(np.float32)


class DigitsNet(nn.Module):
    """An MLP with a frozen random projection (a pretrained feature layer stand-in: it shows
    that frozen parameters survive a universal-checkpoint resume)."""

    def __init__(self, features: int = 64, hidden: int = 128, classes: int = 10) -> None:
        super().__init__()
        self.norm = Normalize(features)
        gen = torch.Generator().manual_seed(7)
        self.proj = nn.Linear(features, features)
        with torch.no_grad():
            self.proj.weight.copy_(torch.randn(features, features, generator=gen) / features**0.5)
            self.proj.bias.zero_()
        self.proj.requires_grad_(False)
        self.body = nn.Sequential(
            nn.Linear(2 * features, hidden), nn.ReLU(), nn.Dropout(0.1), nn.Linear(hidden, classes)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.norm(x)
        return self.body(torch.cat([z, torch.tanh(self.proj(z))], dim=-1))


def digits(minority: tuple[int, ...] = (3, 8), share: float = 0.12) -> Task:
    from sklearn.datasets import load_digits

    data = load_digits()
    x, y = data.data.astype(np.float32), data.target.astype(np.int64)
    rng = np.random.default_rng(20261130)  # fixed: the dataset, not the run, decides the cut
    keep = np.ones(len(y), dtype=bool)
    for c in minority:
        idx = np.flatnonzero(y == c)
        drop = rng.permutation(idx)[int(round(len(idx) * share)) :]
        keep[drop] = False
    x, y = x[keep], y[keep]
    heldout = np.zeros(len(y), dtype=bool)
    for c in range(10):  # stratified 25% held out
        idx = rng.permutation(np.flatnonzero(y == c))
        heldout[idx[: max(1, len(idx) // 4)]] = True
    return Task(
        name="digits",
        train=Split(x[~heldout], y[~heldout]),
        heldout=Split(x[heldout], y[heldout]),
        num_classes=10,
        build_model=DigitsNet,
        minority_classes=minority,
        class_names=tuple(str(c) for c in range(10)),
    )


BUILTIN: dict[str, Callable[[], Task]] = {"digits": digits}


def load(spec: str) -> Task:
    """A built-in task name or ``module:function``; a bad spec is a refusal, not a traceback."""
    if spec in BUILTIN:
        return BUILTIN[spec]()
    if ":" not in spec:
        raise Refused(
            f"unknown task {spec!r}",
            f"use a built-in task ({', '.join(BUILTIN)}) or 'module:function' returning a Task",
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
            "return wonderland_ds.tasks.Task(...)",
        )
    return task
