"""Resuming a ZeRO-1/2/3 checkpoint on another world size, resharded at load time.

Every rank reads, for each flat group, just the element ranges of the old shards its new
partition needs (:func:`~wonderland_ds.checkpoint.zero_partitions.transfers`; plain reads at
the offsets the files record, ``shard_reads.py``), straight into the engine's fp32 partition
and into the optimizer-state tensors it is about to own. DeepSpeed's own
``optimizer.load_state_dict`` then takes them as if this rank had saved them at this world
size (it links the parameters, restores the loss scaler and, under ZeRO-3, the 16-bit
partitions). No universal folder is written and no rank reads another rank's share. The
loaded state is then checked against the source's norms (``load_check.py``).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.checkpoint import zero_partitions as zp
from wonderland_ds.checkpoint.shard_reads import Report, Sources, storage_reads
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, Refused

#: What DeepSpeed's engine restores itself; every other top-level key is client state.
_DS_STATES = (
    "module",
    "optimizer",
    "lr_scheduler",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "data_sampler",
    "random_ltd",
    "param_shapes",
    "buffer_names",
    "frozen_param_shapes",
    "frozen_param_fragments",
    "shared_params",
    "ds_config",
    "ds_version",
    "checkpoint_parallel_dimensions",
    "universal_checkpoint_info",
)


def unsupported(engine: Any, layout: zl.SourceLayout) -> str | None:
    """Why this engine cannot take ``layout`` resharded (the universal path then), or None."""
    opt = engine.optimizer
    family = "zero3" if engine.zero_optimization_stage() == 3 else "zero12"
    if engine.zero_optimization_stage() not in (1, 2, 3) or opt is None:
        return "the engine has no ZeRO optimizer"
    if family != layout.family():
        return f"ZeRO stage {layout.zero_stage} -> {engine.zero_optimization_stage()}"
    if getattr(engine, "has_moe_layers", False) or engine.mp_world_size != 1:
        return "expert, tensor or pipeline parallel"
    needed: tuple[str, ...]
    if family == "zero3":
        needed = ("fp16_groups", "fp32_partitioned_groups_flat", "load_state_dict")
        if getattr(opt, "swap_optimizer", False) or getattr(opt, "offload_param", False):
            return "ZeRO-3 offload to NVMe or of parameters"
    else:
        needed = (
            "round_robin_bit16_groups",
            "single_partition_of_fp32_groups",
            "groups_padding",
            "round_robin_bit16_padding",
            "partition_count",
            "load_state_dict",
        )
        if any(any(p) for p in getattr(opt, "round_robin_bit16_padding", [[1]])):
            return "parameter_alignment is on"
        if getattr(opt, "round_robin_gradients", False):
            return "round_robin_gradients is on"
    missing = [n for n in needed if not hasattr(opt, n)]
    return f"DeepSpeed's optimizer lacks {missing}" if missing else None


def _groups(engine: Any) -> list[list[Any]]:
    """The engine's flat groups of parameters, in their flat order."""
    opt = engine.optimizer
    return (
        opt.fp16_groups if engine.zero_optimization_stage() == 3 else opt.round_robin_bit16_groups
    )


def _spans(engine: Any, params: list[Any]) -> list[zp.ParamSpan]:
    names = engine.param_names
    return [
        zp.ParamSpan(name=names[p], numel=int(getattr(p, "ds_numel", 0) or p.numel()))
        for p in params
    ]


def _fill_group(
    sources: Sources,
    layout: zl.SourceLayout,
    g: int,
    new: list[zp.ParamSpan],
    fp32: torch.Tensor,
    world: int,
    rank: int,
) -> dict[str, torch.Tensor]:
    """Fill this rank's fp32 partition of group ``g`` in place; its states, new tensors."""
    old = layout.groups[g]
    if sorted(p.name for p in old) != sorted(p.name for p in new) or {
        p.name: p.numel for p in old
    } != {p.name: p.numel for p in new}:
        gone = sorted({p.name for p in old} ^ {p.name for p in new})
        raise Refused(
            Finding(
                "reshard-params",
                "error",
                f"group {g}: the model's trainable parameters differ from the checkpoint's"
                f" (names or sizes{': ' + ', '.join(gone[:5]) if gone else ''})",
                "resume with the model the checkpoint was trained with",
            )
        )
    copies = zp.transfers(layout.family(), old, new, layout.world_size, world, rank)
    fp32.detach().zero_()  # the padding too: DeepSpeed leaves it uninitialized
    sources.fill(fp32, copies, lambda sd: zl.flat_fp32(sd["optimizer_state_dict"])[g])
    states = {}
    for key in layout.state_keys:
        t = torch.zeros_like(fp32)
        sources.fill(
            t, copies, lambda sd, k=key: zl._base(sd["optimizer_state_dict"])["state"][g][k]
        )
        states[key] = t
    return states


def _fill_groups(
    engine: Any,
    sources: Sources,
    layout: zl.SourceLayout,
    fp32s: list[torch.Tensor],
    world: int,
    rank: int,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every group's fp32 partition filled in place; (a copy of the source's rank-0 optimizer
    state dict to complete, the wrapped torch optimizer's state dict for this rank)."""
    states = [
        _fill_group(sources, layout, g, _spans(engine, params), fp32s[g], world, rank)
        for g, params in enumerate(_groups(engine))
    ]
    first = sources.get(0)["optimizer_state_dict"]
    return dict(first), _base_state(first, states)


def _base_state(first: dict[str, Any], states: list[dict[str, torch.Tensor]]) -> dict[str, Any]:
    """The wrapped torch optimizer's state dict for this rank: the resharded tensors, and
    what is not partitioned (Adam's step, the hyperparameters) from the source's rank 0."""
    base = zl._base(first)
    out = {}
    for g, mine in enumerate(states):
        replicated = {
            k: (v.clone() if torch.is_tensor(v) else v)
            for k, v in base["state"][g].items()
            if k not in mine
        }
        out[g] = replicated | mine
    return {"state": out, "param_groups": base["param_groups"]}


def load(engine: Any, tag_dir: Path, layout: zl.SourceLayout) -> Report:
    """Restore ``tag_dir`` (saved at ``layout.world_size``) into ``engine``: weights, fp32
    master weights, optimizer state, scheduler and counters. Raises Refused on a mismatch."""
    t0, io0 = time.perf_counter(), storage_reads()
    report = Report()
    opt = engine.optimizer
    world, rank = dist.world_size(), dist.rank()
    optim = [tag_dir / layout.optim_file(r) for r in range(layout.world_size)]
    sources = Sources(optim, report)
    if layout.family() == "zero12":
        path, _ = engine.load_checkpoint(
            str(tag_dir.parent),
            tag=tag_dir.name,
            load_optimizer_states=False,
            load_lr_scheduler_states=True,
        )
        if path is None:
            raise Refused(f"DeepSpeed loaded nothing from {tag_dir}", "inspect the checkpoint")
        fp32s = opt.single_partition_of_fp32_groups
        sd, base = _fill_groups(engine, sources, layout, fp32s, world, rank)
        sd.update(
            base_optimizer_state=base,
            single_partition_of_fp32_groups=list(fp32s),
            group_paddings=list(opt.groups_padding),
            param_alignment_paddings=opt.round_robin_bit16_padding,
            partition_count=list(opt.partition_count),
            param_slice_mappings=getattr(opt, "_param_slice_mappings", None),
        )
        opt.load_state_dict(
            [sd if r == rank else None for r in range(world)],
            load_optimizer_states=True,
            load_from_fp32_weights=engine.zero_load_from_fp32_weights(),
        )
    else:
        _load_zero3(engine, tag_dir, layout, sources, world, rank)
    sources.close()
    report.seconds = time.perf_counter() - t0
    io1 = storage_reads()
    report.io_read_bytes = None if io0 is None or io1 is None else io1 - io0
    return report


def fill_frozen(
    models: Sources, layout: zl.SourceLayout, span: zp.ParamSpan, dest: Any, world: int, rank: int
) -> None:
    """ZeRO-3: this rank's partition of a frozen parameter, from the saved fragments in the
    model-states files (partitioned like the trained parameters)."""
    copies = zp.transfers("zero3", [span], [span], layout.world_size, world, rank)
    models.fill(dest, copies, lambda sd: sd["frozen_param_fragments"][span.name])


def _load_zero3(
    engine: Any,
    tag_dir: Path,
    layout: zl.SourceLayout,
    sources: Sources,
    world: int,
    rank: int,
) -> None:
    """ZeRO-3: DeepSpeed's ``load_checkpoint`` opens the model states of this rank's number
    (absent when the world grew) and copies rank 0's frozen fragments into every rank: the
    module, frozen fragments, scheduler and counters are restored here instead."""
    opt = engine.optimizer
    opt.checkpoint_event_prologue()
    models = [
        tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(layout.world_size)
    ]
    frozen = Sources(models, sources.report)
    states0 = frozen.get(0)
    engine.load_module_state_dict(
        checkpoint={"module": states0["module"], "frozen_param_fragments": None}, strict=True
    )
    by_name = {n: p for p, n in engine.param_names.items()}
    for span in layout.frozen:
        p = by_name.get(span.name)
        if p is None or not hasattr(p, "ds_tensor"):
            raise Refused(
                f"frozen parameter {span.name} of the checkpoint is not a partitioned parameter"
                " of the model",
                "resume with the model the checkpoint was trained with",
            )
        fill_frozen(frozen, layout, span, p.ds_tensor.data, world, rank)
    frozen.close()
    if engine.lr_scheduler is not None and states0.get("lr_scheduler") is not None:
        engine.lr_scheduler.load_state_dict(states0["lr_scheduler"])
    engine.global_steps = states0["global_steps"]
    engine.global_samples = states0.get(
        "global_samples", engine.global_steps * engine.train_batch_size()
    )
    engine.skipped_steps = states0["skipped_steps"]
    engine.loaded_checkpoint_dp_world_size = states0["dp_world_size"]
    engine.loaded_checkpoint_mp_world_size = states0["mp_world_size"]
    fp32s = opt.fp32_partitioned_groups_flat
    sd, base = _fill_groups(engine, sources, layout, fp32s, world, rank)
    sd.update(
        partition_count=opt.partition_count,
        optimizer_state_dict=base,
        fp32_flat_groups=list(fp32s),
    )
    opt.load_state_dict(
        [sd if r == rank else None for r in range(world)], load_optimizer_states=True
    )
    opt.checkpoint_event_epilogue()
