"""Building the model a stage trains, scores or resumes into.

Under ZeRO-3 no rank ever holds a full copy: a ``transformers`` model is built with a
``HfDeepSpeedConfig`` alive (``from_config``/``from_pretrained`` then enter
``deepspeed.zero.Init`` themselves, initialize or load one module at a time and partition it at
once; rank 0 reads the safetensors, memory-mapped), any other model inside
``deepspeed.zero.Init``. Sparse MoE blocks become ZeRO-3 leaf modules, so ranks whose tokens
reach different experts fetch the same parameters. ZeRO-1/2 build the whole model, as
DeepSpeed keeps it whole on every rank anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, Protocol

from wonderland_ds.config.settings import HFModel
from wonderland_ds.core.distributed import log
from wonderland_ds.core.findings import Refused

if TYPE_CHECKING:
    from torch import nn


class Buildable(Protocol):
    """What :func:`build` needs of a task (``data.tasks.Task`` has it)."""

    @property
    def build_model(self) -> Callable[[], nn.Module]: ...
    @property
    def build_empty_model(self) -> Callable[[], nn.Module] | None: ...
    @property
    def hf_dir(self) -> str | None: ...


#: transformers reads the ZeRO-3 config through a weak reference: it lives here, per process.
_KEPT: list[Any] = []


def zero_stage(ds_dict: dict[str, Any]) -> int:
    return int((ds_dict.get("zero_optimization") or {}).get("stage", 0) or 0)


def engine_config(ds_dict: dict[str, Any]) -> dict[str, Any]:
    """The DeepSpeed config without wonderland's own section."""
    return {k: v for k, v in ds_dict.items() if k != "wonderland"}


@contextmanager
def partitioned(ds_dict: dict[str, Any], hf: bool) -> Iterator[None]:
    """The context a model is built in: partitioned at construction under ZeRO-3."""
    if zero_stage(ds_dict) != 3:
        if _KEPT:
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
            _KEPT.clear()
        yield
        return
    cfg = engine_config(ds_dict)
    if hf:
        from transformers.integrations import HfDeepSpeedConfig

        _KEPT[:] = [HfDeepSpeedConfig(cfg)]
        yield
        return
    import deepspeed

    with deepspeed.zero.Init(config_dict_or_path=cfg):
        yield


def build(task: Buildable, ds_dict: dict[str, Any], empty: bool = False) -> nn.Module:
    """The task's model (``empty``: the one a checkpoint's weights are loaded into)."""
    make = (task.build_empty_model or task.build_model) if empty else task.build_model
    with partitioned(ds_dict, task.hf_dir is not None):
        model = make()
    if zero_stage(ds_dict) == 3:
        mark_leaf_modules(model)
    return model


def tied(model: nn.Module) -> set[str]:
    """Names of parameters that share storage with an earlier one (tied embeddings)."""
    seen: dict[int, str] = {}
    out = set()
    for name, p in model.named_parameters(remove_duplicate=False):
        if id(p) in seen:
            out.add(name)
        seen.setdefault(id(p), name)
    return out


def moe_blocks(model: nn.Module) -> list[type]:
    """The model's sparse MoE block classes (transformers names them ``...SparseMoeBlock``)."""
    return sorted(
        {type(m) for m in model.modules() if type(m).__name__.endswith("SparseMoeBlock")},
        key=lambda c: c.__name__,
    )


def mark_leaf_modules(model: nn.Module) -> list[str]:
    """ZeRO-3 fetches a leaf module's parameters all at once, whichever experts run."""
    classes = moe_blocks(model)
    if classes:
        from wonderland_ds.core import ds_internals

        ds_internals.attr("deepspeed.utils", "set_z3_leaf_modules")(model, classes)
    return [c.__name__ for c in classes]


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise Refused(
            "task causal-lm needs the transformers package",
            "pip install 'wonderland_ds[hf]' (transformers)",
        ) from None
    transformers.logging.set_verbosity_error()  # its load reports go to stage logs otherwise
    return transformers


def build_hf(spec: HFModel, empty: bool = False) -> nn.Module:
    """``AutoModelForCausalLM`` from the directory: its weights (``init: weights``) or a
    seeded random initialization; ``empty``: random, to be overwritten by a checkpoint. The
    levers of ``wonderland.model`` applied."""
    import torch

    tf = import_transformers()
    kwargs = {"dtype": getattr(torch, spec.dtype), "attn_implementation": spec.attn_implementation}
    try:
        model = _load(tf, spec, empty, kwargs)
    except (ValueError, ImportError) as exc:
        if "attention implementation" not in str(exc) and "attn_implementation" not in str(exc):
            raise
        if spec.attn_implementation != "sdpa":
            raise Refused(
                f"wonderland.model.attn_implementation {spec.attn_implementation!r}: {exc}",
                'use "eager" (every architecture has it)',
            ) from None
        # sdpa (the default) where the architecture has no such kernel (Gemma2): eager, said.
        log("model.attn_implementation: this architecture has no sdpa attention; using eager")
        model = _load(tf, spec, empty, kwargs | {"attn_implementation": "eager"})
    return _with_levers(model, spec)


def _with_levers(model: Any, spec: HFModel) -> nn.Module:
    """The settings that live on the built model: no KV cache, the router loss, checkpointing."""
    model.config.use_cache = False  # training and scoring never decode: no KV cache
    if hasattr(model.config, "output_router_logits"):
        model.config.output_router_logits = spec.router_aux_loss
    if spec.gradient_checkpointing:
        if not model.supports_gradient_checkpointing:
            raise Refused(
                f"wonderland.model.gradient_checkpointing: {type(model).__name__} does not"
                " support it",
                'set "gradient_checkpointing": false',
            )
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mark_leaf_modules(model)
    return model


def _load(tf: Any, spec: HFModel, empty: bool, kwargs: dict[str, Any]) -> nn.Module:
    if spec.init == "weights" and not empty:
        return tf.AutoModelForCausalLM.from_pretrained(spec.hf, **kwargs)
    config = tf.AutoConfig.from_pretrained(spec.hf)
    return tf.AutoModelForCausalLM.from_config(config, **kwargs)


def for_scoring(model: nn.Module) -> nn.Module:
    """Held-out scoring reads the language-model loss alone, as the exported model reports it."""
    config: Any = getattr(model, "config", None)
    if getattr(config, "output_router_logits", False):
        config.output_router_logits = False
    return model
