"""DeepSpeed JSON configs: load, validate without GPUs, and resolve for a world size.

The pydantic models below type the keys the engine depends on (batch sizes, precision, ZeRO,
optimizer, scheduler, checkpoint). Every other DeepSpeed key passes through unchanged to
``deepspeed.initialize``, but it must be a key DeepSpeed knows (``ds_keys``), because
DeepSpeed silently ignores unknown top-level keys and typos inside ``checkpoint`` and
scheduler params. All problems are collected and reported at once as findings.
"""

from __future__ import annotations

import copy
import difflib
import json
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    field_validator,
)

from wonderland_ds.config import ds_keys
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.findings import Finding, has_errors

WONDERLAND_KEY = "wonderland"


class _Typed(BaseModel):
    # extra="allow": unknown keys are reported by _unknown_keys with "did you mean", not here.
    model_config = ConfigDict(extra="allow", strict=True)


class FP16(_Typed):
    enabled: bool = False
    loss_scale: float = Field(0, ge=0)
    """0 means dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=64)
    loss_scale_window: int = Field(1000, ge=0)
    hysteresis: int = Field(2, ge=0)
    min_loss_scale: float = Field(1, ge=0)


class BF16(_Typed):
    enabled: bool = False


class Offload(_Typed):
    device: Literal["cpu", "nvme", "none"] = "none"
    nvme_path: str | None = None


class Zero(_Typed):
    stage: int = Field(0, ge=0, le=3)
    offload_optimizer: Offload | None = None
    offload_param: Offload | None = None


class Optimizer(_Typed):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class WarmupLRParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    warmup_min_lr: float = Field(0.0, ge=0)
    warmup_max_lr: float = Field(0.001, ge=0)
    warmup_num_steps: int = Field(1000, ge=0)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


class WarmupDecayLRParams(WarmupLRParams):
    total_num_steps: int = Field(ge=1)


class WarmupCosineLRParams(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    total_num_steps: int = Field(ge=1)
    warmup_min_ratio: float = Field(0.0, ge=0)
    warmup_num_steps: int = Field(1000, ge=0)
    cos_min_ratio: float = Field(0.0001, ge=0)
    warmup_type: Literal["log", "linear"] = "log"
    last_batch_iteration: int = -1


#: Scheduler types whose params are typed (typos refused); other types pass through.
SCHEDULER_PARAMS: dict[str, type[BaseModel]] = {
    "WarmupLR": WarmupLRParams,
    "WarmupDecayLR": WarmupDecayLRParams,
    "WarmupCosineLR": WarmupCosineLRParams,
}
#: The optimizer names DeepSpeed 0.19's engine builds itself (``DEEPSPEED_OPTIMIZERS``; any
#: case). Any other name is looked up as ``getattr(torch.optim, name)`` at ``initialize``, on
#: every rank, after the launch: checked here against :func:`torch_optimizers` (a test holds
#: both lists to the installed DeepSpeed and torch).
DEEPSPEED_OPTIMIZERS = (
    "adagrad",
    "adam",
    "adamw",
    "lamb",
    "muadam",
    "muadamw",
    "musgd",
    "lion",
    "muon",
)
TORCH_OPTIMIZERS = (
    "ASGD", "Adadelta", "Adafactor", "Adagrad", "Adam", "AdamW", "Adamax", "LBFGS", "Muon",
    "NAdam", "RAdam", "RMSprop", "Rprop", "SGD", "SparseAdam",
)  # fmt: skip


def torch_optimizers() -> set[str]:
    return set(TORCH_OPTIMIZERS)


KNOWN_SCHEDULERS = ("WarmupLR", "WarmupDecayLR", "WarmupCosineLR", "OneCycle", "LRRangeTest")


class Scheduler(_Typed):
    type: str
    params: dict[str, Any] = Field(default_factory=dict)


class Checkpoint(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    load_universal: bool = False
    tag_validation: str = "Warn"
    use_node_local_storage: bool = False
    parallel_write: dict[str, Any] | None = None
    checkpoint_serialization: bool = True
    writer: dict[str, Any] | None = None

    @field_validator("tag_validation")
    @classmethod
    def _tag_validation(cls, value: str) -> str:
        # DeepSpeed upper-cases the value before comparing.
        if value.upper() not in ("IGNORE", "WARN", "FAIL"):
            raise ValueError("tag_validation must be Ignore, Warn or Fail")
        return value


class DSConfig(_Typed):
    """The part of a DeepSpeed config that wonderland relies on."""

    train_batch_size: int | None = Field(None, ge=1)
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    gradient_clipping: float = Field(0.0, ge=0)
    steps_per_print: int = Field(10, ge=1)
    fp16: FP16 = Field(default_factory=FP16)
    bf16: BF16 = Field(default_factory=BF16, validation_alias=AliasChoices("bf16", "bfloat16"))
    """DeepSpeed still reads the old name ``bfloat16`` when ``bf16`` is absent."""
    zero_optimization: Zero = Field(default_factory=Zero)
    optimizer: Optimizer | None = None
    scheduler: Scheduler | None = None
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"


# ---------------------------------------------------------------- loading


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows to infinity")
    return value


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def load_json(path: str | Path) -> tuple[dict[str, Any] | None, list[Finding]]:
    """Read a JSON object; never raises for a user mistake (returns an error finding)."""
    p, file = Path(path), str(path)

    def fail(msg: str, fix: str) -> tuple[None, list[Finding]]:
        return None, [Finding("config-unreadable", "error", msg, fix, file)]

    if not p.exists():
        return fail("file does not exist", "pass the path of a DeepSpeed JSON config")
    if p.is_dir():
        return fail("is a directory, not a config file", "pass a .json file inside it")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return fail(f"cannot be read: {exc}", "check the file's permissions and encoding (UTF-8)")
    if not text.strip():
        return fail(
            "is empty", "write a JSON object, e.g. a copy of ds_configs/cpu_zero2_bf16.json"
        )
    try:
        data = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_float=_finite,
        )
    except json.JSONDecodeError as exc:
        return fail(
            f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            "fix the JSON syntax there (trailing commas and comments are not JSON)",
        )
    except ValueError as exc:
        return fail(f"is not valid JSON: {exc}", "keep each key once; numbers must be finite")
    except RecursionError:
        return fail("is nested too deeply to be a config", "a config is a few levels deep")
    if not isinstance(data, dict):
        return fail(
            f"top level is a JSON {_JSON_TYPES.get(type(data), 'null')}, not an object",
            "a DeepSpeed config is a JSON object: { ... }",
        )
    return data, []


# ---------------------------------------------------------------- checks


def _join(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _auto_values(node: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    if isinstance(node, str) and node.strip().lower() == "auto":
        return [loc]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in _auto_values(v, (*loc, k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in _auto_values(v, (*loc, i))]
    return []


def _did_you_mean(key: str, candidates: frozenset[str] | set[str]) -> str:
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}? " if close else ""


def _fix_for(err_type: str, loc: tuple[Any, ...]) -> str:
    if err_type in ("int_type", "int_parsing", "int_from_float"):
        return "use a whole JSON number without quotes, e.g. 8"
    if err_type in ("float_type", "float_parsing"):
        return "use a JSON number without quotes, e.g. 1.0"
    if err_type == "bool_type":
        return "use true or false (JSON booleans, no quotes)"
    if err_type == "extra_forbidden":
        return "remove the key (or correct its spelling)"
    if err_type == "missing":
        return f"add {_join(loc)}"
    if err_type.startswith(("greater", "less")):
        return "use a value in the allowed range"
    if err_type == "literal_error":
        return "use one of the allowed values"
    return "correct the value"


def _pydantic_findings(
    exc: ValidationError, file: str, prefix: tuple[Any, ...], skip: set[str], rule: str
) -> list[Finding]:
    out = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        path = _join(loc)
        if path in skip:
            continue
        if err["type"] == "extra_forbidden":
            rule_, msg = "unknown-key", f"unknown key {loc[-1]!r}"
        else:
            rule_, msg = rule, f"{err['msg']} (got {err.get('input')!r})"
        out.append(Finding(rule_, "error", msg, _fix_for(err["type"], loc), file, path))
    return out


def _section(raw: dict[str, Any], dotted: str) -> Any:
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


_LAX_TYPES: dict[str, Any] = {"int": int, "bool": bool, "float": float, "str": str, "list": list}
_COMM_DTYPES = ("fp16", "bf16", "fp32")


def _deepspeed_types(raw: dict[str, Any], file: str) -> list[Finding]:
    """Values DeepSpeed's own pydantic sections refuse (it coerces, e.g. "8" -> 8, as here)."""
    out: list[Finding] = []
    for section, (relpath, cls) in ds_keys.SECTION_MODELS.items():
        body = _section(raw, section)
        if body is None:
            continue
        if not isinstance(body, dict):
            out.append(
                Finding(
                    "type",
                    "error",
                    f"{section} must be a JSON object (got {body!r})",
                    f'write "{section}": {{...}}',
                    file,
                    section,
                )
            )
            continue
        schema = ds_keys.model_schema(relpath, cls)
        for key, value in body.items():
            spec = schema.get(key)
            name = spec.annotation if spec else ""
            optional = name.startswith("Optional[") and name.endswith("]")
            py_type = _LAX_TYPES.get(name[9:-1] if optional else name)
            if spec is None or py_type is None or (optional and value is None):
                continue
            path = f"{section}.{key}"
            try:
                coerced = TypeAdapter(py_type).validate_python(value)
            except ValidationError as exc:
                err = exc.errors()[0]
                out.append(
                    Finding(
                        "type",
                        "error",
                        f"DeepSpeed refuses {value!r}: {err['msg']}",
                        _fix_for(err["type"], (section, key)),
                        file,
                        path,
                    )
                )
                continue
            ops = {"gt": float.__gt__, "ge": float.__ge__, "lt": float.__lt__, "le": float.__le__}
            for op, bound in spec.bounds:
                if isinstance(coerced, (int, float)) and not ops[op](float(coerced), bound):
                    out.append(
                        Finding(
                            "type",
                            "error",
                            f"DeepSpeed requires {key} {op} {bound:g} (got {value!r})",
                            "use a value in the allowed range",
                            file,
                            path,
                        )
                    )
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        value = raw.get(key)
        if value is not None and not (isinstance(value, str) and value.lower() in _COMM_DTYPES):
            out.append(
                Finding(
                    "type",
                    "error",
                    f"DeepSpeed refuses {key} {value!r}",
                    f"use one of {', '.join(_COMM_DTYPES)} (or drop the key)",
                    file,
                    key,
                )
            )
    return out


def _unknown_keys(raw: dict[str, Any], file: str) -> list[Finding]:
    out: list[Finding] = []
    known = ds_keys.known_keys() | {WONDERLAND_KEY}
    for key in raw:
        if key in ds_keys.removed_keys():
            out.append(
                Finding(
                    "removed-key",
                    "error",
                    f"{key!r} was removed from DeepSpeed 0.19, which refuses configs that contain it",
                    "delete the key (see DeepSpeed issue #8489 for replacements)",
                    file,
                    key,
                )
            )
        elif key not in known:
            out.append(
                Finding(
                    "unknown-key",
                    "error",
                    f"DeepSpeed does not know the top-level key {key!r} and would silently ignore it",
                    f"{_did_you_mean(key, known)}remove or correct the key",
                    file,
                    key,
                )
            )
    sections = {name: ds_keys.section_keys(name) for name in ds_keys.SECTION_MODELS}
    sections["checkpoint"] = frozenset(Checkpoint.model_fields)
    for section, allowed in sections.items():
        body = _section(raw, section)
        if isinstance(body, dict):
            for key in body:
                if key not in allowed:
                    out.append(
                        Finding(
                            "unknown-key",
                            "error",
                            f"unknown key {key!r} in {section}",
                            f"{_did_you_mean(key, allowed)}remove or correct the key",
                            file,
                            f"{section}.{key}",
                        )
                    )
    return out


def batch_triangle(
    cfg: DSConfig, world_size: int | None, file: str = ""
) -> tuple[tuple[int, int, int] | None, list[Finding]]:
    """Close train_batch = micro x grad_acc x data-parallel size, as DeepSpeed does.

    Returns the (train_batch, micro, grad_acc) DeepSpeed would use, or findings.
    """
    tb, mb, gas = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    w = world_size

    def err(msg: str, fix: str, path: str = "train_batch_size") -> tuple[None, list[Finding]]:
        return None, [Finding("batch-triangle", "error", msg, fix, file, path)]

    if tb is None and mb is None:
        return err(
            "neither train_batch_size nor train_micro_batch_size_per_gpu is set",
            "set train_micro_batch_size_per_gpu and gradient_accumulation_steps",
        )
    if w is None:
        if tb is not None and mb is not None and gas is not None:
            if tb % (mb * gas):
                return err(
                    f"train_batch_size {tb} is not a multiple of micro {mb} x grad_acc {gas}"
                    f" = {mb * gas}: no data-parallel size closes the triangle",
                    f"set train_batch_size to {mb * gas} x the number of GPUs",
                )
            return (tb, mb, gas), [
                Finding(
                    "batch-triangle",
                    "info",
                    f"batch sizes imply a data-parallel size of {tb // (mb * gas)}",
                    "",
                    file,
                    "train_batch_size",
                )
            ]
        return None, [
            Finding(
                "batch-triangle",
                "info",
                "world size unknown: batch-size triangle checked only when --hostfile or"
                " --world-size is given",
                "",
                file,
                "train_batch_size",
            )
        ]
    if tb is not None and mb is not None and gas is not None:
        if tb != mb * gas * w:
            return err(
                f"train_batch_size {tb} != micro {mb} x grad_acc {gas} x world size {w}"
                f" = {mb * gas * w}",
                f"set train_batch_size to {mb * gas * w}, or drop it and let it be derived",
            )
        return (tb, mb, gas), []
    if tb is not None and mb is not None:
        if tb % (mb * w):
            return err(
                f"train_batch_size {tb} is not divisible by micro {mb} x world size {w}",
                f"use a train_batch_size that is a multiple of {mb * w}",
            )
        return (tb, mb, tb // (mb * w)), []
    if tb is not None and gas is not None:
        if tb % (gas * w):
            return err(
                f"train_batch_size {tb} is not divisible by grad_acc {gas} x world size {w}",
                f"use a train_batch_size that is a multiple of {gas * w}",
            )
        return (tb, tb // (gas * w), gas), []
    if tb is not None:
        if tb % w:
            return err(
                f"train_batch_size {tb} is not divisible by world size {w}",
                f"use a multiple of {w}",
            )
        return (tb, tb // w, 1), []
    assert mb is not None
    g = gas or 1
    return (mb * g * w, mb, g), []


def _rules(
    cfg: DSConfig,
    raw: dict[str, Any],
    file: str,
    world_size: int | None,
    stages: set[int],
    settings: WonderlandSettings,
) -> list[Finding]:
    out: list[Finding] = []
    if cfg.fp16.enabled and cfg.bf16.enabled:
        out.append(
            Finding(
                "precision-conflict",
                "error",
                "fp16 and bf16 are both enabled",
                "enable one: bf16 on A100/H100, fp16 on older GPUs",
                file,
                "fp16.enabled",
            )
        )
    if cfg.fp16.enabled and cfg.fp16.loss_scale == 0:
        if cfg.fp16.loss_scale_window == 0:
            out.append(
                Finding(
                    "loss-scale",
                    "error",
                    "dynamic loss scaling with loss_scale_window 0 never raises the scale again",
                    "use loss_scale_window 1000 (DeepSpeed's default)",
                    file,
                    "fp16.loss_scale_window",
                )
            )
        if cfg.fp16.min_loss_scale == 0:
            out.append(
                Finding(
                    "loss-scale",
                    "error",
                    "dynamic loss scaling with min_loss_scale 0 lets the scale collapse to zero",
                    "use min_loss_scale 1",
                    file,
                    "fp16.min_loss_scale",
                )
            )
    if cfg.optimizer is None:
        out.append(
            Finding(
                "missing-optimizer",
                "error",
                "no optimizer section",
                'add "optimizer": {"type": "AdamW", "params": {"lr": 1e-4}}',
                file,
                "optimizer",
            )
        )
    elif (
        cfg.optimizer.type.lower() not in DEEPSPEED_OPTIMIZERS
        and cfg.optimizer.type not in TORCH_OPTIMIZERS
    ):
        names = set(DEEPSPEED_OPTIMIZERS) | set(TORCH_OPTIMIZERS)
        out.append(
            Finding(
                "optimizer-type",
                "error",
                f"optimizer type {cfg.optimizer.type!r} is neither one DeepSpeed builds nor a"
                " torch.optim class: deepspeed.initialize would fail on every rank",
                f"{_did_you_mean(cfg.optimizer.type, names)}use one of"
                f" {', '.join(sorted(names, key=str.lower))}",
                file,
                "optimizer.type",
            )
        )
    if cfg.scheduler is None:
        out.append(
            Finding(
                "missing-scheduler",
                "error",
                "no LR scheduler: the checkpoint will carry no scheduler state and stage 16 cannot"
                " resume its warmup (the field notes' default-config bug)",
                'add "scheduler": {"type": "WarmupDecayLR", "params": {...}}',
                file,
                "scheduler",
            )
        )
    else:
        out += _scheduler(cfg.scheduler, file, stages, settings)
    zero = cfg.zero_optimization
    if zero.stage == 0 and not cfg.bf16.enabled:
        out.append(
            Finding(
                "zero0-no-universal",
                "error",
                f"ZeRO stage 0 with {cfg.precision} has no universal-checkpoint path: the run could"
                " never resume on a different world size",
                "use zero_optimization.stage 1, 2 or 3",
                file,
                "zero_optimization.stage",
            )
        )
    for kind, min_stage in (("offload_optimizer", 1), ("offload_param", 3)):
        off = getattr(zero, kind)
        if off is None or off.device == "none":
            continue
        if zero.stage < min_stage:
            out.append(
                Finding(
                    "offload-stage",
                    "error",
                    f"{kind} needs ZeRO stage {min_stage} or higher, this config uses stage"
                    f" {zero.stage}",
                    f"raise zero_optimization.stage to {max(min_stage, 2 if min_stage == 1 else 3)}"
                    f" or remove {kind}",
                    file,
                    f"zero_optimization.{kind}.device",
                )
            )
        if off.device == "nvme" and not off.nvme_path:
            out.append(
                Finding(
                    "offload-stage",
                    "error",
                    f"{kind} to nvme without nvme_path",
                    "set nvme_path to a fast local disk",
                    file,
                    f"zero_optimization.{kind}.nvme_path",
                )
            )
    triangle, found = batch_triangle(cfg, world_size, file)
    out += found
    dp = world_size or (triangle[0] // (triangle[1] * triangle[2]) if triangle else None)
    if triangle and dp and dp >= 8 and triangle[2] < 4 and (cfg.fp16.enabled or cfg.bf16.enabled):
        fp16 = cfg.fp16.enabled
        out.append(
            Finding(
                "grad-acc-min",
                "error" if fp16 else "warn",
                f"gradient_accumulation_steps {triangle[2]} with a data-parallel size of {dp}: the"
                " field notes saw NaN loss spikes around steps 1200-1500 below 4",
                "use gradient_accumulation_steps >= 4 (8 for stage 16)",
                file,
                "gradient_accumulation_steps",
            )
        )
    return out


def _scheduler(
    sched: Scheduler, file: str, stages: set[int], settings: WonderlandSettings
) -> list[Finding]:
    out: list[Finding] = []
    if sched.type not in KNOWN_SCHEDULERS:
        out.append(
            Finding(
                "scheduler-type",
                "error",
                f"unknown scheduler type {sched.type!r}",
                f"{_did_you_mean(sched.type, set(KNOWN_SCHEDULERS))}use one of"
                f" {', '.join(KNOWN_SCHEDULERS)}",
                file,
                "scheduler.type",
            )
        )
        return out
    model = SCHEDULER_PARAMS.get(sched.type)
    if model is None:
        return out
    try:
        params = model.model_validate(sched.params)
    except ValidationError as exc:
        fs = _pydantic_findings(exc, file, ("scheduler", "params"), set(), "scheduler-params")
        fields = set(model.model_fields)
        return out + [
            Finding(
                f.rule,
                f.severity,
                f.message,
                f"{_did_you_mean(f.path.rsplit('.', 1)[-1], fields)}{f.fix}",
                f.file,
                f.path,
            )
            if f.rule == "unknown-key"
            else f
            for f in fs
        ]
    warmup = getattr(params, "warmup_num_steps", None)
    if 16 in stages and warmup is not None and warmup < settings.min_warmup_steps:
        out.append(
            Finding(
                "stage16-warmup",
                "error",
                f"warmup_num_steps {warmup} < {settings.min_warmup_steps} in a schedule meant for"
                " stage 16: the optimizer oscillates without 500 warmup steps behind it",
                f"set warmup_num_steps >= {settings.min_warmup_steps}",
                file,
                "scheduler.params.warmup_num_steps",
            )
        )
    low, high = getattr(params, "warmup_min_lr", None), getattr(params, "warmup_max_lr", None)
    if low is not None and high is not None and low > high:
        out.append(
            Finding(
                "scheduler-params",
                "error",
                f"warmup_min_lr {low} > warmup_max_lr {high}: the warmup would lower the LR",
                "make warmup_min_lr <= warmup_max_lr",
                file,
                "scheduler.params.warmup_min_lr",
            )
        )
    total = getattr(params, "total_num_steps", None)
    if total is not None and warmup is not None and total < warmup:
        out.append(
            Finding(
                "scheduler-params",
                "error",
                f"total_num_steps {total} < warmup_num_steps {warmup}",
                "make total_num_steps cover the warmup and the decay",
                file,
                "scheduler.params.total_num_steps",
            )
        )
    return out


def validate(
    raw: dict[str, Any],
    file: str = "",
    world_size: int | None = None,
    stages: set[int] | None = None,
) -> tuple[DSConfig | None, WonderlandSettings | None, list[Finding]]:
    """Validate a parsed config; collect every problem. Never raises for bad input."""
    out: list[Finding] = []
    autos = _auto_values(raw)
    for loc in autos:
        out.append(
            Finding(
                "auto-value",
                "error",
                '"auto" is only filled in by the Hugging Face Trainer; DeepSpeed drops it or crashes',
                "replace it with the concrete value",
                file,
                _join(loc),
            )
        )
    skip = {_join(loc) for loc in autos}
    out += _unknown_keys(raw, file)
    settings: WonderlandSettings | None = None
    try:
        settings = WonderlandSettings.model_validate(raw.get(WONDERLAND_KEY, {}))
    except ValidationError as exc:
        out += _pydantic_findings(exc, file, (WONDERLAND_KEY,), skip, "wonderland-settings")
    cfg: DSConfig | None = None
    try:
        cfg = DSConfig.model_validate(raw)
    except ValidationError as exc:
        out += _pydantic_findings(exc, file, (), skip, "type")
    if cfg is not None:
        out += _rules(cfg, raw, file, world_size, stages or set(), settings or WonderlandSettings())
    seen = {f.path for f in out if f.severity == "error"}
    out += [f for f in _deepspeed_types(raw, file) if f.path not in seen]
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
    """The dict handed to deepspeed.initialize: our section stripped, triangle re-closed.

    ``grad_acc`` (``--grad-acc-steps``) overrides the config; the micro batch is kept and
    train_batch_size recomputed for ``world_size`` so DeepSpeed's own assertion holds.
    """
    out = copy.deepcopy(raw)
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
