"""The pydantic models of the DeepSpeed keys the engine depends on.

Batch sizes, precision, ZeRO, optimizer, scheduler and checkpoint are typed here; every other
DeepSpeed key passes through unchanged to ``deepspeed.initialize``. Each field's docstring is
its description (``use_attribute_docstrings``), which ``config.reference`` renders into
docs/configuration.md.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, field_validator

#: The config's own top-level section, stripped before ``deepspeed.initialize``.
WONDERLAND_KEY = "wonderland"


class _Typed(BaseModel):
    # extra="allow": unknown keys are reported by key_checks with "did you mean", not here.
    model_config = ConfigDict(extra="allow", strict=True, use_attribute_docstrings=True)


class _Closed(BaseModel):
    # Sections whose every key DeepSpeed reads is modelled: a typo is refused here.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True)


class FP16(_Typed):
    """fp16 mixed precision with DeepSpeed's loss scaler."""

    enabled: bool = False
    """Train in fp16 (enable one of fp16 and bf16: bf16 on A100/H100, fp16 on older GPUs)."""
    loss_scale: float = Field(0, ge=0)
    """A static loss scale; 0 means dynamic loss scaling."""
    initial_scale_power: int = Field(16, ge=0, le=64)
    """Dynamic loss scaling starts at a scale of 2 to this power."""
    loss_scale_window: int = Field(1000, ge=0)
    """Dynamic loss scaling: steps without an overflow before the scale is raised again (0
    never raises it: refused)."""
    hysteresis: int = Field(2, ge=0)
    """Dynamic loss scaling: overflows tolerated before the scale is lowered."""
    min_loss_scale: float = Field(1, ge=0)
    """Dynamic loss scaling never lowers the scale below this (0 lets it collapse: refused)."""


class BF16(_Typed):
    """bf16 mixed precision (no loss scaling)."""

    enabled: bool = False
    """Train in bf16."""


class Offload(_Typed):
    """Where ZeRO keeps offloaded optimizer state or parameters."""

    device: Literal["cpu", "nvme", "none"] = "none"
    """``cpu``, ``nvme`` or ``none`` (not offloaded)."""
    nvme_path: str | None = None
    """A directory on a fast local disk; required with ``device: nvme``."""


class Zero(_Typed):
    """ZeRO partitioning of optimizer state, gradients and parameters across ranks."""

    stage: int = Field(0, ge=0, le=3)
    """0: off; 1: optimizer state partitioned; 2: and gradients; 3: and parameters. Stage 0
    without bf16 is refused: it has no universal-checkpoint path to another world size."""
    offload_optimizer: Offload | None = None
    """Offload the optimizer state and its step to CPU or NVMe (ZeRO stage 1 or higher)."""
    offload_param: Offload | None = None
    """Offload the parameters to CPU or NVMe (ZeRO stage 3)."""


class Optimizer(_Typed):
    """The optimizer DeepSpeed builds at ``deepspeed.initialize``."""

    type: str
    """One DeepSpeed builds itself (``adam``, ``adamw``, ``lamb``, ``lion``, ``muon``, ...; any
    case) or the name of a ``torch.optim`` class (``SGD``, ``RMSprop``, ...)."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The optimizer's keyword arguments (``lr``, ``betas``, ``weight_decay``, ...)."""


class WarmupLRParams(_Closed):
    """``WarmupLR``: warm up from ``warmup_min_lr`` to ``warmup_max_lr``, then hold it."""

    warmup_min_lr: float = Field(0.0, ge=0)
    """The learning rate at the start of the warmup."""
    warmup_max_lr: float = Field(0.001, ge=0)
    """The learning rate at the end of the warmup (at least ``warmup_min_lr``)."""
    warmup_num_steps: int = Field(1000, ge=0)
    """Optimizer steps of warmup; a schedule for stage 16 needs at least
    ``wonderland.min_warmup_steps``."""
    warmup_type: Literal["log", "linear"] = "log"
    """How the learning rate rises during the warmup."""
    last_batch_iteration: int = -1
    """The step the schedule starts from; -1: its beginning (a resumed checkpoint carries its
    own)."""


class WarmupDecayLRParams(WarmupLRParams):
    """``WarmupDecayLR``: ``WarmupLR``, then a linear decay to 0 at ``total_num_steps``."""

    total_num_steps: int = Field(ge=1)
    """Optimizer steps of the whole schedule, warmup included (at least
    ``warmup_num_steps``)."""


class WarmupCosineLRParams(_Closed):
    """``WarmupCosineLR``: warm up to the optimizer's ``lr``, then a cosine decay."""

    total_num_steps: int = Field(ge=1)
    """Optimizer steps of the whole schedule, warmup included (at least
    ``warmup_num_steps``)."""
    warmup_min_ratio: float = Field(0.0, ge=0)
    """The learning rate at the start of the warmup, as a fraction of the optimizer's ``lr``."""
    warmup_num_steps: int = Field(1000, ge=0)
    """Optimizer steps of warmup; a schedule for stage 16 needs at least
    ``wonderland.min_warmup_steps``."""
    cos_min_ratio: float = Field(0.0001, ge=0)
    """The learning rate at the end of the decay, as a fraction of the optimizer's ``lr``."""
    warmup_type: Literal["log", "linear"] = "log"
    """How the learning rate rises during the warmup."""
    last_batch_iteration: int = -1
    """The step the schedule starts from; -1: its beginning (a resumed checkpoint carries its
    own)."""


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
    """The learning-rate schedule; required, so that a checkpoint carries its state."""

    type: str
    """``WarmupLR``, ``WarmupDecayLR``, ``WarmupCosineLR``, ``OneCycle`` or ``LRRangeTest``."""
    params: dict[str, Any] = Field(default_factory=dict)
    """The scheduler's parameters; those of the three warmup schedules are checked key by key
    (tables below)."""


class Checkpoint(_Closed):
    """How DeepSpeed saves and loads checkpoints (every key it reads; typos refused)."""

    load_universal: bool = False
    """Load a universal checkpoint (world-size independent, from ``wonderland convert``)."""
    tag_validation: str = "Warn"
    """Check that every rank saves under the same tag: ``Ignore``, ``Warn`` or ``Fail`` (any
    case)."""
    use_node_local_storage: bool = False
    """Each node saves its ranks' files to its own local disk (no shared file system)."""
    parallel_write: dict[str, Any] | None = None
    """DeepSpeed's parallel writing options (``pipeline_stage``)."""
    checkpoint_serialization: bool = True
    """Save with torch's zipfile serialization (false: the legacy format)."""
    writer: dict[str, Any] | None = None
    """DeepSpeed's checkpoint writer (``type``, buffer sizes, ...); none: torch.save."""

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
    """Samples per optimizer step over all ranks: micro batch x gradient accumulation x
    data-parallel size (derived from the other two for the world size when left out)."""
    train_micro_batch_size_per_gpu: int | None = Field(None, ge=1)
    """Samples per forward and backward on each rank."""
    gradient_accumulation_steps: int | None = Field(None, ge=1)
    """Micro batches per optimizer step (``--grad-acc-steps`` overrides); below 4 with 8 or
    more data-parallel ranks in fp16 or bf16 is refused (fp16) or warned about (bf16)."""
    gradient_clipping: float = Field(0.0, ge=0)
    """Clip the global gradient norm to this; 0: no clipping."""
    steps_per_print: int = Field(10, ge=1)
    """DeepSpeed logs its own progress line every this many steps."""
    fp16: FP16 = Field(default_factory=FP16)
    """fp16 mixed precision."""
    bf16: BF16 = Field(default_factory=BF16, validation_alias=AliasChoices("bf16", "bfloat16"))
    """bf16 mixed precision; DeepSpeed still reads the old name ``bfloat16`` when ``bf16`` is
    absent."""
    zero_optimization: Zero = Field(default_factory=Zero)
    """ZeRO partitioning and offload."""
    optimizer: Optimizer | None = None
    """The optimizer (required)."""
    scheduler: Scheduler | None = None
    """The learning-rate scheduler (required)."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    """Checkpoint saving and loading."""

    @property
    def precision(self) -> str:
        return "fp16" if self.fp16.enabled else "bf16" if self.bf16.enabled else "fp32"
