"""Stage 17's shared machinery: the held-out rows dealt to ranks, gathered back in order,
which checkpoints are compared, and a checkpoint's consolidated fp32 weights (export)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint.describe import resolve_tag_dir
from wonderland_ds.core import distributed as dist
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data.tasks import Split, Task
from wonderland_ds.run import manifest
from wonderland_ds.run.resume_source import stage_ckpt_root

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions

BLOCK = 64
"""Rows per forward pass; a block is the unit dealt to ranks."""


def consolidated_state(tag_dir: Path) -> dict[str, torch.Tensor]:
    """fp32 weights, buffers and frozen parameters via DeepSpeed's zero_to_fp32 (any ZeRO stage).
    The checkpoint's checksums were verified by the preflight before this unpickles it."""
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    return get_fp32_state_dict_from_zero_checkpoint(str(tag_dir.parent), tag=tag_dir.name)


def heldout(task: Task) -> Split:
    if task.heldout is None:
        raise Refused(f"task {task.name!r} has no held-out split", "give the task held-out data")
    if not isinstance(task.heldout, Split):
        raise Refused(
            f"task {task.name!r}: a classifier's held-out set must be arrays (a Split)",
            "give the task heldout=Split(x, y)",
        )
    return task.heldout


def shard(n: int, rank: int, world: int) -> list[np.ndarray]:
    """This rank's blocks of ``range(n)``: block ``b`` goes to rank ``b % world``."""
    starts = range(rank * BLOCK, n, world * BLOCK)
    return [np.arange(s, min(s + BLOCK, n)) for s in starts]


def sweep(
    task: Task,
    model: torch.nn.Module,
    per_block: Callable[[torch.nn.Module, Split, np.ndarray], np.ndarray],
    dtype: Any,
) -> tuple[np.ndarray, np.ndarray]:
    """Run ``per_block`` over this rank's blocks of the held-out split: (sample indices, one
    value per sample). Every rank runs as many blocks as the most loaded one (ZeRO-3's
    forward is collective): the extra ones repeat block 0 and are dropped."""
    from wonderland_ds.eval.weights import passes

    split = heldout(task)
    blocks = shard(len(split), dist.rank(), dist.world_size())
    values = [np.zeros(0, dtype=dtype)]
    with torch.no_grad():
        for i in range(passes(len(blocks))):
            if i < len(blocks):
                values.append(per_block(model, split, blocks[i]))
            else:
                per_block(model, split, np.arange(min(BLOCK, len(split))))
    idx_all = np.concatenate(blocks) if blocks else np.zeros(0, dtype=np.int64)
    return idx_all, np.concatenate(values)


def gather_once(n: int, idx: np.ndarray, values: np.ndarray, fill: Any) -> np.ndarray:
    """Every rank's (indices, values) into one array of ``n``, each index exactly once."""
    out = np.full(n, fill, dtype=values.dtype)
    seen = np.zeros(n, dtype=np.int64)
    for i, v in dist.gather_all((idx, values)):
        out[i] = v
        seen[i] += 1
    if not (seen == 1).all():  # a sharding bug, never a user mistake: fail loudly
        raise RuntimeError(f"held-out samples evaluated {seen.min()}..{seen.max()} times, not once")
    return out


def run_holding(path: Path) -> Path | None:
    """The run directory (with a ``run.json``) a checkpoint lies in, if any."""
    for parent in path.resolve().parents:
        if (parent / manifest.NAME).exists():
            return parent
    return None


def baseline(opts: StageOptions, home: Path) -> Path:
    if opts.baseline:
        v = ck.verify(resolve_tag_dir(Path(opts.baseline)))
    else:
        found = ck.newest_complete(stage_ckpt_root(home, 15))
        if found is None:
            raise Refused(
                f"stage 17 found no complete stage-15 checkpoint in {home} to compare with",
                "pass --baseline PATH",
            )
        v = found
    if not v.complete:
        raise Refused(v.findings)
    return v.tag_dir


def record_gate_failure(run_dir: Path, stage: int, report: Path, failed: list[Finding]) -> None:
    """Rank 0, before the stage's last barrier: the gate's verdict in run.json. The deepspeed
    launcher kills every rank as soon as one exits non-zero, so it must not wait for the exit."""
    manifest.update_stage(
        run_dir,
        stage,
        status="gate-failed",
        finished=manifest.now(),
        report=str(report),
        gate="fail",
        error="; ".join(f.message for f in failed)[:500],
    )
