"""The batch-size triangle: train_batch = micro x grad_acc x data-parallel size.

DeepSpeed asserts it at ``deepspeed.initialize``, on every rank; closed here for a world size
before the launch (and left open, with a note, when the world size is unknown).
"""

from __future__ import annotations

from wonderland_ds.config.ds_models import DSConfig
from wonderland_ds.core.findings import Finding


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
