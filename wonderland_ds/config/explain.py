"""Findings from pydantic's validation errors: the JSON path, "did you mean", the fix.

Shared by the key checks and the rules, so that every finding about a config names its
place the same way (``zero_optimization.offload_param.device``, ``scheduler.params[0]``).
"""

from __future__ import annotations

import difflib
from typing import Any

from pydantic import ValidationError

from wonderland_ds.core.findings import Finding


def join_loc(loc: tuple[Any, ...]) -> str:
    """A pydantic error location as a JSON path: ``("a", "b", 0)`` -> ``a.b[0]``."""
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def did_you_mean(key: str, candidates: frozenset[str] | set[str]) -> str:
    """``did you mean 'x'? `` for the closest candidate, or nothing."""
    close = difflib.get_close_matches(key, sorted(candidates), n=1, cutoff=0.75)
    return f"did you mean {close[0]!r}? " if close else ""


def fix_for(err_type: str, loc: tuple[Any, ...]) -> str:
    """The fix a finding suggests for one pydantic error type."""
    if err_type in ("int_type", "int_parsing", "int_from_float"):
        return "use a whole JSON number without quotes, e.g. 8"
    if err_type in ("float_type", "float_parsing"):
        return "use a JSON number without quotes, e.g. 1.0"
    if err_type == "bool_type":
        return "use true or false (JSON booleans, no quotes)"
    if err_type == "extra_forbidden":
        return "remove the key (or correct its spelling)"
    if err_type == "missing":
        return f"add {join_loc(loc)}"
    if err_type.startswith(("greater", "less")):
        return "use a value in the allowed range"
    if err_type == "literal_error":
        return "use one of the allowed values"
    return "correct the value"


def pydantic_findings(
    exc: ValidationError, file: str, prefix: tuple[Any, ...], skip: set[str], rule: str
) -> list[Finding]:
    """One finding per error, its path under ``prefix``; paths in ``skip`` are left out."""
    out = []
    for err in exc.errors():
        loc = (*prefix, *err["loc"])
        path = join_loc(loc)
        if path in skip:
            continue
        if err["type"] == "extra_forbidden":
            rule_, msg = "unknown-key", f"unknown key {loc[-1]!r}"
        else:
            rule_, msg = rule, f"{err['msg']} (got {err.get('input')!r})"
        out.append(Finding(rule_, "error", msg, fix_for(err["type"], loc), file, path))
    return out
