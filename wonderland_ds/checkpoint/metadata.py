"""``wonderland_meta.json``: a checkpoint's metadata, written and read through one model.

The file is written last (the checkpoint is complete only once it exists and verifies), so
every field the engine sets is here; every reader gets typed attributes, and a field nobody
declared is refused when written, not discovered when read. ``format`` versions the file: a
file of another format reads as "no metadata" (the checkpoint is then described from
DeepSpeed's own files).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

FORMAT: Literal["wonderland-ckpt/1"] = "wonderland-ckpt/1"


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class FileDigest(_Model):
    """One file of the checkpoint: its size and sha256, taken after its fsync."""

    bytes: int
    sha256: str


class SchedulerState(_Model):
    type: str | None = None
    last_batch_iteration: int | None = None


class DataPosition(_Model):
    """Where the sample stream stands (``data.sampler.LoaderState``)."""

    seed: int
    samples_consumed: int
    fingerprint: str
    dataset_size: int
    order: str = "permutation"  # checkpoints written before the order was recorded
    epoch: int | None = None
    mix: str = "train"
    """The training data the stream reads: ``train`` or a stage's own ``stage_train.N``."""
    stream_start: int = 0
    """Samples consumed before this mix's stream began (a stage's own mix starts at its own
    first sample)."""
    blend: str | None = None
    """The weighted sources' interleave (``data.blend.ORDER``); None: one source."""
    sources: dict[str, dict[str, float | int]] | None = None
    """Per source: weight, samples read and epochs, in this mix's stream."""


class NormStats(_Model):
    mean: list[float] | None = None
    std: list[float] | None = None


class CheckpointMeta(_Model):
    format: Literal["wonderland-ckpt/1"] = FORMAT
    # Set by every write; a file without them reads, and ``verify`` refuses it (no files).
    tag: str | None = None
    files: dict[str, FileDigest] = {}
    completed_at: str | None = None
    # What a training stage saved (absent from checkpoints other tools wrote).
    stage: int | None = None
    global_step: int | None = None
    skipped_steps: int | None = None
    stage_start_step: int | None = None
    has_optimizer_state: bool | None = None
    has_scheduler_state: bool | None = None
    scheduler: SchedulerState | None = None
    warmup_progress: int | None = None
    lr: float | None = None
    world_size: int | None = None
    zero_stage: int | None = None
    precision: str | None = None
    micro_batch: int | None = None
    grad_acc: int | None = None
    train_batch: int | None = None
    loss_scale: float | None = None
    loss: float | None = None
    data: DataPosition | None = None
    task: str | None = None
    norm_stats: NormStats | None = None
    rng_states: str | None = None
    versions: dict[str, str] | None = None
    # A universal conversion of another checkpoint (``wonderland convert``).
    universal: bool = False
    source: str | None = None
    source_digest: str | None = None
    conversion_seconds: float | None = None
    conversion: dict[str, Any] | None = None

    def fields(self) -> dict[str, Any]:
        """The metadata as plain JSON values: the fields it was written with, no others."""
        return self.model_dump(mode="json", exclude_unset=True)


def parse(text: str) -> CheckpointMeta | None:
    """The file's model, or None when it is not this format or does not validate."""
    try:
        return CheckpointMeta.model_validate_json(text)
    except ValidationError:
        return None


def build(fields: dict[str, Any]) -> CheckpointMeta:
    """A new metadata record; an undeclared or mistyped field raises (a programming error)."""
    return CheckpointMeta.model_validate(fields)
