"""Python's cyclic garbage collector while a rank starts a stage.

A rank's start imports torch, DeepSpeed and ``torch._dynamo`` (which ``deepspeed.initialize``
pulls in), builds the engine and loads the checkpoint: some 430-450 thousand objects that
live as long as the process, and about 10 thousand of cyclic garbage (functions, cells,
tuples, import-time tracebacks; no tensor: counted with ``gc.DEBUG_SAVEALL`` on the 25.5M GPT
resume). Left on, the collector scans the survivors again and again as they pile up: a large share of
each rank's start in a plain DeepSpeed resume (docs/performance.md has the measured cost).

* ``hold()``: the collector off, where a rank's process starts (``train.py``);
* ``freeze_imports()``: once torch and DeepSpeed are imported and the process group is up,
  everything alive so far is moved out of the collector's sight for good (``gc.freeze``:
  modules, classes, functions, which live as long as the process anyway). The imports'
  own cyclic garbage stays with it for the life of the process: about 7 thousand objects,
  0.7 MB, no tensor (a one-off count after importing DeepSpeed and torch);
* ``collecting()``: the collector on again for a stretch of the start that runs the user's
  code (a task building its data), which may make cyclic garbage in bulk;
* ``release()``: just before the stage's first training step (``engine.fit``) or its
  evaluation, one collection of what the start created since, and the collector back on with
  Python's thresholds. Reference counting frees everything else all along, so memory during
  the start grows only by its own cyclic garbage, freed by that collection; and the full
  collections during training no longer rescan the frozen imports.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

_held = False


def hold() -> None:
    """The collector off until ``release()``; a no-op where it is already off (the caller
    turned it off and keeps it so)."""
    global _held
    if gc.isenabled():
        gc.disable()
        _held = True


def freeze_imports() -> None:
    """Everything tracked so far to the permanent generation, where ``hold()`` is in force."""
    if _held:
        gc.freeze()


@contextlib.contextmanager
def collecting() -> Iterator[None]:
    """The collector on inside the block where ``hold()`` is in force (and off again after):
    the start's own objects are known, a task's data building is not."""
    if not _held:
        yield
        return
    gc.enable()
    try:
        yield
    finally:
        gc.disable()


def release(collect: bool = True) -> int:
    """One collection of the start's cyclic garbage (unless ``collect`` is False: a process
    on its way out), and the collector back on, where ``hold()`` turned it off; returns the
    objects collected (0 when nothing was held)."""
    global _held
    if not _held:
        return 0
    _held = False
    found = gc.collect() if collect else 0
    gc.enable()
    return found
