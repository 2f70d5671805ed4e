"""The only module that touches torch.distributed / deepspeed.comm.

Every helper works when distributed is not initialised (one process): rank 0 of 1.
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from typing import Any, TypeVar

import torch.distributed as dist

from wonderland_ds.core.carried import CARRIED_ENV, CARRIED_PREFIXES

T = TypeVar("T")


def init(timeout_s: int) -> None:
    """Start the process group with an explicit timeout (not DeepSpeed's 10-minute default),
    and make it the timeout of every group created after it."""
    import deepspeed
    from torch.distributed import distributed_c10d as c10d

    from wonderland_ds.core import slurm

    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        slurm.export_task_rank()  # under a plain srun: the ranks from SLURM_PROCID and the rest
        deepspeed.init_distributed(timeout=timeout, dist_backend=backend())
    # ZeRO reduces on DeepSpeed's own copy of the world group (groups._clone_world_group:
    # new_group(ranks), no timeout), and torch gives such groups its built-in default (30 min
    # for gloo), not init_process_group's. Measured: with a 20 s timeout, a SIGSTOPped rank
    # kept the other one blocked in the ZeRO-2 reduction until the run was stopped 62 s later.
    c10d.default_pg_timeout = timeout
    if c10d.default_pg_nccl_timeout is not None:
        c10d.default_pg_nccl_timeout = timeout
    _unlink_shm_segment()


def backend() -> str | None:
    """The process group's backend. On CUDA, NCCL for device tensors *and* gloo for CPU ones:
    NCCL alone rejects a CPU tensor ("No backend type associated with device type cpu"), and
    the guards' check, the pickled-object gathers and the stage's small collectives run on CPU
    tensors. None elsewhere: DeepSpeed's own choice (gloo on a CPU host)."""
    from deepspeed.accelerator import get_accelerator

    if get_accelerator().device_name() == "cuda":
        return "cpu:gloo,cuda:nccl"
    return None


def device() -> Any:
    """Where collectives that test the training transport put their tensors: the current
    GPU on CUDA (NCCL, what training uses), else the CPU."""
    import torch

    if torch.cuda.is_available() and "nccl" in str(dist.get_backend()):
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sync(dev: Any) -> None:
    """Wait for the device's queued work (a NCCL receive returns before the data is there)."""
    import torch

    if getattr(dev, "type", "cpu") == "cuda":
        torch.cuda.synchronize(dev)


def _unlink_shm_segment() -> None:
    """DeepSpeed's CPU shared-memory all-reduce (ops/csrc/cpu/comm/shm.cpp) gives every rank
    a /dev/shm segment when all ranks are local, and never unlinks it: each run left world x
    69 MB of RAM behind, killed or not (measured: 313 segments, 21 GB of a 24 GB machine).
    Every rank maps every peer's segment inside init_distributed, so once all ranks are past
    it the names can go; the mappings live on until the processes end."""
    if not active() or os.environ.get("LOCAL_SIZE") != str(world_size()):
        return  # DeepSpeed's own condition for the segment: identical on every rank
    dist.barrier()
    addr, port = os.environ.get("MASTER_ADDR", ""), os.environ.get("MASTER_PORT", "")
    name = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr}_{port}_{rank()}"
    try:
        os.unlink(name)
    except OSError:
        pass


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


#: Host of every rank, once the stage gathered them (``rank_info``): failures name hosts.
HOSTS: list[str] = []


LAUNCHER_ENV = (
    "CROSS_RANK",
    "CROSS_SIZE",
    "LOCAL_SIZE",
    "OMPI_COMM_WORLD_RANK",
    "OMPI_COMM_WORLD_SIZE",
    "SLURM_PROCID",
    "SLURM_NTASKS",
)


def rank_info() -> dict[str, Any]:
    """Where this rank runs and what reached it: host, pid, accelerator, the timeout its process groups
    really got, and the launch environment carried to every node (.deepspeed_env)."""
    from deepspeed.accelerator import get_accelerator
    from torch.distributed import distributed_c10d as c10d

    keys = {"MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK", *CARRIED_ENV}
    keys |= {k for k in os.environ if k.startswith(CARRIED_PREFIXES)}
    return {
        "rank": rank(),
        "host": hostname(),
        "local_rank": local_rank(),
        "pid": os.getpid(),
        "accelerator": get_accelerator().device_name(),  # "cuda", or "cpu" after a fallback
        "process_group_timeout_s": c10d.default_pg_timeout.total_seconds(),
        "env": {k: os.environ[k] for k in sorted(keys) if k in os.environ},
        # Who started this rank: DeepSpeed's per-node launch.py (node rank and count), mpirun
        # or srun, as each leaves its own variables behind.
        "launched_by": {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ},
    }


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


def shm_buffers(port: str | int, addr: str | None = None) -> list[str]:
    """DeepSpeed's CPU all-reduce leaves one /dev/shm/deepspeed_allreduce_buffer_UID_ADDR_PORT_R
    file (tens of MB) per rank per run and never removes it: runs fill /dev/shm (RAM)."""
    import glob

    pattern = f"/dev/shm/deepspeed_allreduce_buffer_{os.getuid()}_{addr or '*'}_{port}_*"
    return glob.glob(pattern)


def teardown(agreed: bool = True) -> None:
    """``agreed``: every rank reached the same end (success, refusal, guard stop). Then a
    barrier first, so no rank destroys its process group while a peer still talks to it (a
    gloo thread torn down under a peer's feet aborts the process: "terminate called without
    an active exception", exit -6, seen once in CI). After a crash or a hang, no barrier."""
    if active():
        if agreed:
            try:
                dist.barrier()
            except RuntimeError:
                pass
        try:
            # No barrier: every peer mapped this buffer inside init_distributed, and unlinking
            # the name leaves mappings alone. A barrier here cost a whole process-group timeout
            # when tearing down after a hung peer (measured: rank 0 exited 22 s later).
            mine = [
                p
                for p in shm_buffers(
                    os.environ.get("MASTER_PORT", "x"), os.environ.get("MASTER_ADDR")
                )
                if p.endswith(f"_{local_rank()}")
            ]
            for path in mine:
                os.unlink(path)
        except (RuntimeError, OSError):
            pass  # tearing down after a failure: the launcher-side cleanup takes the rest
        dist.destroy_process_group()


def leave(code: int = 0) -> None:
    """End a rank after ``teardown``: flush, finalize MPI under mpirun, ``os._exit``. Objects
    still holding gloo's C++ threads were destroyed in interpreter finalization once in a
    while, aborting a rank whose work had succeeded ("terminate called without an active
    exception", exit -6); skipping finalization leaves nothing for them to do."""
    import sys

    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def all_reduce_sum(tensor: Any) -> Any:
    """In-place sum across ranks (no-op on one process)."""
    if active():
        dist.all_reduce(tensor)
    return tensor


class _Done:
    def wait(self) -> bool:
        return True


def all_reduce_sum_start(tensor: Any) -> Any:
    """Start an in-place sum across ranks and return at once; the sum is in ``tensor`` after
    the returned handle's ``wait()`` (a no-op handle on one process). Every rank must start
    the same collectives in the same order, as for the blocking form."""
    if active():
        return dist.all_reduce(tensor, async_op=True)
    return _Done()


def all_reduce_max_start(tensor: Any) -> Any:
    """:func:`all_reduce_sum_start` with the element-wise maximum."""
    if active():
        return dist.all_reduce(tensor, op=dist.ReduceOp.MAX, async_op=True)
    return _Done()


def all_reduce_max(tensor: Any) -> Any:
    if active():
        dist.all_reduce(tensor, op=dist.ReduceOp.MAX)
    return tensor


def send(tensor: Any, dst: int) -> None:
    dist.send(tensor, dst)


def recv(tensor: Any, src: int) -> None:
    dist.recv(tensor, src)


def explain_timeout(exc: BaseException, timeout_s: int) -> str | None:
    """After a collective failed with a timeout: which ranks no longer answer? Every rank that
    timed out calls this; each marks itself in the rendezvous store and waits a quarter of the
    process-group timeout (at most 30 s) for the others. None when ``exc`` is no timeout.

    Why the store and not ``monitored_barrier``: after a gloo timeout the world group's
    connections to the silent rank are closed ("Application timeout caused pair closure") and
    a monitored barrier on it names nobody. The store lives in rank 0's process, so when it
    does not answer either, rank 0 is the one that hangs; its client has no receive timeout,
    hence the thread."""
    if not active() or not isinstance(exc, RuntimeError) or "timed out" not in str(exc).lower():
        return None  # torch reports collective timeouts as RuntimeError (DistBackendError)
    import threading

    from torch.distributed import distributed_c10d as c10d

    wait_s = max(3, min(30, timeout_s // 4))
    head = f"a collective timed out after the {timeout_s} s process-group timeout on rank {rank()}"
    key = "wonderland/answering/{}".format
    me, world = rank(), world_size()
    silent: list[int] = []

    def ask() -> None:
        try:
            store = c10d._get_default_store()
            store.set(key(me), "1")
            deadline = time.monotonic() + wait_s
            while True:
                silent[:] = [r for r in range(world) if not store.check([key(r)])]
                if not silent or time.monotonic() > deadline:
                    return
                time.sleep(0.2)
        except Exception:  # noqa: BLE001 - the store is gone: its host is the one stuck
            silent[:] = [-1]

    asking = threading.Thread(target=ask, name="wonderland-who-answers", daemon=True)
    silent[:] = [-1]
    asking.start()
    asking.join(wait_s + 5)
    if asking.is_alive() or silent == [-1]:
        where = f" on {HOSTS[0]}" if HOSTS else ""
        who = f"rank 0{where} (it holds the rendezvous store) does not answer: hung or dead"
    elif not silent:
        who = "every rank answers afterwards (a slow collective, not a dead rank)"
    else:
        names = ", ".join(f"{r} ({HOSTS[r]})" if r < len(HOSTS) else str(r) for r in silent)
        who = f"rank {names} did not answer within {wait_s} s: hung or dead"
    return f"{head}; {who} ({type(exc).__name__}: {str(exc).splitlines()[0][:160]})"


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


def log(msg: str) -> None:
    """A line of the stage's log, printed by rank 0 only."""
    if is_main():
        print(f"[wonderland] {msg}", flush=True)
