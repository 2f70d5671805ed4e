"""Describe a checkpoint without trusting it: ``wonderland inspect``.

Works for wonderland checkpoints (metadata + checksums) and for plain DeepSpeed checkpoints
written by someone else, naming what is missing. The model-states file is read for its
structure only (:func:`peek_states`, pickles.py: every global an inert stand-in, no tensor
bytes, no torch import); :func:`safe_load` (``torch.load(weights_only=True)`` with a small
allowlist) is for callers that need the tensors. A checkpoint is a pickle, and inspecting one
must never run code from it (DeepSpeed itself loads with weights_only=False).

Every ``.pt`` file is also scanned for the globals its pickle would call (:func:`scan_pickles`),
wonderland checkpoints included: the sha256 in the metadata proves a file is what was listed,
not that it is safe, since whoever can swap a shard can rewrite its hash too. The scan reads
only each file's small ``data.pkl`` record, never the tensor data, and executes nothing.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint import pickles
from wonderland_ds.core.findings import Finding

_MODEL_STATES = re.compile(r"^(zero_pp_rank_\d+_)?mp_rank_\d+_model_states\.pt$")
_OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_\d+_optim_states\.pt$")
_UNSAFE = re.compile(r"GLOBAL ([\w.]+)")

#: Globals besides torch's own that a checkpoint may name: the classes DeepSpeed pickles into
#: its optimizer files (ZeRO-1/2: all three; ZeRO-3: the first two) and numpy's array rebuild
#: (wonderland_rng.pt). Unpickling them rebuilds data; it calls no code the file chooses.
ALLOWED_GLOBALS = frozenset(
    {
        "deepspeed.runtime.fp16.loss_scaler.LossScaler",
        "deepspeed.runtime.zero.config.ZeroStageEnum",
        "deepspeed.utils.tensor_fragment.fragment_address",
        "numpy._core.multiarray._reconstruct",
        "numpy.core.multiarray._reconstruct",
        "numpy.ndarray",
        "numpy.dtype",
    }
)


def resolve_tag_dir(path: Path) -> Path:
    """A tag folder, or a checkpoint root (use ``latest``, else the newest tag), or a stage
    folder holding ``checkpoints/``."""
    if (path / "checkpoints").is_dir():
        path = path / "checkpoints"
    if any(_MODEL_STATES.match(p.name) for p in path.glob("*.pt")) or (path / ck.META).exists():
        return path
    latest = ck.read_latest(path)
    if latest is not None:
        return path / latest
    found = ck.tags(path)
    return found[-1][1] if found else path


def scan_pickles(tag_dir: Path, skip: frozenset[str] = frozenset()) -> list[Finding]:
    """A finding for every ``.pt`` file (but ``skip``) whose pickle names a global that is
    neither torch's nor on :data:`ALLOWED_GLOBALS`, or that torch's static reader cannot
    follow (fail closed: pickle protocol 4+ opcodes, non-zip files)."""
    import pickle

    out: list[Finding] = []
    for p in sorted(tag_dir.rglob("*.pt")):
        rel = p.relative_to(tag_dir).as_posix()
        if rel in skip or any(part.startswith(".") for part in rel.split("/")):
            continue
        fix = "resume only checkpoints you trust; for one you trust, pass --trust-checkpoint"
        try:
            found = pickles.unsafe_globals(p)  # torch's static scan, without importing torch
        except pickle.UnpicklingError as exc:
            out.append(
                Finding(
                    "ckpt-untrusted",
                    "error",
                    f"cannot be checked without running it ({exc}): DeepSpeed would"
                    " unpickle it with weights_only=False",
                    fix,
                    str(tag_dir),
                    rel,
                )
            )
            continue
        except Exception as exc:  # noqa: BLE001 - damage is reported, never raised
            out.append(
                Finding(
                    "ckpt-unreadable",
                    "error",
                    f"not a readable torch.save file: {type(exc).__name__}:"
                    f" {str(exc).splitlines()[0][:200] if str(exc) else ''}",
                    "restore the file or resume from another checkpoint",
                    str(tag_dir),
                    rel,
                )
            )
            continue
        bad = sorted(set(found) - ALLOWED_GLOBALS)
        if bad:
            out.append(
                Finding(
                    "ckpt-untrusted",
                    "error",
                    f"calls {', '.join(bad)} when unpickled: loading it (DeepSpeed uses"
                    " weights_only=False) would run that code",
                    fix,
                    str(tag_dir),
                    rel,
                )
            )
    return out


def safe_load(path: Path, trust: bool = False) -> tuple[Any | None, str | None]:
    """``torch.load(weights_only=True)`` with :data:`ALLOWED_GLOBALS`; returns (object, None)
    or (None, reason). ``trust``: a file refused for its globals is then loaded with
    ``weights_only=False`` (the user vouched for it; DeepSpeed will do the same)."""
    import pickle

    import torch

    try:
        with torch.serialization.safe_globals(_allowed_objects(path)):
            return torch.load(path, map_location="cpu", weights_only=True), None
    except pickle.UnpicklingError as exc:
        if not trust:
            names = _UNSAFE.findall(str(exc))
            what = f"global {names[0]}" if names else "a non-tensor object"
            return None, f"refused to unpickle {what} (weights_only=True): it may run code"
    except Exception as exc:  # noqa: BLE001 - any damage is reported, never raised
        return None, f"unreadable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    try:
        return torch.load(path, map_location="cpu", weights_only=False), None
    except Exception as exc:  # noqa: BLE001
        return None, f"unreadable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}"


def peek_states(path: Path, trust: bool = False) -> tuple[Any | None, str | None]:
    """The model-states file's structure without its tensor data and without torch
    (pickles.peek: nothing the file names is called); (object, None) or (None, reason).
    Refuses a global outside torch's allowlist and :data:`ALLOWED_GLOBALS` unless ``trust``."""
    import pickle

    try:
        return pickles.peek(path, ALLOWED_GLOBALS, trust), None
    except pickle.UnpicklingError as exc:
        names = _UNSAFE_PEEK.findall(str(exc))
        what = f"global {names[0]}" if names else "a non-tensor object"
        return None, f"refused to unpickle {what} (weights_only=True): it may run code"
    except Exception as exc:  # noqa: BLE001 - any damage is reported, never raised
        first = str(exc).splitlines()[0][:200] if str(exc) else ""
        return None, f"unreadable: {type(exc).__name__}: {first}"


_UNSAFE_PEEK = re.compile(r"global ([\w.]+) is not allowlisted")


def _allowed_objects(path: Path) -> list[Any]:
    """The allowlisted objects ``path`` names, imported (only those: importing deepspeed
    takes seconds, and the model-states file names none of them)."""
    import importlib

    import torch

    try:
        names = set(torch.serialization.get_unsafe_globals_in_checkpoint(str(path)))
    except Exception:  # noqa: BLE001 - torch.load reports the damage itself
        names = set()
    out = []
    for name in sorted(names & ALLOWED_GLOBALS):
        module, _, attr = name.rpartition(".")
        try:
            out.append(getattr(importlib.import_module(module), attr))
        except (ImportError, AttributeError):
            continue
    return out


def describe(
    path: Path, deep: bool = True, trust: bool = False
) -> tuple[dict[str, Any], list[Finding]]:
    """Everything the checkpoint contract asks for, and findings for what is missing.
    ``trust`` (``--trust-checkpoint``): the model states may be unpickled with
    weights_only=False when their globals are not allowlisted (findings still say so)."""
    tag_dir = resolve_tag_dir(path)
    f = str(tag_dir)
    out: list[Finding] = []
    info: dict[str, Any] = {"path": f, "written_by": "unknown"}
    if not tag_dir.is_dir():
        return info, [
            Finding(
                "ckpt-missing",
                "error",
                "checkpoint folder does not exist",
                "pass a checkpoint folder (global_stepN) or its parent",
                f,
            )
        ]
    verdict = ck.verify(tag_dir, deep=deep) if (tag_dir / ck.META).exists() else None
    model_files = sorted(p.name for p in tag_dir.iterdir() if _MODEL_STATES.match(p.name))
    optim_files = sorted(p.name for p in tag_dir.iterdir() if _OPTIM_STATES.match(p.name))
    info["model_state_files"] = model_files
    info["optimizer_state_files"] = optim_files
    if verdict is not None and verdict.meta is not None:
        meta = verdict.meta.fields()
        info.update(meta)
        info["written_by"] = "wonderland"
        info["complete"] = verdict.complete
        out += verdict.findings or [
            Finding(
                "ckpt-checksum",
                "ok",
                f"{len(meta['files'])} file(s) verified (sha256)",
                "",
                f,
            )
        ]
    else:
        info["complete"] = False
        # The metadata file is there but unreadable or of another format: say that, not "no".
        out += verdict.findings if verdict is not None else []
        out.append(
            Finding(
                "ckpt-metadata",
                "warn" if model_files else "error",
                f"{'no readable' if verdict is not None else 'no'} {ck.META}: not a wonderland"
                " checkpoint (or its save never finished); contents cannot be verified against"
                " checksums",
                "re-save through wonderland, or resume it once with `wonderland train --resume`"
                " to get a verified checkpoint",
                f,
                ck.META,
            )
        )
    damaged = frozenset(f.path for f in out if f.rule == "ckpt-checksum" and f.severity == "error")
    untrusted = scan_pickles(tag_dir, skip=damaged)
    out += untrusted
    if not model_files:
        out.append(
            Finding(
                "ckpt-model-state",
                "error",
                "no model states file (mp_rank_00_model_states.pt)",
                "this is not a DeepSpeed checkpoint folder",
                f,
            )
        )
        return info, out
    states, why = peek_states(tag_dir / model_files[0], trust=trust)
    if states is None or not isinstance(states, dict):
        if not any(u.path == model_files[0] for u in untrusted):
            out.append(
                Finding(
                    "ckpt-untrusted",
                    "error",
                    f"{model_files[0]}: {why}",
                    "inspect only checkpoints you trust; resume needs --trust-checkpoint",
                    f,
                    model_files[0],
                )
            )
        return info, out
    sched = states.get("lr_scheduler")
    ds_cfg = states.get("ds_config") or {}
    info.setdefault("global_step", states.get("global_steps"))
    info.setdefault("skipped_steps", states.get("skipped_steps"))
    info.setdefault("deepspeed_version", states.get("ds_version"))
    info.setdefault("zero_stage", (ds_cfg.get("zero_optimization") or {}).get("stage", 0))
    info.setdefault(
        "precision",
        "bf16"
        if (ds_cfg.get("bf16") or {}).get("enabled")
        else "fp16"
        if (ds_cfg.get("fp16") or {}).get("enabled")
        else "fp32",
    )
    info.setdefault("world_size", len(optim_files) or states.get("dp_world_size"))
    # The files are the truth; the metadata only says what the save intended.
    lbi = sched.get("last_batch_iteration") if isinstance(sched, dict) else None
    info["has_scheduler_state"] = isinstance(sched, dict)
    info["warmup_progress"] = None if lbi is None else int(lbi) + 1
    info["has_optimizer_state"] = bool(optim_files) or bool(states.get("optimizer"))
    client = {k for k in states if k not in _DS_KEYS}
    info["client_state_keys"] = sorted(client)
    info["module_keys"] = len(states.get("module") or {})
    if not info["has_optimizer_state"]:
        out.append(
            Finding(
                "ckpt-optimizer-state",
                "error",
                "no optimizer state: a weights-only checkpoint resumes 'fine' and then oscillates",
                "save with engine.save_checkpoint (all ZeRO shards)",
                f,
            )
        )
    if not info["has_scheduler_state"]:
        out.append(
            Finding(
                "ckpt-scheduler-state",
                "error",
                "no LR scheduler state (lr_scheduler is None): the warmup position is lost",
                "train the previous stage with a scheduler in its config",
                f,
            )
        )
    if "universal_checkpoint_info" not in states:
        out.append(
            Finding(
                "ckpt-universal-info",
                "warn",
                "no universal_checkpoint_info: ds_to_universal needs"
                " --inject_missing_state to convert it",
                "",
                f,
            )
        )
    if info["written_by"] != "wonderland":
        for what in (
            "data-loader state (seed, position, fingerprint)",
            "RNG states",
            "library versions",
        ):
            out.append(Finding("ckpt-missing-field", "warn", f"no {what}", "", f))
    return info, out


_DS_KEYS = {
    "module",
    "buffer_names",
    "optimizer",
    "param_shapes",
    "frozen_param_shapes",
    "shared_params",
    "frozen_param_fragments",
    "lr_scheduler",
    "data_sampler",
    "random_ltd",
    "sparse_tensor_module_names",
    "skipped_steps",
    "global_steps",
    "global_samples",
    "dp_world_size",
    "mp_world_size",
    "ds_config",
    "ds_version",
}
