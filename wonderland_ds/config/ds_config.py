"""DeepSpeed JSON configs: load, validate without GPUs, and resolve for a world size.

The typed keys are in ``ds_models``; every other DeepSpeed key passes through unchanged to
``deepspeed.initialize``, but it must be a key DeepSpeed knows (``key_checks``), because
DeepSpeed silently ignores unknown top-level keys and typos inside ``checkpoint`` and
scheduler params. The rules a stage needs beyond DeepSpeed's are in ``rules``. All problems
are collected and reported at once as findings.

This module is the API callers import: ``validate``, ``check_file``, ``deepspeed_dict`` and,
from the modules it is built on, ``DSConfig``, ``load_json`` and ``batch_triangle``.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from wonderland_ds.config import auto
from wonderland_ds.config.batch import batch_triangle
from wonderland_ds.config.ds_models import WONDERLAND_KEY, DSConfig
from wonderland_ds.config.explain import pydantic_findings
from wonderland_ds.config.json_file import load_json
from wonderland_ds.config.key_checks import deepspeed_types, unknown_keys
from wonderland_ds.config.rules import engine_rules
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.findings import Finding, has_errors

__all__ = [
    "WONDERLAND_KEY",
    "DSConfig",
    "batch_triangle",
    "check_file",
    "deepspeed_dict",
    "load_json",
    "validate",
]


def validate(
    raw: dict[str, Any],
    file: str = "",
    world_size: int | None = None,
    stages: set[int] | None = None,
) -> tuple[DSConfig | None, WonderlandSettings | None, list[Finding]]:
    """Validate a parsed config; collect every problem. Never raises for bad input."""
    raw, filled, out = auto.fill(raw, file, world_size)  # "auto": filled, or refused by key
    out += auto.findings(filled, file)
    skip = {f.path for f in out if f.rule == "auto-value"}
    out += unknown_keys(raw, file)
    out += auto.bucket_findings(raw, file)
    settings: WonderlandSettings | None = None
    try:
        settings = WonderlandSettings.model_validate(raw.get(WONDERLAND_KEY, {}))
    except ValidationError as exc:
        out += pydantic_findings(exc, file, (WONDERLAND_KEY,), skip, "wonderland-settings")
    cfg: DSConfig | None = None
    try:
        cfg = DSConfig.model_validate(raw)
    except ValidationError as exc:
        out += pydantic_findings(exc, file, (), skip, "type")
    if cfg is not None:
        out += engine_rules(
            cfg, file, world_size, stages or set(), settings or WonderlandSettings()
        )
    seen = {f.path for f in out if f.severity == "error"}
    out += [f for f in deepspeed_types(raw, file) if f.path not in seen]
    # An "auto" value is reported once, as auto-value, not again by the checks it trips; a
    # typo caught both by the key check (with "did you mean") and by a model, once.
    out = [f for f in out if f.rule == "auto-value" or f.path not in skip]
    firsts = {(f.rule, f.path, f.severity): f for f in reversed(out)}
    out = [f for f in out if firsts[(f.rule, f.path, f.severity)] is f]
    return cfg, settings, out


def check_file(
    path: str | Path, world_size: int | None = None, stages: set[int] | None = None
) -> list[Finding]:
    raw, found = load_json(path)
    if raw is None:
        return found
    *_, found = validate(raw, str(path), world_size, stages)
    return found


def deepspeed_dict(raw: dict[str, Any], grad_acc: int | None, world_size: int) -> dict[str, Any]:
    """The dict handed to deepspeed.initialize: ``"auto"`` filled (``auto.py``), our section
    stripped, triangle re-closed.

    ``grad_acc`` (``--grad-acc-steps``) overrides the config; the micro batch is kept and
    train_batch_size recomputed for ``world_size`` so DeepSpeed's own assertion holds.
    """
    out = copy.deepcopy(auto.fill(raw, "", world_size)[0])  # a refused "auto": check's error
    out.pop(WONDERLAND_KEY, None)
    cfg = DSConfig.model_validate(out)
    if grad_acc is not None:
        cfg = cfg.model_copy(update={"gradient_accumulation_steps": grad_acc})
        if cfg.train_micro_batch_size_per_gpu is not None:
            cfg = cfg.model_copy(update={"train_batch_size": None})
    triangle, found = batch_triangle(cfg, world_size)
    if triangle is None or has_errors(found):
        raise ValueError("; ".join(f.message for f in found))
    (
        out["train_batch_size"],
        out["train_micro_batch_size_per_gpu"],
        out["gradient_accumulation_steps"],
    ) = triangle
    return out
