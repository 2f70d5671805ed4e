"""What DeepSpeed lets through but a stage cannot live with, on a parsed config.

Precision and loss scaling, a missing or unknown optimizer or scheduler, scheduler parameters
that contradict each other or stage 16's warmup, ZeRO stages without a universal-checkpoint
path or with offload they cannot do, the batch triangle with its gradient-accumulation
floor for large data-parallel sizes, and ``wonderland.model``'s levers against what is
installed and what DeepSpeed trains in.
"""

from __future__ import annotations

import importlib.util

from pydantic import ValidationError

from wonderland_ds.config.batch import batch_triangle
from wonderland_ds.config.ds_models import (
    DEEPSPEED_OPTIMIZERS,
    KNOWN_SCHEDULERS,
    SCHEDULER_PARAMS,
    TORCH_OPTIMIZERS,
    DSConfig,
    Scheduler,
)
from wonderland_ds.config.explain import did_you_mean, pydantic_findings
from wonderland_ds.config.settings import HFModel, WonderlandSettings
from wonderland_ds.core.findings import Finding


def engine_rules(
    cfg: DSConfig,
    file: str,
    world_size: int | None,
    stages: set[int],
    settings: WonderlandSettings,
) -> list[Finding]:
    """Every rule below on one config; ``world_size`` None leaves the triangle open."""
    out: list[Finding] = []
    if settings.model is not None:
        trains = "bfloat16" if cfg.bf16.enabled else "float16" if cfg.fp16.enabled else "float32"
        out += lever_findings(settings.model, trains, file)
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
                f"{did_you_mean(cfg.optimizer.type, names)}use one of"
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
        out += scheduler_rules(cfg.scheduler, file, stages, settings)
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


def scheduler_rules(
    sched: Scheduler, file: str, stages: set[int], settings: WonderlandSettings
) -> list[Finding]:
    """The scheduler's type, and its params where the type's are typed (``SCHEDULER_PARAMS``)."""
    out: list[Finding] = []
    if sched.type not in KNOWN_SCHEDULERS:
        out.append(
            Finding(
                "scheduler-type",
                "error",
                f"unknown scheduler type {sched.type!r}",
                f"{did_you_mean(sched.type, set(KNOWN_SCHEDULERS))}use one of"
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
        fs = pydantic_findings(exc, file, ("scheduler", "params"), set(), "scheduler-params")
        fields = set(model.model_fields)
        return out + [
            Finding(
                f.rule,
                f.severity,
                f.message,
                f"{did_you_mean(f.path.rsplit('.', 1)[-1], fields)}{f.fix}",
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
                " stage 16: the optimizer oscillates without enough warmup steps behind it",
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


def lever_findings(spec: HFModel, trains: str, file: str) -> list[Finding]:
    """``wonderland.model``'s levers that cannot work here, or with DeepSpeed training in
    ``trains`` (float32, bfloat16 or float16)."""
    out = []
    if (
        spec.attn_implementation == "flash_attention_2"
        and importlib.util.find_spec("flash_attn") is None
    ):
        out.append(
            Finding(
                "model-attention",
                "error",
                "attn_implementation flash_attention_2 needs the flash-attn package, which is"
                " not installed",
                'pip install flash-attn (on a GPU host), or use "sdpa"',
                file,
                "wonderland.model.attn_implementation",
            )
        )
    if spec.dtype != "float32" and spec.dtype != trains:
        section = {"bfloat16": "bf16", "float16": "fp16"}[spec.dtype]
        out.append(
            Finding(
                "model-dtype",
                "error",
                f"model.dtype {spec.dtype} but DeepSpeed trains in {trains}: the optimizer"
                " would start from rounded weights",
                f'use "dtype": "float32", or enable DeepSpeed\'s "{section}" section',
                file,
                "wonderland.model.dtype",
            )
        )
    return out
