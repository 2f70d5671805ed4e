"""The arithmetic of ZeRO partitions: which elements of which parameter each rank holds.

A ZeRO-1/2 rank holds one contiguous slice of each parameter group's flat vector (the
parameters in order, padded at the end to a multiple of twice the world size); a ZeRO-3 rank
holds, for each parameter, ``ceil(numel / world)`` elements of it, concatenated per sub-group.
:func:`pieces` turns either into runs of one parameter (``Piece``), the same function for the
checkpoint's world size and the new one: resharding is the intersection of the two
(:func:`transfers`, the reads one new rank makes). Pure functions of the parameters' names and
sizes; ``zero_layout.py`` reads those from a checkpoint.
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict


class ParamSpan(BaseModel):
    """One parameter in a flat group, in order."""

    model_config = ConfigDict(frozen=True)

    name: str
    numel: int


@dataclass(frozen=True)
class Piece:
    """A run of one parameter inside one rank's flat partition of a group: elements
    ``[param_start, param_start + numel)`` of the parameter lie at ``flat_start``."""

    name: str
    param_start: int
    numel: int
    flat_start: int


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def partition_numel(family: str, group: list[ParamSpan], world: int) -> int:
    """Elements of one rank's flat partition of ``group`` (padding included)."""
    total = sum(p.numel for p in group)
    if family == "zero3":
        return sum(_ceil_div(p.numel, world) for p in group)
    align = 2 * world  # DeepSpeed's nccl_start_alignment_factor x the data-parallel size
    return _ceil_div(total, align) * align // world


def pieces(family: str, group: list[ParamSpan], world: int, rank: int) -> list[Piece]:
    """The runs of parameters in rank ``rank``'s flat partition of ``group`` at ``world``."""
    out = []
    if family == "zero3":
        flat = 0
        for p in group:
            part = _ceil_div(p.numel, world)
            lo, hi = rank * part, min(p.numel, (rank + 1) * part)
            if hi > lo:
                out.append(Piece(p.name, lo, hi - lo, flat))
            flat += part
        return out
    size = partition_numel(family, group, world)
    lo, hi = rank * size, (rank + 1) * size
    start = 0
    for p in group:
        a, b = max(start, lo), min(start + p.numel, hi)
        if b > a:
            out.append(Piece(p.name, a - start, b - a, a - lo))
        start += p.numel
    return out


@dataclass(frozen=True)
class Copy:
    """Elements ``[src, src + numel)`` of source rank ``rank``'s flat group go to
    ``[dst, dst + numel)`` of this rank's."""

    rank: int
    src: int
    dst: int
    numel: int


def transfers(
    family: str, old: list[ParamSpan], new: list[ParamSpan], old_world: int, world: int, rank: int
) -> list[Copy]:
    """What rank ``rank`` of ``world`` reads, and from which source rank, to fill its flat
    partition of a group whose source layout is ``old`` (same parameters, maybe reordered)."""
    held: dict[str, list[tuple[int, Piece]]] = {}
    for r in range(old_world):
        for pc in pieces(family, old, old_world, r):
            held.setdefault(pc.name, []).append((r, pc))
    out = []
    for want in pieces(family, new, world, rank):
        lo, hi = want.param_start, want.param_start + want.numel
        for r, have in held.get(want.name, []):
            a, b = max(lo, have.param_start), min(hi, have.param_start + have.numel)
            if b > a:
                out.append(
                    Copy(
                        r,
                        have.flat_start + a - have.param_start,
                        want.flat_start + a - lo,
                        b - a,
                    )
                )
    return out
