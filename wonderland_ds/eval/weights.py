"""Stage 17's model: on this rank's accelerator, in the training dtype, from the checkpoint's
own weights, never a full fp32 copy per rank.

ZeRO-1/2 (and no ZeRO): the model-states file holds the module as the engine trained it; it
is loaded into the task's model on the accelerator. ZeRO-3: the model is partitioned by a
DeepSpeed engine without an optimizer (built as the training stage builds it), each rank's partition
of every parameter read from the saved fp32 partitions with the reshard's map (any world size)
and the frozen fragments; a forward pass gathers one layer at a time, so every rank must run
as many forward passes as the others (:func:`passes`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.checkpoint import zero_partitions as zp
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Refused
from wonderland_ds.model import construct

if TYPE_CHECKING:
    from wonderland_ds.data.tasks import Task


def training_dtype(ds_dict: dict[str, Any]) -> torch.dtype:
    """The dtype the engine trained the module in (DeepSpeed's ``bf16``/``fp16`` sections)."""
    for key, dtype in (("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16)):
        if (ds_dict.get(key) or {}).get("enabled"):
            return dtype
    if (ds_dict.get("fp16") or {}).get("enabled"):
        return torch.float16
    return torch.float32


def device() -> torch.device:
    """This rank's accelerator, through DeepSpeed's accelerator API (the CPU here)."""
    from deepspeed.accelerator import get_accelerator

    return torch.device(get_accelerator().current_device_name())


def load_into(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """``state`` into ``model``; refused when the names do not fit (tied copies aside)."""
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if k not in construct.tied(model)]
    if missing or unexpected:
        raise Refused(
            f"checkpoint does not fit the task's model: missing {missing[:3]},"
            f" unexpected {unexpected[:3]}",
            "evaluate with the task it was trained on",
        )
    return model.eval()


def _zero3(tag_dir: Path) -> bool:
    return (tag_dir / "zero_pp_rank_0_mp_rank_00_model_states.pt").is_file()


@contextmanager
def eval_model(task: Task, tag_dir: Path, ds_dict: dict[str, Any]) -> Iterator[torch.nn.Module]:
    """The checkpoint's model in eval mode on this rank's accelerator, in the training dtype."""
    dtype, dev = training_dtype(ds_dict), device()
    if not _zero3(tag_dir):
        states = torch.load(
            tag_dir / "mp_rank_00_model_states.pt",
            map_location="cpu",
            mmap=True,
            weights_only=False,  # as DeepSpeed loads; the preflight scanned the pickle
        )
        model = construct.for_scoring(construct.build(task, ds_dict, empty=True))
        model = load_into(model, states["module"]).to(device=dev, dtype=dtype)
        del states
        yield model
        return
    yield from _zero3_model(task, tag_dir, ds_dict, dtype)


def _zero3_model(
    task: Task, tag_dir: Path, ds_dict: dict[str, Any], dtype: Any
) -> Iterator[torch.nn.Module]:
    import deepspeed

    from wonderland_ds.checkpoint import reshard, shard_reads

    layout = zl.read_source(tag_dir, norms=False)
    cfg = {k: v for k, v in ds_dict.items() if k not in ("optimizer", "scheduler", "wonderland")}
    # Built partitioned, as the training stage builds it.
    model = construct.for_scoring(construct.build(task, cfg, empty=True))
    engine, *_ = deepspeed.initialize(model=model, config=cfg)
    world, rank = dist.world_size(), dist.rank()
    report = shard_reads.Report()
    optim = shard_reads.Sources(
        [tag_dir / layout.optim_file(r) for r in range(layout.world_size)], report
    )
    models = shard_reads.Sources(
        [
            tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt"
            for r in range(layout.world_size)
        ],
        report,
    )
    where = {p.name: (g, group) for g, group in enumerate(layout.groups) for p in group}
    frozen = {p.name: p for p in layout.frozen}
    for name, p in engine.module.named_parameters():
        part = p.ds_tensor.ds_numel
        host = torch.zeros(part, dtype=torch.float32)
        span = zp.ParamSpan(name=name, numel=p.ds_numel)
        if name in where:
            g, group = where[name]
            copies = zp.transfers("zero3", group, [span], layout.world_size, world, rank)
            optim.fill(host, copies, lambda sd, g=g: zl.flat_fp32(sd["optimizer_state_dict"])[g])
        elif name in frozen:
            reshard.fill_frozen(models, layout, span, host, world, rank)
        else:
            raise Refused(
                f"parameter {name} of the task's model is not in the checkpoint {tag_dir}",
                "evaluate with the task it was trained on",
            )
        p.ds_tensor.data.copy_(host)
    module_states = models.get(0)["module"]
    for name, buf in engine.module.named_buffers():
        if name in module_states:
            buf.data.copy_(module_states[name])
    optim.close()
    models.close()
    engine.module.eval()
    try:
        yield engine.module
    finally:
        engine.destroy()


def passes(mine: int) -> int:
    """How many forward passes this rank runs: the most any rank has (under ZeRO-3 every
    forward pass is collective; a rank short of blocks repeats one and drops the result)."""
    counts = dist.gather_all(mine)
    return max(counts) if counts else mine
