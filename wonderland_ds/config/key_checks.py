"""Keys and values DeepSpeed itself knows: checked without importing it.

DeepSpeed silently ignores unknown top-level keys and typos inside most sections, and refuses
some values only at ``deepspeed.initialize``, on every rank after the launch. The keys and the
types of its own pydantic sections come from ``ds_keys`` (read from its installed source).
"""

from __future__ import annotations

from typing import Any

from pydantic import TypeAdapter, ValidationError

from wonderland_ds.config import ds_keys
from wonderland_ds.config.ds_models import WONDERLAND_KEY, Checkpoint
from wonderland_ds.config.explain import did_you_mean, fix_for
from wonderland_ds.core.findings import Finding


def auto_values(node: Any, loc: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Where the config holds ``"auto"`` (Hugging Face templates), as locations."""
    if isinstance(node, str) and node.strip().lower() == "auto":
        return [loc]
    if isinstance(node, dict):
        return [p for k, v in node.items() for p in auto_values(v, (*loc, k))]
    if isinstance(node, list):
        return [p for i, v in enumerate(node) for p in auto_values(v, (*loc, i))]
    return []


def section_at(raw: dict[str, Any], dotted: str) -> Any:
    """The value at a dotted path (``zero_optimization.offload_param``), or None."""
    node: Any = raw
    for part in dotted.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


_LAX_TYPES: dict[str, Any] = {"int": int, "bool": bool, "float": float, "str": str, "list": list}
_COMM_DTYPES = ("fp16", "bf16", "fp32")


def deepspeed_types(raw: dict[str, Any], file: str) -> list[Finding]:
    """Values DeepSpeed's own pydantic sections refuse (it coerces, e.g. "8" -> 8, as here)."""
    out: list[Finding] = []
    for section, (relpath, cls) in ds_keys.SECTION_MODELS.items():
        body = section_at(raw, section)
        if body is None:
            continue
        if not isinstance(body, dict):
            out.append(
                Finding(
                    "type",
                    "error",
                    f"{section} must be a JSON object (got {body!r})",
                    f'write "{section}": {{...}}',
                    file,
                    section,
                )
            )
            continue
        schema = ds_keys.model_schema(relpath, cls)
        for key, value in body.items():
            spec = schema.get(key)
            name = spec.annotation if spec else ""
            optional = name.startswith("Optional[") and name.endswith("]")
            py_type = _LAX_TYPES.get(name[9:-1] if optional else name)
            if spec is None or py_type is None or (optional and value is None):
                continue
            path = f"{section}.{key}"
            try:
                coerced = TypeAdapter(py_type).validate_python(value)
            except ValidationError as exc:
                err = exc.errors()[0]
                out.append(
                    Finding(
                        "type",
                        "error",
                        f"DeepSpeed refuses {value!r}: {err['msg']}",
                        fix_for(err["type"], (section, key)),
                        file,
                        path,
                    )
                )
                continue
            ops = {"gt": float.__gt__, "ge": float.__ge__, "lt": float.__lt__, "le": float.__le__}
            for op, bound in spec.bounds:
                if isinstance(coerced, (int, float)) and not ops[op](float(coerced), bound):
                    out.append(
                        Finding(
                            "type",
                            "error",
                            f"DeepSpeed requires {key} {op} {bound:g} (got {value!r})",
                            "use a value in the allowed range",
                            file,
                            path,
                        )
                    )
    for key in ("communication_data_type", "seq_parallel_communication_data_type"):
        value = raw.get(key)
        if value is not None and not (isinstance(value, str) and value.lower() in _COMM_DTYPES):
            out.append(
                Finding(
                    "type",
                    "error",
                    f"DeepSpeed refuses {key} {value!r}",
                    f"use one of {', '.join(_COMM_DTYPES)} (or drop the key)",
                    file,
                    key,
                )
            )
    return out


def unknown_keys(raw: dict[str, Any], file: str) -> list[Finding]:
    """Removed and unknown top-level keys, and unknown keys in the sections DeepSpeed
    validates with its own models and in ``checkpoint``, each with "did you mean"."""
    out: list[Finding] = []
    known = ds_keys.known_keys() | {WONDERLAND_KEY}
    for key in raw:
        if key in ds_keys.removed_keys():
            out.append(
                Finding(
                    "removed-key",
                    "error",
                    f"{key!r} was removed from DeepSpeed 0.19, which refuses configs that contain it",
                    "delete the key (see DeepSpeed issue #8489 for replacements)",
                    file,
                    key,
                )
            )
        elif key not in known:
            out.append(
                Finding(
                    "unknown-key",
                    "error",
                    f"DeepSpeed does not know the top-level key {key!r} and would silently ignore it",
                    f"{did_you_mean(key, known)}remove or correct the key",
                    file,
                    key,
                )
            )
    sections = {name: ds_keys.section_keys(name) for name in ds_keys.SECTION_MODELS}
    sections["checkpoint"] = frozenset(Checkpoint.model_fields)
    for section, allowed in sections.items():
        body = section_at(raw, section)
        if isinstance(body, dict):
            for key in body:
                if key not in allowed:
                    out.append(
                        Finding(
                            "unknown-key",
                            "error",
                            f"unknown key {key!r} in {section}",
                            f"{did_you_mean(key, allowed)}remove or correct the key",
                            file,
                            f"{section}.{key}",
                        )
                    )
    return out
