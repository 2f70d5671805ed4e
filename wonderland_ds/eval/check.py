"""``wonderland check --task``: the task's model and data tried on the CPU in seconds.

Imports the task, opens its data, builds the model and runs one forward and loss on the first
micro-batch of the real training stream, so what would crash every rank minutes after a
launch is a finding now: a model output the loss cannot use, a loss that is not a finite
scalar with a gradient, shapes that do not fit, a missing ``.norm`` for normalized tasks, and
everything the task's own loading refuses (missing files, sizes, token ids, positions).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data.tasks import Split, Task


def _first_micro_batch(task: Task, micro: int, seed: int) -> tuple[Any, Any]:
    from wonderland_ds.data.sampler import GlobalSampler

    train = task.train
    assert train is not None
    count = min(micro, len(train))
    if isinstance(train, Split):
        idx = np.sort(GlobalSampler(len(train), seed).indices(0, count))
        return np.asarray(train.x[idx]), np.asarray(train.y[idx])
    return train.take(np.sort(train.sampler(seed).indices(0, count)))


def check_task(spec: str, settings: WonderlandSettings, micro: int, file: str) -> list[Finding]:
    """Findings of one forward and loss of ``spec``'s model on one micro-batch."""
    t0 = time.perf_counter()
    where = "wonderland.task"
    try:
        from wonderland_ds.data.lm import load_task

        task = load_task(spec, settings).materialize()
        x, y = _first_micro_batch(task, micro, settings.seed)
    except Refused as exc:
        return exc.findings
    import torch

    from wonderland_ds.data.models import Normalize

    def bad(msg: str, fix: str) -> list[Finding]:
        return [Finding("task-forward", "error", f"task {spec!r}: {msg}", fix, file, where)]

    torch.manual_seed(settings.seed)
    big = _too_big_to_try(settings)
    if big is not None:
        return [Finding("task", "ok", f"task {task.name}: {big}", "", file, where)]
    try:
        model = task.build_model()
    except Refused as exc:
        return exc.findings
    except Exception as exc:  # the user's code: report it, never a traceback
        return bad(f"building the model failed: {type(exc).__name__}: {exc}", "fix build_model")
    if task.normalize and not isinstance(getattr(model, "norm", None), Normalize):
        return bad(
            "the task normalizes inputs but its model has no .norm Normalize module",
            "make the model's first module wonderland_ds.data.tasks.Normalize as .norm, or set"
            " normalize=False",
        )
    tx = torch.from_numpy(x)
    tx = tx.float() if tx.is_floating_point() else tx
    ty = torch.from_numpy(y)
    try:
        out = task.forward(model, tx, ty)
        loss = task.loss(out, ty)
    except Exception as exc:
        return bad(
            f"forward and loss on one micro-batch (inputs {tuple(tx.shape)} {tx.dtype}, targets"
            f" {tuple(ty.shape)} {ty.dtype}) failed: {type(exc).__name__}: {exc}",
            "return logits (a tensor) or a ModelOutput/dict with logits or loss; see"
            " docs/models-and-data.md",
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        return bad(f"the loss is {shape}, not a scalar tensor", "return a mean loss (a scalar)")
    if not loss.requires_grad:
        return bad("the loss has no gradient (computed without the model's parameters?)", "")
    if not torch.isfinite(loss.detach()):
        value = float(loss.detach())
        return bad(f"the loss is {value} on the first micro-batch", "check inputs and init")
    masking = []
    if task.document_eos is not None:
        from wonderland_ds.data.documents import refusal

        found = refusal(task, model, "wonderland.data.document_masking", file)
        if found is not None:
            return [found]
        masking = [
            Finding(
                "document-masking",
                "ok",
                f"{type(model).__name__} keeps attention and positions inside documents (EOS"
                f" {task.document_eos})",
                "",
                file,
                "wonderland.data.document_masking",
            )
        ]
    params = sum(p.numel() for p in model.parameters())
    dims = "x".join(str(d) for d in tx.shape)
    return [
        Finding(
            "task",
            "ok",
            f"task {task.name}: model of {params / 1e6:.2f}M parameters, one micro-batch"
            f" ({dims}) from the training data, loss {float(loss.detach()):.4f}"
            f" ({time.perf_counter() - t0:.1f} s)",
            "",
            file,
            where,
        )
    ] + masking


def _too_big_to_try(settings: WonderlandSettings) -> str | None:
    """Why one trial forward is skipped: a causal-LM model whose fp32 weights alone would take
    over a quarter of this host's available memory (the memory estimate still runs)."""
    import os

    if settings.model is None:
        return None
    from wonderland_ds.model.memory import model_shape

    need = model_shape(settings).params * 4
    try:
        with open("/proc/meminfo") as fh:
            avail = next(int(line.split()[1]) * 1024 for line in fh if "MemAvailable" in line)
    except (OSError, StopIteration):
        avail = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    if need <= avail / 4:
        return None
    return (
        f"the trial forward is skipped here: the fp32 model ({need / 1e9:.1f} GB) would take"
        f" over a quarter of this host's {avail / 1e9:.1f} GB available"
    )


def names_a_task(raw: dict[str, Any]) -> str | None:
    """The config's task when it is the user's (``causal-lm`` or ``module:function``); the
    built-in demo tasks are tested with the package."""
    section = raw.get("wonderland")
    task = section.get("task") if isinstance(section, dict) else None
    if isinstance(task, str) and (task == "causal-lm" or ":" in task):
        return task
    return None
