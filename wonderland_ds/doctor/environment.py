"""The environment a stage's ranks run with: the process-group timeout, async NCCL error
handling, and what ``.deepspeed_env`` carries to the other nodes.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.findings import Finding

#: wonderland.process_group_timeout_s when no --config tells another.
DEFAULT_PG_TIMEOUT_S = WonderlandSettings().process_group_timeout_s


def env_files(env: Mapping[str, str], home: Path, cwd: Path) -> list[Path]:
    """The files DeepSpeed's multi-node launcher reads (runner.py: DS_ENV_FILE, default
    ``.deepspeed_env``, joined to ``~`` and ``.``; an absolute DS_ENV_FILE wins both)."""
    name = env.get("DS_ENV_FILE", ".deepspeed_env")
    seen: list[Path] = []
    for base in (home, cwd):
        p = Path(os.path.join(base, name))
        if p.is_file() and p.resolve() not in [s.resolve() for s in seen]:
            seen.append(p)
    return seen


def parse_env_file(path: Path) -> tuple[dict[str, str], list[Finding]]:
    """DeepSpeed splits every line on '=': a blank line or a comment crashes the launcher."""
    out: dict[str, str] = {}
    bad = []
    for n, line in enumerate(
        path.read_text(encoding="utf-8", errors="replace").splitlines(True), 1
    ):
        if "=" not in line:
            bad.append(
                Finding(
                    "doctor-ds-env",
                    "error",
                    f"line {n} {line.strip()!r} has no '=': DeepSpeed's launcher crashes on it"
                    " (ValueError in runner.py)",
                    "keep only KEY=VALUE lines: no blank lines, no comments",
                    str(path),
                    f"line {n}",
                )
            )
            continue
        key, val = line.split("=", 1)
        out[key.strip()] = val.strip()
    return out, bad


def check_env(
    env: Mapping[str, str], multi_node: bool, home: Path, cwd: Path, pg_timeout_s: int | None
) -> list[Finding]:
    out: list[Finding] = []
    files = env_files(env, home, cwd)
    carried: dict[str, str] = {}
    for f in files:
        found, bad = parse_env_file(f)
        carried.update(found)
        out += bad
    # Process-group timeout. DEEPSPEED_TIMEOUT is minutes, read when deepspeed is imported.
    raw = env.get("DEEPSPEED_TIMEOUT")
    pg = pg_timeout_s or DEFAULT_PG_TIMEOUT_S
    where = "from --config" if pg_timeout_s else "the default; each config sets its own"
    msg = (
        f"process-group timeout: wonderland passes wonderland.process_group_timeout_s"
        f" = {pg} s ({where}) to deepspeed.init_distributed"
    )
    if raw is None:
        out.append(Finding("doctor-pg-timeout", "ok", msg + "; DEEPSPEED_TIMEOUT unset (10 min)"))
    elif not raw.strip().isdigit():
        out.append(
            Finding(
                "doctor-pg-timeout",
                "error",
                f"DEEPSPEED_TIMEOUT={raw!r} is not a whole number: importing deepspeed fails",
                "unset it, or give whole minutes (DEEPSPEED_TIMEOUT=10)",
            )
        )
    elif int(raw) > 120:
        out.append(
            Finding(
                "doctor-pg-timeout",
                "warn",
                f"DEEPSPEED_TIMEOUT={raw} is in minutes ({int(raw) / 60:.1f} h): a plain"
                " deepspeed script with a hung rank waits that long",
                "give minutes, e.g. DEEPSPEED_TIMEOUT=10; wonderland uses its own setting",
            )
        )
    else:
        out.append(
            Finding("doctor-pg-timeout", "ok", msg + f"; DEEPSPEED_TIMEOUT={raw} min elsewhere")
        )
    # Async error handling: what turns a timed-out NCCL collective into an error, not a hang.
    new, old = env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING"), env.get("NCCL_ASYNC_ERROR_HANDLING")
    if new == "0" or (new is None and old == "0"):
        out.append(
            Finding(
                "doctor-async-errors",
                "warn",
                "async NCCL error handling is off (=0): a timed-out collective hangs the job"
                " instead of failing it",
                "unset it, or set TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
            )
        )
    elif new is None:
        out.append(
            Finding(
                "doctor-async-errors",
                "ok",
                "TORCH_NCCL_ASYNC_ERROR_HANDLING unset here; `wonderland train` sets it to 1"
                " (NCCL only; gloo ignores it)",
            )
        )
    else:
        out.append(Finding("doctor-async-errors", "ok", f"TORCH_NCCL_ASYNC_ERROR_HANDLING={new}"))
    if old is not None:
        out.append(
            Finding(
                "doctor-async-errors",
                "warn",
                f"NCCL_ASYNC_ERROR_HANDLING={old} is the deprecated name"
                + (
                    f" and disagrees with TORCH_NCCL_ASYNC_ERROR_HANDLING={new}"
                    if new and new != old
                    else ""
                ),
                "use TORCH_NCCL_ASYNC_ERROR_HANDLING only",
            )
        )
    for where, value in (
        ("environment", env.get("NCCL_TIMEOUT")),
        ("carried", carried.get("NCCL_TIMEOUT")),
    ):
        if value is not None:
            out.append(
                Finding(
                    "doctor-nccl-timeout",
                    "warn",
                    f"NCCL_TIMEOUT={value} ({'set in the environment' if where == 'environment' else 'in .deepspeed_env'})"
                    " is not an NCCL variable: it has no effect",
                    "set wonderland.process_group_timeout_s (seconds) in the config instead,"
                    " and TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
                )
            )
    # Carried to other nodes? The pdsh launcher forwards NCCL*/PYTHON*/... and these files only.
    names = ", ".join(str(f) for f in files) or "none"
    need = ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] + (["DEEPSPEED_TIMEOUT"] if raw else [])
    missing = [k for k in need if k not in carried]
    if not multi_node:
        out.append(
            Finding(
                "doctor-ds-env",
                "ok",
                f"single node: every rank inherits this environment (.deepspeed_env: {names})",
            )
        )
    elif missing:
        out.append(
            Finding(
                "doctor-ds-env",
                "info",
                f"{', '.join(missing)} not carried to other nodes by a .deepspeed_env ({names});"
                " `wonderland train` writes RUN_DIR/.deepspeed_env and sets DS_ENV_FILE itself,"
                " a plain `deepspeed` launch does not",
                "for plain launches write KEY=VALUE lines to ~/.deepspeed_env",
            )
        )
    else:
        out.append(Finding("doctor-ds-env", "ok", f"carried to every node by {names}"))
    return out
