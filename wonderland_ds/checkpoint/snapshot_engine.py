"""DeepSpeed's checkpoint engine, swapped for one whose ``save`` snapshots the state and queues
the file for the rank's :class:`~wonderland_ds.checkpoint.async_save.Writer`."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from wonderland_ds.checkpoint.async_save import Writer
from wonderland_ds.checkpoint.staging import snapshot
from wonderland_ds.core import ds_internals

if TYPE_CHECKING:
    TorchCheckpointEngine = object
else:
    TorchCheckpointEngine = ds_internals.attr(
        "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine", "TorchCheckpointEngine"
    )


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    """DeepSpeed checkpoint engine: ``save`` snapshots in memory and queues the write.
    ``step_only`` gives the storages only an optimizer step writes (:func:`step_only_storages`):
    those are not copied on the loop's time, and the file is marked held (the loop fences the
    next step). ``copy_held``: the writer thread copies them into pooled buffers first thing,
    so the fence waits for a memcpy; false, it serializes them from the live tensors, so the
    fence waits for torch.save (no extra host memory). Device storages are always copied into
    pooled page-locked host buffers on a side stream (held ones fenced on the device)."""

    def __init__(
        self,
        base: Any,
        writer: Writer,
        step_only: Callable[[], frozenset[int]] = frozenset,
        copy_held: bool = True,
    ) -> None:
        self.name = "WonderlandSnapshotCheckpointEngine"
        self.zipfile_serialization = getattr(base, "zipfile_serialization", True)
        self.writer = writer
        self.step_only = step_only
        self.copy_held = copy_held

    def save(self, state_dict: Any, path: str) -> None:
        memo: dict[int, Any] = {}
        kept: list[torch.Tensor] = []
        staged: list[tuple[torch.UntypedStorage, torch.UntypedStorage]] | None
        staged = [] if self.copy_held else None
        device: list[tuple[torch.UntypedStorage, torch.UntypedStorage, bool]] = []
        pool, step_only = self.writer.pool, self.step_only()
        copy_ = snapshot(state_dict, memo, pool, step_only, kept, staged, device)
        self.writer.write(
            copy_, path, self.zipfile_serialization, list(memo.values()), bool(kept), staged, device
        )


def step_only_storages(engine: Any) -> frozenset[int]:
    """The storages (by data pointer) a save may hold until the fence. Only an optimizer step
    writes the module's parameters (and their ZeRO-3 partitions), the base optimizer's
    parameters (the fp32 master weights) and its state (Adam's moments); forward and backward
    only read them. Host ones are read by the writer thread; device ones are copied at the
    save on a side stream, and the fence orders the optimizer update after that copy.
    Anything not found here (buffers, which a forward may update; DeepSpeed's own scalars) is
    copied before the next step can change it."""
    if _may_step_outside_the_fence(engine):
        return frozenset()
    step_only: set[int] = set()

    def add(t: Any) -> None:
        if isinstance(t, torch.Tensor):
            storage = t.untyped_storage()
            if storage.nbytes():
                step_only.add(storage.data_ptr())

    for p in engine.module.parameters():
        add(p)
        add(getattr(p, "ds_tensor", None))
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for group in getattr(base, "param_groups", []):
        for p in group["params"]:
            add(p)
    for state in getattr(base, "state", {}).values():
        for v in state.values():
            add(v)
    return frozenset(step_only)


def _may_step_outside_the_fence(engine: Any) -> bool:
    """DeepSpeed features that update the optimizer outside the boundary ``engine.step()`` the
    loop fences: unmanaged gradient accumulation (every ``step()`` is a boundary), ZenFlow (its
    own boundary, and a separate process updating the fp32 master weights), SuperOffload (the
    CPU Adam step inside backward). With any of them, nothing is held: everything is copied."""
    unmanaged = not getattr(engine, "managed_gradient_accumulation", lambda: True)()
    super_offload = getattr(engine, "super_offload", lambda: False)()
    return unmanaged or bool(getattr(engine, "zenflow", False)) or bool(super_offload)


def install(
    engine: Any, hook: Callable[[str], None] | None = None, copy_held: bool = True
) -> Writer:
    writer = Writer(hook)
    engine.checkpoint_engine = SnapshotCheckpointEngine(
        engine.checkpoint_engine, writer, lambda: step_only_storages(engine), copy_held
    )
    return writer
