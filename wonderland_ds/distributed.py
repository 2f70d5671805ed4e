"""The only module that touches torch.distributed / deepspeed.comm.

Every helper works when distributed is not initialised (one process): rank 0 of 1.
"""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def init(timeout_s: int) -> None:
    """Start the process group with an explicit timeout (not DeepSpeed's 10-minute default)."""
    import deepspeed

    if not dist.is_initialized():
        deepspeed.init_distributed(timeout=datetime.timedelta(seconds=timeout_s))


def active() -> bool:
    return dist.is_available() and dist.is_initialized()


def rank() -> int:
    return dist.get_rank() if active() else 0


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def is_main() -> bool:
    return rank() == 0


def hostname() -> str:
    return socket.gethostname()


def barrier() -> None:
    if active():
        dist.barrier()


def broadcast(obj: T, src: int = 0) -> T:
    """Rank ``src``'s object on every rank (all ranks take the same decision)."""
    if not active():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def gather_all(obj: Any) -> list[Any]:
    if not active():
        return [obj]
    out: list[Any] = [None] * world_size()
    dist.all_gather_object(out, obj)
    return out


def teardown() -> None:
    if active():
        dist.destroy_process_group()


def all_reduce_sum(tensor: Any) -> Any:
    """In-place sum across ranks (no-op on one process)."""
    if active():
        dist.all_reduce(tensor)
    return tensor


def send(tensor: Any, dst: int) -> None:
    dist.send(tensor, dst)


def recv(tensor: Any, src: int) -> None:
    dist.recv(tensor, src)


def monitored_barrier(timeout_s: int) -> str | None:
    """gloo only: a barrier that names the ranks that did not arrive. None when all did (or
    when the backend cannot tell, e.g. NCCL, where a plain barrier is used)."""
    if not active():
        return None
    if dist.get_backend() != "gloo":
        dist.barrier()
        return None
    try:
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=timeout_s), wait_all_ranks=True)
    except RuntimeError as exc:
        return f"ranks missing at the stage-start barrier after {timeout_s} s: {exc}"
    return None
