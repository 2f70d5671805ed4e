"""Stage 18's weights, streamed: each tensor read on its own from the checkpoint's fp32 master
partitions (any ZeRO stage and world size: the reshard's map with a single target rank) and
written into safetensors shards of at most ``max_shard_size``. The whole model is never in
memory: only the shard being filled and one parameter.

Names, shapes and tied weights come from the task's model built on the meta device (no
memory): tied copies are stored once, as ``save_pretrained`` stores them, and a name the
checkpoint lacks is refused. The layout is ``transformers``' own: ``model.safetensors``, or
``model-0000K-of-0000N.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from wonderland_ds.checkpoint import reshard, shard_reads
from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.checkpoint import zero_partitions as zp
from wonderland_ds.core.findings import Refused

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"


def meta_model(build: Callable[[], torch.nn.Module]) -> torch.nn.Module:
    """The model's structure without its memory."""
    with torch.device("meta"):
        return build()


def wanted(model: torch.nn.Module) -> list[tuple[str, torch.Size]]:
    """The state-dict entries to export, in order, tied copies once (the first name kept)."""
    from wonderland_ds.model.construct import tied

    skip = tied(model)
    return [(n, t.shape) for n, t in model.state_dict().items() if n not in skip]


def checkpoint_tensors(
    tag_dir: Path, entries: list[tuple[str, torch.Size]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Each entry's fp32 value: trained parameters from the optimizer's fp32 partitions,
    ZeRO-3's frozen ones from their fragments, the rest (buffers, ZeRO-1/2's frozen
    parameters) from rank 0's module states. One tensor in memory at a time."""
    layout = zl.read_source(tag_dir, norms=False)
    family, old = layout.family(), layout.world_size
    report = shard_reads.Report()
    optim = shard_reads.Sources([tag_dir / layout.optim_file(r) for r in range(old)], report)
    names3 = [tag_dir / f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" for r in range(old)]
    models = shard_reads.Sources(
        names3 if layout.zero_stage == 3 else [tag_dir / "mp_rank_00_model_states.pt"], report
    )
    where = {p.name: (g, group) for g, group in enumerate(layout.groups) for p in group}
    frozen = {p.name: p for p in layout.frozen}
    try:
        for name, shape in entries:
            numel = int(torch.Size(shape).numel())
            host = torch.empty(numel, dtype=torch.float32)
            span = zp.ParamSpan(name=name, numel=numel)
            if name in where:
                g, group = where[name]
                copies = zp.transfers(family, group, [span], old, 1, 0)
                optim.fill(
                    host, copies, lambda sd, g=g: zl.flat_fp32(sd["optimizer_state_dict"])[g]
                )
            elif name in frozen:
                reshard.fill_frozen(models, layout, span, host, 1, 0)
            else:
                module = models.get(0)["module"]
                if name not in module or module[name].numel() != numel:
                    raise Refused(
                        f"the checkpoint {tag_dir} has no tensor {name} of the task's model",
                        "export with the task the checkpoint was trained with",
                    )
                host.copy_(module[name].reshape(-1))
            yield name, host.view(shape)
    finally:
        optim.close()
        models.close()


def write_shards(
    tensors: Iterator[tuple[str, torch.Tensor]], folder: Path, dtype: torch.dtype, max_bytes: int
) -> dict[str, Any]:
    """Shards of at most ``max_bytes`` (a larger tensor gets one of its own); returns the
    index (``metadata.total_size`` and ``weight_map``). Peak memory: one shard and one tensor."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    shard: dict[str, torch.Tensor] = {}
    size = total = 0
    files: list[list[str]] = []

    def flush() -> None:
        nonlocal shard, size
        if shard:
            save_file(shard, str(folder / f".shard-{len(files)}"), metadata={"format": "pt"})
            files.append(list(shard))
            shard, size = {}, 0

    for name, value in tensors:
        value = value.to(dtype).contiguous()
        nbytes = value.numel() * value.element_size()
        if shard and size + nbytes > max_bytes:
            flush()
        shard[name] = value
        size += nbytes
        total += nbytes
    flush()
    n = len(files)
    weight_map: dict[str, str] = {}
    for i, names in enumerate(files):
        final = SINGLE if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        (folder / f".shard-{i}").rename(folder / final)
        weight_map |= {name: final for name in names}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    if n > 1:
        (folder / INDEX).write_text(json.dumps(index, indent=2) + "\n")
    return index


def export_weights(
    build: Callable[[], torch.nn.Module],
    tag_dir: Path,
    folder: Path,
    dtype: torch.dtype,
    max_bytes: int,
) -> dict[str, Any]:
    """The checkpoint's weights under the task model's names, streamed into ``folder``."""
    entries = wanted(meta_model(build))
    try:
        zl.read_source(tag_dir, norms=False)
    except zl.UnknownLayout as exc:
        raise Refused(
            f"stage 18 cannot read the checkpoint {tag_dir}: {exc}",
            "export a ZeRO-1/2/3 checkpoint saved by DeepSpeed 0.19",
        ) from None
    return write_shards(checkpoint_tensors(tag_dir, entries), folder, dtype, max_bytes)


def hf_files(hf_dir: str, folder: Path, dtype: torch.dtype) -> None:
    """``config.json`` (the export dtype, the KV cache on as generation expects it), the
    generation config and the model directory's tokenizer files."""
    import shutil

    from wonderland_ds.model.construct import import_transformers
    from wonderland_ds.model.hf import TOKENIZER_FILES

    tf = import_transformers()
    config = tf.AutoConfig.from_pretrained(hf_dir)
    config.use_cache = True
    config.dtype = dtype
    config.save_pretrained(folder)
    if (Path(hf_dir) / "generation_config.json").is_file():
        shutil.copy2(Path(hf_dir) / "generation_config.json", folder)
    else:
        tf.GenerationConfig.from_model_config(config).save_pretrained(folder)
    for name in TOKENIZER_FILES:
        src = Path(hf_dir) / name
        if src.is_file():
            shutil.copy2(src, folder / name)
