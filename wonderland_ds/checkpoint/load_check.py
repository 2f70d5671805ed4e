"""The check after a load that changed the layout (resharded at load time, or universal).

:func:`check` compares, per parameter, the plain and position-weighted sums of squares of the
loaded fp32 weights and moments (found through DeepSpeed's own parameter-to-partition mapping,
one all-reduce) with those the front computed from the source shards
(:func:`~wonderland_ds.checkpoint.zero_layout.source_norms`): a mismatch refuses the stage
naming the parameter.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from wonderland_ds.checkpoint import zero_layout as zl
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding

#: Relative tolerance of the post-load check (float64 sums of the same fp32 values agree to
#: ~1e-15; a misplaced range changes a parameter's norm by far more).
RTOL = 1e-6


def _local_norms(engine: Any, keys: list[str]) -> dict[str, list[float]]:
    """This rank's share of each trained parameter's sums (:func:`zl.sums` of the fp32
    weights and each of ``keys``: plain, then position-weighted), found through DeepSpeed's
    own mapping of parameters to partitions."""
    opt = engine.optimizer
    names = engine.param_names
    out: dict[str, list[float]] = {}

    def both(t: torch.Tensor | None, first: int) -> list[float]:
        if t is None:
            return [math.nan, math.nan]
        flat = t.detach().reshape(-1).cpu().numpy()
        return list(zl.sums(flat, 0, flat.size, first))

    if engine.zero_optimization_stage() == 3:
        rank = dist.rank()
        for p in engine.module.parameters():
            if p.requires_grad:
                # The last ranks' partitions end in padding: only the parameter's own elements.
                part = p.ds_tensor.ds_numel
                real = max(0, min(part, p.ds_numel - rank * part))
                out[names[p]] = [
                    v
                    for k in keys
                    for v in both(
                        opt.get_local_fp32_param(p, None if k == zl.FP32 else k)[:real],
                        rank * part,
                    )
                ]
        return out
    for g, params in enumerate(opt.bit16_groups):
        flat = opt.single_partition_of_fp32_groups[g]
        state = opt.optimizer.state.get(flat, {})
        for p in params:
            mapping = getattr(p, "_hp_mapping", None)
            if mapping is None:  # no element of this parameter on this rank
                out[names[p]] = [0.0] * (2 * len(keys))
                continue
            a, first = mapping.hp_fragment_address, mapping.lp_fragment_address.start
            out[names[p]] = [
                v
                for k in keys
                for v in both(
                    mapping.hp_fragment
                    if k == zl.FP32
                    else state[k].narrow(0, a.start, a.numel)
                    if k in state
                    else None,
                    first,
                )
            ]
    return out


def check(engine: Any, layout: zl.SourceLayout) -> list[Finding]:
    """The loaded fp32 weights and optimizer moments against the source's, per parameter
    (one all-reduce of plain and position-weighted sums of squares); an error finding names
    each parameter that differs."""
    keys = [zl.FP32, *layout.state_keys]
    stats = [s for k in keys for s in (k, zl.positional(k))]
    names = sorted(layout.norms)
    local = _local_norms(engine, keys)
    vec = torch.tensor(
        [v for n in names for v in local.get(n, [0.0] * len(stats))], dtype=torch.float64
    )
    got = dist.all_reduce_sum(vec.to(dist.device())).cpu()
    bad = []
    for i, name in enumerate(names):
        for j, stat in enumerate(stats):
            want, have = layout.norms[name].get(stat, math.nan), float(got[i * len(stats) + j])
            if not math.isclose(want, have, rel_tol=RTOL, abs_tol=1e-30):
                what = (
                    "position-weighted sum of squares" if stat.endswith("@") else "sum of squares"
                )
                bad.append(f"{name} {stat.rstrip('@')}: {what} {have:.9g} loaded, {want:.9g} saved")
    missing = sorted(set(local) - set(names))
    if missing:
        bad.append(f"not in the checkpoint: {', '.join(missing[:5])}")
    if bad:
        return [
            Finding(
                "reshard-check",
                "error",
                f"after the load, {len(bad)} optimizer tensor(s) differ from the checkpoint's: "
                + "; ".join(bad[:5]),
                "the checkpoint was not restored faithfully: resume on the world size that saved"
                " it, or convert it with `wonderland convert` and report the difference",
            )
        ]
    return [
        Finding(
            "reshard-check",
            "ok",
            f"{len(names)} parameters: fp32 weights and {', '.join(layout.state_keys) or 'no state'}"
            f" match the checkpoint's norms and element positions (rtol {RTOL:g})",
        )
    ]
