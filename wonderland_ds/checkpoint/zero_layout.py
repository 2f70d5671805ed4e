"""Where each parameter's fp32 master weights and optimizer moments lie in a DeepSpeed ZeRO
checkpoint's flat per-rank partitions, read without torch.

:func:`read_source` reads the layout (the partition arithmetic of ``zero_partitions.py``) from
what the checkpoint records (the model states' ``param_shapes``, each optimizer file's
partition count and paddings, DeepSpeed's own ``param_slice_mappings``, which must agree), and
the per-parameter sums of squares of the fp32 weights and every partitioned optimizer state,
memory-mapped from the shards (:func:`source_norms`): the reference the loaded state is
checked against.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from wonderland_ds.checkpoint import tensor_map
from wonderland_ds.checkpoint.zero_partitions import ParamSpan, partition_numel, pieces

#: The DeepSpeed release line whose ZeRO partition layout this module describes.
KNOWN_RELEASE = "0.19."

#: The fp32 master weights' name among the per-parameter norms (the others: state keys).
FP32 = "fp32"

#: A norm is blind to elements moved inside one parameter; each key also gets a sum of
#: squares weighted by the element's index in its parameter, ``1 + index % POSITIONS``.
POSITIONS = 257


def positional(key: str) -> str:
    """The name of ``key``'s position-weighted sum among a parameter's norms."""
    return f"{key}@"


_OPTIM = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_00_optim_states\.pt$")
_MODEL3 = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_00_model_states\.pt$")
_ALLOWED = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.fp16.loss_scaler.DynamicLossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
    }
)


class SourceLayout(BaseModel):
    """A ZeRO checkpoint's partition layout and the reference norms of its optimizer state."""

    model_config = ConfigDict(extra="forbid")

    zero_stage: int
    """1, 2 or 3 (1 and 2 share one layout)."""
    world_size: int
    """The data-parallel world size that saved it."""
    ds_version: str
    groups: list[list[ParamSpan]]
    """ZeRO-1/2: the parameter groups' flat order; ZeRO-3: the sub-groups'."""
    frozen: list[ParamSpan] = Field(default_factory=list)
    """ZeRO-3: frozen parameters, partitioned like the trained ones (model-states files)."""
    state_keys: list[str]
    """Optimizer state partitioned like the fp32 weights (Adam: exp_avg, exp_avg_sq)."""
    prefix: str = ""
    """The optimizer files' name prefix (``bf16_`` when the run trained in bf16)."""
    norms: dict[str, dict[str, float]] = Field(default_factory=dict)
    """Per parameter: the sum of squares of its fp32 weights and of each state in the
    checkpoint (float64), plain and position-weighted (:func:`positional`): the reference
    the loaded partitions must match."""

    def family(self) -> str:
        return "zero3" if self.zero_stage == 3 else "zero12"

    def optim_file(self, rank: int) -> str:
        return f"{self.prefix}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


class UnknownLayout(Exception):
    """The checkpoint's layout is not one this module describes (the universal path then)."""


@dataclass
class Shards:
    """The checkpoint's files, mapped: rank 0's model states and every rank's optimizer
    states (tensors as :class:`~wonderland_ds.checkpoint.tensor_map.TensorRef`)."""

    model: dict[str, Any]
    optim: list[dict[str, Any]]
    model_files: list[Path]
    prefix: str


def map_file(path: Path) -> dict[str, Any]:
    """A checkpoint file with its tensors as :class:`~tensor_map.TensorRef` (nothing read)."""
    try:
        got = tensor_map.map_tensors(path, _ALLOWED)
    except Exception as exc:  # noqa: BLE001 - damage or an unknown global: not ours to read
        raise UnknownLayout(f"{path.name}: {type(exc).__name__}: {exc}") from None
    if not isinstance(got, dict):
        raise UnknownLayout(f"{path.name} does not hold a dict")
    return got


def open_shards(tag_dir: Path) -> Shards:
    found = [
        (m.group(1) or "", int(m.group(2)), p)
        for p in tag_dir.iterdir()
        if (m := _OPTIM.match(p.name))
    ]
    prefixes = {f for f, _, _ in found}
    if len(prefixes) > 1:
        raise UnknownLayout("both bf16_ and plain optimizer files")
    optim = sorted((r, p) for _, r, p in found)
    if not optim or [r for r, _ in optim] != list(range(len(optim))):
        raise UnknownLayout(
            "no zero_pp_rank_R_mp_rank_00_optim_states.pt files for ranks 0..N-1 (pipeline,"
            " tensor or expert parallel, or no ZeRO)"
        )
    model3 = sorted((int(m.group(1)), p) for p in tag_dir.iterdir() if (m := _MODEL3.match(p.name)))
    model_files = [p for _, p in model3] or [tag_dir / "mp_rank_00_model_states.pt"]
    if not model_files[0].is_file():
        raise UnknownLayout("no mp_rank_00 model states (tensor parallel?)")
    return Shards(
        map_file(model_files[0]), [map_file(p) for _, p in optim], model_files, prefixes.pop()
    )


def _base(osd: dict[str, Any]) -> dict[str, Any]:
    """The wrapped torch optimizer's state dict (ZeRO-1/2 and ZeRO-3 name it differently)."""
    base = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if not isinstance(base, dict) or not isinstance(base.get("state"), dict):
        raise UnknownLayout("the optimizer state is not a torch optimizer state dict")
    return base


def flat_fp32(osd: dict[str, Any]) -> list[Any]:
    got = osd.get("single_partition_of_fp32_groups", osd.get("fp32_flat_groups"))
    if not isinstance(got, list):
        raise UnknownLayout("no flat fp32 partitions in the optimizer state")
    return got


def read_source(tag_dir: Path, norms: bool = True) -> SourceLayout:
    """The layout of the ZeRO checkpoint in ``tag_dir`` (and, with ``norms``, its reference
    norms). Raises :class:`UnknownLayout` for anything this module does not describe."""
    sh = open_shards(tag_dir)
    m = sh.model
    version = str(m.get("ds_version", ""))
    if not version.startswith(KNOWN_RELEASE):
        raise UnknownLayout(f"saved by DeepSpeed {version or '?'}, the layout is known for 0.19")
    if m.get("mp_world_size", 1) != 1:
        raise UnknownLayout(f"tensor/pipeline parallel (mp_world_size {m.get('mp_world_size')})")
    zero = (m.get("ds_config") or {}).get("zero_optimization") or {}
    stage = int(zero.get("stage", 0))
    if stage not in (1, 2, 3):
        raise UnknownLayout(f"ZeRO stage {stage}")
    if zero.get("round_robin_gradients") or zero.get("parameter_alignment"):
        raise UnknownLayout("round_robin_gradients or parameter_alignment is on")
    world = int(m.get("dp_world_size", 0))
    if world != len(sh.optim):
        raise UnknownLayout(f"dp_world_size {world} but {len(sh.optim)} optimizer files")
    shapes = m.get("param_shapes")
    if not isinstance(shapes, list) or not shapes:
        raise UnknownLayout("no param_shapes in the model states")
    groups = [
        [ParamSpan(name=str(n), numel=int(np.prod(s, dtype=np.int64))) for n, s in g.items()]
        for g in shapes
    ]
    osd0 = sh.optim[0].get("optimizer_state_dict")
    if not isinstance(osd0, dict):
        raise UnknownLayout("no optimizer_state_dict in rank 0's optimizer file")
    fp32 = flat_fp32(osd0)
    state = _base(osd0)["state"]
    if len(fp32) != len(groups) or sorted(state) != list(range(len(groups))):
        raise UnknownLayout("the optimizer's flat groups do not match param_shapes")
    first = state[0]
    keys = [
        k
        for k, v in first.items()
        if isinstance(v, tensor_map.TensorRef) and v.numel() > 1 and v.dtype == "float32"
    ]
    frozen: list[ParamSpan] = []
    if stage == 3:
        frozen = [
            ParamSpan(name=str(n), numel=int(np.prod(s, dtype=np.int64)))
            for n, s in (m.get("frozen_param_shapes") or {}).items()
        ]
    layout = SourceLayout(
        zero_stage=stage,
        world_size=world,
        ds_version=version,
        groups=groups,
        frozen=frozen,
        state_keys=keys,
        prefix=sh.prefix,
    )
    for r, sd in enumerate(sh.optim):
        _check_rank(layout, sd.get("optimizer_state_dict"), r)
    if norms:
        layout.norms = source_norms(layout, sh)
    return layout


def _check_rank(layout: SourceLayout, osd: Any, rank: int) -> None:
    """One rank's file against the computed layout: partition counts, flat sizes, and
    DeepSpeed's own record of where each parameter's slice lies (ZeRO-1/2)."""
    family, world = layout.family(), layout.world_size
    if not isinstance(osd, dict):
        raise UnknownLayout(f"rank {rank}: no optimizer_state_dict")
    counts = osd.get("partition_count")
    counts = counts if isinstance(counts, list) else [counts] * len(layout.groups)
    if any(c != world for c in counts):
        raise UnknownLayout(f"rank {rank}: partition counts {counts}, world {world}")
    fp32, state = flat_fp32(osd), _base(osd)["state"]
    maps = osd.get("param_slice_mappings")
    for g, group in enumerate(layout.groups):
        size = partition_numel(family, group, world)
        got = fp32[g].numel() if isinstance(fp32[g], tensor_map.TensorRef) else -1
        padding = (osd.get("group_paddings") or [0] * len(layout.groups))[g]
        if got not in (size, size - padding):
            raise UnknownLayout(f"rank {rank} group {g}: {got} fp32 elements, expected {size}")
        for key in layout.state_keys:
            ref = state.get(g, {}).get(key)
            if not isinstance(ref, tensor_map.TensorRef) or ref.numel() != size or not ref.dtype:
                raise UnknownLayout(f"rank {rank} group {g}: {key} is not a {size}-long partition")
        if family == "zero12":
            recorded = {name: _address(a) for name, a in (maps or [{}] * 99)[g].items()}
            want = {pc.name: (pc.numel, pc.flat_start) for pc in pieces(family, group, world, rank)}
            if recorded != want:
                raise UnknownLayout(
                    f"rank {rank} group {g}: DeepSpeed's param_slice_mappings differ from the layout"
                )


def _address(a: Any) -> tuple[int, int]:
    """A pickled ``fragment_address`` (numel, start), however its named tuple was stored."""
    state = getattr(a, "state", None)
    if isinstance(state, dict) and {"numel", "start"} <= state.keys():
        return int(state["numel"]), int(state["start"])
    args = getattr(a, "args", None) or (a if isinstance(a, tuple) else ())
    return (int(args[0]), int(args[1])) if len(args) == 2 else (-1, -1)


_CHUNK = 1 << 22
_WEIGHTS: list[Any] = []


def _weights() -> Any:
    """``1 + i % POSITIONS`` for a chunk plus one period, computed once (float64)."""
    if not _WEIGHTS:
        _WEIGHTS.append(1.0 + (np.arange(_CHUNK + POSITIONS) % POSITIONS))
    return _WEIGHTS[0]


def sums(array: Any, start: int, numel: int, first: int) -> tuple[float, float]:
    """Sum of squares of ``array[start:start + numel]`` in float64, plain and weighted by the
    elements' indices in their parameter (the first is ``first``), a few million at a time."""
    plain = weighted = 0.0
    w = _weights()
    for a in range(0, numel, _CHUNK):
        b = min(a + _CHUNK, numel)
        x = np.asarray(array[start + a : start + b], dtype=np.float64)
        x *= x
        o = (first + a) % POSITIONS
        plain += float(x.sum())
        weighted += float(np.dot(x, w[o : o + b - a]))
    return plain, weighted


def source_norms(layout: SourceLayout, sh: Shards) -> dict[str, dict[str, float]]:
    """Per parameter, the sum of squares of its fp32 weights and each partitioned state
    (plain and position-weighted), read from every rank's shard with the checkpoint's own
    layout; the shards in threads (numpy releases the GIL), added up in rank order."""
    from concurrent.futures import ThreadPoolExecutor

    family, world = layout.family(), layout.world_size

    def one(r: int) -> list[tuple[str, str, float]]:
        osd = sh.optim[r]["optimizer_state_dict"]
        fp32, state = flat_fp32(osd), _base(osd)["state"]
        got = []
        for g, group in enumerate(layout.groups):
            arrays = {FP32: fp32[g].array()}
            arrays |= {k: state[g][k].array() for k in layout.state_keys}
            for pc in pieces(family, group, world, r):
                for key, arr in arrays.items():
                    plain, weighted = sums(arr, pc.flat_start, pc.numel, pc.param_start)
                    got += [(pc.name, key, plain), (pc.name, positional(key), weighted)]
        return got

    out: dict[str, dict[str, float]] = {}
    with ThreadPoolExecutor(max_workers=min(4, world)) as pool:
        for part in pool.map(one, range(world)):
            for name, key, value in part:
                row = out.setdefault(name, {})
                row[key] = row.get(key, 0.0) + value
    return out


def target_blocker(ds_config: dict[str, Any]) -> str | None:
    """Why a DeepSpeed config's engine cannot take a resharded load, or None (decided before
    launch; the ranks check the built engine again)."""
    zero = ds_config.get("zero_optimization") or {}
    bf16 = (ds_config.get("bf16") or ds_config.get("bfloat16") or {}).get("enabled", False)
    accum = (ds_config.get("data_types") or {}).get("grad_accum_dtype")
    if bf16 and zero.get("stage") == 1 and accum in ("fp32", "float32", "float"):
        return "bf16 with ZeRO-1 and fp32 gradient accumulation trains through DeepSpeed's BF16_Optimizer"
    if zero.get("round_robin_gradients") or zero.get("parameter_alignment"):
        return "round_robin_gradients or parameter_alignment is on"
    for key in ("offload_optimizer", "offload_param"):
        device = (zero.get(key) or {}).get("device", "none")
        if device == "nvme" or (key == "offload_param" and device not in ("none", None)):
            return f"zero_optimization.{key} to {device}"
    return None
