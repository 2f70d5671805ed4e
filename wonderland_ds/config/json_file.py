"""Read a config file as a JSON object, reporting every user mistake as a finding.

Stricter than :func:`json.load` where DeepSpeed would go wrong silently: a key given twice,
``NaN``/``Infinity`` and numbers that overflow to infinity are refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wonderland_ds.core.findings import Finding


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _no_constants(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def _finite(text: str) -> float:
    value = float(text)
    if value in (float("inf"), float("-inf")):
        raise ValueError(f"{text} overflows to infinity")
    return value


_JSON_TYPES = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}


def load_json(path: str | Path) -> tuple[dict[str, Any] | None, list[Finding]]:
    """Read a JSON object; never raises for a user mistake (returns an error finding)."""
    p, file = Path(path), str(path)

    def fail(msg: str, fix: str) -> tuple[None, list[Finding]]:
        return None, [Finding("config-unreadable", "error", msg, fix, file)]

    if not p.exists():
        return fail("file does not exist", "pass the path of a DeepSpeed JSON config")
    if p.is_dir():
        return fail("is a directory, not a config file", "pass a .json file inside it")
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        return fail(f"cannot be read: {exc}", "check the file's permissions and encoding (UTF-8)")
    if not text.strip():
        return fail(
            "is empty", "write a JSON object, e.g. a copy of ds_configs/cpu_zero2_fp32.json"
        )
    try:
        data = json.loads(
            text,
            object_pairs_hook=_no_duplicates,
            parse_constant=_no_constants,
            parse_float=_finite,
        )
    except json.JSONDecodeError as exc:
        return fail(
            f"is not valid JSON: {exc.msg} at line {exc.lineno} column {exc.colno}",
            "fix the JSON syntax there (trailing commas and comments are not JSON)",
        )
    except ValueError as exc:
        return fail(f"is not valid JSON: {exc}", "keep each key once; numbers must be finite")
    except RecursionError:
        return fail("is nested too deeply to be a config", "a config is a few levels deep")
    if not isinstance(data, dict):
        return fail(
            f"top level is a JSON {_JSON_TYPES.get(type(data), 'null')}, not an object",
            "a DeepSpeed config is a JSON object: { ... }",
        )
    return data, []
