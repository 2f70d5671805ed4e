"""Every DeepSpeed name outside its public API that wonderland_ds uses, in one place.

DeepSpeed's public surface here is ``deepspeed.initialize``/``init_distributed``, the engine's
documented methods, ``deepspeed.comm``, ``deepspeed.accelerator``, the monitor and
``deepspeed.utils.zero_to_fp32``. Everything else (a converter's module globals, a checkpoint
engine class, op-builder probes, the launcher's ``main``, the config classes' source files) is
declared below with the release it was checked against, reached only through :func:`module`,
:func:`attr` or :func:`patched`, and tested (``tests/test_ds_internals.py``): an upgrade that
moves or renames one fails that test by name instead of failing a run.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

#: The DeepSpeed release every entry below was read and tested against.
CHECKED_RELEASE = "0.19.8"


@dataclass(frozen=True)
class Internal:
    module: str
    names: tuple[str, ...]
    why: str


INTERNALS: dict[str, Internal] = {
    i.module: i
    for i in (
        Internal(
            "deepspeed.checkpoint.ds_to_universal",
            (
                "main",
                "_save_checkpoint",
                "dump_param_fragment",
                "_merge_zero_shards",
                "_aggregate_autoep_zero12_metadata",
                "torch",
                "glob",
                "os",
            ),
            "the universal converter, run in process with its fragments kept in memory",
        ),
        Internal(
            "deepspeed.checkpoint.zero_checkpoint",
            ("torch",),
            "the converter's shard reader: its torch.load is pointed at memory-mapped loads",
        ),
        Internal(
            "deepspeed.checkpoint.deepspeed_checkpoint",
            ("torch",),
            "the converter's checkpoint reader: its torch.load is pointed at mapped loads",
        ),
        Internal(
            "deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine",
            ("TorchCheckpointEngine",),
            "async saves: the engine's checkpoint engine is wrapped to snapshot in memory",
        ),
        Internal(
            "deepspeed.launcher.runner",
            ("main",),
            "the launcher run in a preloaded interpreter (opt-in)",
        ),
        Internal(
            "deepspeed.ops.op_builder.builder",
            ("cuda_minor_mismatch_ok", "probe_is_compatible"),
            "doctor: whether an op can be JIT-built against this CUDA",
        ),
        Internal(
            "deepspeed.ops.op_builder.all_ops",
            ("ALL_OPS",),
            "doctor: the op builders a config needs",
        ),
        Internal(
            "deepspeed.git_version_info",
            ("installed_ops",),
            "doctor: the ops built at install time",
        ),
        Internal(
            "deepspeed.utils",
            ("set_z3_leaf_modules",),
            "ZeRO-3: a mixture-of-experts block's parameters fetched whole, whichever experts run",
        ),
        Internal(
            "deepspeed.runtime.zero.stage3",
            ("estimate_zero3_model_states_mem_needs",),
            "check: DeepSpeed's own per-rank memory figure for ZeRO-3",
        ),
        Internal(
            "deepspeed.runtime.zero.stage_1_and_2",
            ("estimate_zero2_model_states_mem_needs",),
            "check: DeepSpeed's own per-rank memory figure for ZeRO-1/2",
        ),
        Internal(
            "deepspeed.utils.groups",
            ("_clone_world_group",),
            "ZeRO reduces on this copy of the world group, which torch gives its default "
            "timeout: the stage's process-group timeout is made the default before it exists",
        ),
    )
}

#: DeepSpeed source files read as text (never imported) for the config keys it knows, so a
#: config is checked in the front process without importing torch (``config/ds_keys.py``).
SOURCE_FILES = ("runtime/config.py", "runtime/constants.py", "runtime/zero/config.py")


class InternalChanged(RuntimeError):
    """A declared DeepSpeed internal is missing from the installed release."""


def module(name: str) -> ModuleType:
    """A declared internal module, imported."""
    if name not in INTERNALS:
        raise KeyError(f"{name} is not declared in wonderland_ds.core.ds_internals.INTERNALS")
    return importlib.import_module(name)


def attr(module_name: str, name: str) -> Any:
    """A declared internal name of a declared module."""
    if name not in INTERNALS[module_name].names:
        raise KeyError(f"{module_name}.{name} is not declared in ds_internals.INTERNALS")
    try:
        return getattr(module(module_name), name)
    except AttributeError:
        raise InternalChanged(
            f"{module_name}.{name} is gone in DeepSpeed {version()} "
            f"(checked against {CHECKED_RELEASE})"
        ) from None


@contextlib.contextmanager
def patched(replacements: list[tuple[str, str, Any]]) -> Iterator[None]:
    """Set declared module globals for the duration of the block; always restored."""
    originals = [(m, n, attr(m, n)) for m, n, _ in replacements]
    try:
        for m, n, value in replacements:
            setattr(module(m), n, value)
        yield
    finally:
        for m, n, value in originals:
            setattr(module(m), n, value)


def version() -> str:
    from importlib.metadata import PackageNotFoundError
    from importlib.metadata import version as installed

    try:
        return installed("deepspeed")
    except PackageNotFoundError:
        return "not installed"


def source_root() -> Path | None:
    """The installed ``deepspeed`` package folder, located without importing it."""
    spec = importlib.util.find_spec("deepspeed")
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(next(iter(spec.submodule_search_locations)))


def problems() -> list[str]:
    """What differs from the checked release: missing modules, names or source files."""
    out = []
    for internal in INTERNALS.values():
        try:
            mod = importlib.import_module(internal.module)
        except ImportError as exc:
            out.append(f"{internal.module}: cannot import ({exc})")
            continue
        out += [f"{internal.module}.{n}: missing" for n in internal.names if not hasattr(mod, n)]
    root = source_root()
    for rel in SOURCE_FILES:
        if root is None or not (root / rel).is_file():
            out.append(f"deepspeed/{rel}: missing")
    return out
