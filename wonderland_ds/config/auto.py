"""``"auto"`` values, as Hugging Face's DeepSpeed configs hold them: filled where the value
follows from something this engine knows, refused by key where it does not.

The Hugging Face integration (``transformers.integrations.deepspeed``) fills ``"auto"`` from
the ``Trainer``'s arguments and the model. Here the sources are the model's ``config.json``
(bucket sizes, as the integration sizes them from ``hidden_size``), the world size and the
other batch keys, the stage plan (``train_steps`` and ``min_warmup_steps``) and the
optimizer's own ``lr``. A key with no such source (the learning rate itself, the precision
switches, the clipping) is refused, naming what to write. The fill is a pure function of the
config, the model directory and the world size, so every launch and resume of a run computes
the same numbers; the resolved config each stage ran with is its ``ds_config.json``.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from wonderland_ds.config.explain import join_loc
from wonderland_ds.config.key_checks import auto_values
from wonderland_ds.core.findings import Finding

BATCH = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps")
BUCKETS = (
    "zero_optimization.reduce_bucket_size",
    "zero_optimization.stage3_prefetch_bucket_size",
    "zero_optimization.stage3_param_persistence_threshold",
)

#: What to write for an ``"auto"`` that nothing here can fill.
_WRITE = {
    "optimizer.params.lr": "the learning rate, e.g. 3e-4",
    "optimizer.params.betas": "e.g. [0.9, 0.95]",
    "optimizer.params.eps": "e.g. 1e-8",
    "optimizer.params.weight_decay": "e.g. 0.1",
    "fp16.enabled": "true or false (fp16 needs a GPU; bf16 on Ampere or newer)",
    "bf16.enabled": "true or false (bf16 on Ampere or newer GPUs; fp32 when both are false)",
    "gradient_clipping": "the max gradient norm, e.g. 1.0 (0 turns clipping off)",
}


@dataclass(frozen=True)
class Filled:
    path: str
    value: Any
    source: str


def hidden_size(raw: dict[str, Any]) -> tuple[int | None, str]:
    """The model's hidden size from its ``config.json`` (``wonderland.model.hf``), as the
    Hugging Face integration reads it, and where it came from; None and why not."""
    model = (raw.get("wonderland") or {}).get("model") or {}
    hf = model.get("hf") if isinstance(model, dict) else None
    if not isinstance(hf, str):
        return None, "the task has no wonderland.model.hf config.json to size it from"
    try:
        config = json.loads((Path(hf).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None, f"{hf}/config.json is not readable (the model's own finding says why)"
    for node, prefix in ((config, ""), (config.get("text_config") or {}, "text_config.")):
        for key in ("hidden_size", "n_embd", "d_model"):
            if isinstance(node.get(key), int):
                return node[key], f"{prefix}{key} {node[key]}"
        if isinstance(node.get("hidden_sizes"), list) and node["hidden_sizes"]:
            return max(node["hidden_sizes"]), f"the largest of {prefix}hidden_sizes"
    return None, f"{hf}/config.json has no hidden_size (nor n_embd, d_model, hidden_sizes)"


def _train_steps(raw: dict[str, Any]) -> int | None:
    """The LR schedule's length: the steps of the training stages, 15 and 16 and any other
    with its own ``stage_train_steps``, which share one schedule (each resumes the previous
    one's scheduler)."""
    from pydantic import ValidationError

    from wonderland_ds.config import stages
    from wonderland_ds.config.settings import WonderlandSettings

    try:
        settings = WonderlandSettings.model_validate(raw.get("wonderland") or {})
    except ValidationError:
        return None
    named = {int(k) for k in settings.stage_train_steps if stages.get(int(k)).kind == "train"}
    return sum(settings.steps_for(n) for n in {15, 16} | named)


def _warmup(raw: dict[str, Any]) -> int | None:
    from pydantic import ValidationError

    from wonderland_ds.config.settings import WonderlandSettings

    try:
        settings = WonderlandSettings.model_validate(raw.get("wonderland") or {})
    except ValidationError:
        return None
    return max(1, settings.min_warmup_steps)


def _set(node: dict[str, Any], loc: tuple[Any, ...], value: Any) -> None:
    for key in loc[:-1]:
        node = node[key]
    if value is _DROP:
        del node[loc[-1]]
    else:
        node[loc[-1]] = value


_DROP = object()


def fill(
    raw: dict[str, Any], file: str = "", world_size: int | None = None
) -> tuple[dict[str, Any], list[Filled], list[Finding]]:
    """(the config with every fillable ``"auto"`` filled, what was filled, refusals of the
    rest). A batch key left ``"auto"`` is dropped, for the batch triangle to close from the
    other two and the world size (its value is reported when the world size is known)."""
    autos = auto_values(raw)
    if not autos:
        return raw, [], []
    out = copy.deepcopy(raw)
    filled: list[Filled] = []
    refused: list[Finding] = []

    def refuse(path: str, why: str, write: str) -> None:
        refused.append(
            Finding(
                "auto-value",
                "error",
                f'"auto" has no source here: {why}',
                f"write the value: {write}",
                file,
                path,
            )
        )

    paths = {join_loc(loc): loc for loc in autos}
    batch_autos = [k for k in BATCH if k in paths]
    keep = "train_batch_size" if "train_batch_size" in batch_autos else None
    if keep is None and len(batch_autos) == 1:
        keep = batch_autos[0]
    hidden, hidden_from = hidden_size(raw) if any(p in paths for p in BUCKETS) else (None, "")
    lr = ((raw.get("optimizer") or {}).get("params") or {}).get("lr")
    for path, loc in paths.items():
        value: Any = None
        source = ""
        if path in BATCH:
            if path != keep:
                refuse(
                    path,
                    f'{", ".join(batch_autos)} are all "auto"; one of the batch keys can be'
                    " derived from the other two and the world size",
                    'the micro batch and gradient accumulation (train_batch_size may stay "auto")',
                )
                continue
            value, source = _DROP, "derived from the other two batch keys and the world size"
        elif path in BUCKETS:
            if hidden is None:
                refuse(path, hidden_from, "a number of elements")
                continue
            value = {
                BUCKETS[0]: hidden * hidden,
                BUCKETS[1]: int(0.9 * hidden * hidden),
                BUCKETS[2]: 10 * hidden,
            }[path]
            rule = {BUCKETS[0]: "squared", BUCKETS[1]: "squared x 0.9", BUCKETS[2]: "x 10"}
            source = f"the model's {hidden_from}, {rule[path]}"
        elif path == "scheduler.params.total_num_steps":
            value, source = _train_steps(raw), "the training stages' train_steps"
        elif path == "scheduler.params.warmup_num_steps":
            value, source = _warmup(raw), "wonderland.min_warmup_steps"
        elif path == "scheduler.params.warmup_max_lr":
            if not isinstance(lr, (int, float)) or isinstance(lr, bool):
                refuse(path, "it follows optimizer.params.lr, which is not a number", "the peak LR")
                continue
            value, source = lr, "optimizer.params.lr"
        elif path == "scheduler.params.warmup_min_lr":
            value, source = 0, "0, as the Hugging Face integration fills it"
        else:
            refuse(
                path,
                "the Hugging Face Trainer fills it from its own arguments, which this engine"
                " does not have",
                _WRITE.get(path, "the concrete value"),
            )
            continue
        if value is None:  # the wonderland section's own finding says why
            refuse(path, "the wonderland section does not validate", "the concrete value")
            continue
        _set(out, loc, value)
        filled.append(Filled(path, value, source))
    if world_size is not None and keep is not None and not refused:
        filled = [_batch_value(f, out, world_size) if f.path == keep else f for f in filled]
    return out, filled, refused


def _batch_value(f: Filled, raw: dict[str, Any], world: int) -> Filled:
    """The dropped batch key's value once the triangle closes at ``world``."""
    from pydantic import ValidationError

    from wonderland_ds.config.batch import batch_triangle
    from wonderland_ds.config.ds_models import DSConfig

    try:
        triangle, _ = batch_triangle(DSConfig.model_validate(raw), world)
    except ValidationError:
        return f
    if triangle is None:
        return f
    return Filled(f.path, triangle[BATCH.index(f.path)], f"{f.source} ({world})")


def findings(filled: list[Filled], file: str = "") -> list[Finding]:
    """One ``auto-filled`` line per value, for ``check`` and the launch's report."""
    return [
        Finding(
            "auto-filled",
            "info",
            f'"auto" -> {"derived at launch" if f.value is _DROP else f.value} ({f.source})',
            "",
            file,
            f.path,
        )
        for f in filled
    ]


#: DeepSpeed's ZeRO defaults (``runtime/zero/config.py``), sized for no model in particular.
DEFAULTS = {"reduce_bucket_size": 500_000_000, "stage3_prefetch_bucket_size": 50_000_000}
OVERSIZED = 8
"""A default this many times the ``"auto"`` value is worth a warning."""


def bucket_findings(raw: dict[str, Any], file: str = "") -> list[Finding]:
    """ZeRO-3 buckets left at DeepSpeed's defaults that exceed the model's needs many times
    over: the per-rank buffer they cost, and what ``"auto"`` would give. An explicit value is
    the user's and is not judged."""
    zero = raw.get("zero_optimization")
    if not isinstance(zero, dict) or zero.get("stage") != 3:
        return []
    missing = [k for k in DEFAULTS if k not in zero]
    hidden, source = hidden_size(raw) if missing else (None, "")
    if hidden is None:
        return []
    half = any(
        isinstance(raw.get(k), dict) and raw[k].get("enabled") is True for k in ("bf16", "fp16")
    )
    width = 2 if half else 4
    out = []
    for key in missing:
        auto = hidden * hidden if key == "reduce_bucket_size" else int(0.9 * hidden * hidden)
        default = DEFAULTS[key]
        if default < OVERSIZED * auto:
            continue
        what = (
            "each rank fills a flat gradient buffer of that many elements (contiguous_gradients)"
            if key == "reduce_bucket_size"
            else "each rank may gather that many parameter elements ahead of use"
        )
        out.append(
            Finding(
                "zero-bucket-size",
                "warn",
                f"{key} is DeepSpeed's default {default:,} elements: {what}, {default:,} x"
                f" {width} bytes = {default * width / 2**30:.2f} GiB per rank, {default / auto:.0f}"
                f" times what the model needs ({source}: {auto:,})",
                f'set zero_optimization.{key} to "auto" (fills {auto:,}) or to a size of your'
                " choice",
                file,
                f"zero_optimization.{key}",
            )
        )
    return out
