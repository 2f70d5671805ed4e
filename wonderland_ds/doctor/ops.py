"""DeepSpeed itself: whether it imports, its op report, and the JIT ops a stage will build.

A stage builds its JIT ops on its first start, under ``TORCH_EXTENSIONS_DIR``; a build killed
midway leaves a lock that makes every later start wait forever.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from wonderland_ds.core.findings import Finding

LOCK_STALE_S = 600
#: Rough first-build times on 2 CPU cores, for the "not built yet" and prebuild messages.
BUILD_ESTIMATE_S = {"deepspeed_shm_comm": 25, "fused_adam": 60, "cpu_adam": 60}


def extensions_root(env: Mapping[str, str]) -> Path:
    """Where a stage launched from this environment builds and loads DeepSpeed's JIT ops
    (``TORCH_EXTENSIONS_DIR``, which ``wonderland train`` sets per environment and carries to
    every node), so the build reported here is the one a stage will load."""
    from wonderland_ds.launch.command import extensions_dir

    return extensions_dir(dict(env))


def needed_ops(accelerator: str, ds_config: Mapping[str, Any] | None = None) -> list[str]:
    """The JIT ops a stage builds on its first start. On CPU, ``deepspeed.init_distributed``
    builds the shared-memory all-reduce. The optimizer adds FusedAdam for Adam/AdamW without
    ``torch_adam`` (the shipped CPU configs set it, the GPU ones do not) and DeepSpeedCPUAdam
    when the optimizer is offloaded. Without a config: what the shipped configs need."""
    ops = ["deepspeed_shm_comm"] if accelerator == "cpu" else []
    if ds_config is None:
        return ops or ["fused_adam"]
    opt = ds_config.get("optimizer") or {}
    params = opt.get("params") or {}
    zero = ds_config.get("zero_optimization") or {}
    offload = (zero.get("offload_optimizer") or {}).get("device") in ("cpu", "nvme")
    if str(opt.get("type", "")).lower() in ("adam", "adamw"):
        if offload:
            ops.append("cpu_adam")
        elif not params.get("torch_adam"):
            ops.append("fused_adam")
    return ops


def check_deepspeed(
    env: Mapping[str, str], ds_config: Mapping[str, Any] | None = None
) -> list[Finding]:
    try:
        import deepspeed
        from deepspeed.accelerator import get_accelerator
    except Exception as exc:  # noqa: BLE001 - e.g. DEEPSPEED_TIMEOUT=abc fails the import
        return [
            Finding(
                "doctor-deepspeed",
                "error",
                f"deepspeed does not import: {type(exc).__name__}: {exc}",
                "pip install -e . in the venv; check DEEPSPEED_TIMEOUT is a whole number",
            )
        ]
    acc = get_accelerator()._name
    out = [
        Finding(
            "doctor-deepspeed",
            "ok",
            f"deepspeed {deepspeed.__version__}, accelerator {acc}"
            + (" (gloo backend)" if acc == "cpu" else ""),
        )
    ]
    try:
        from torch.utils.cpp_extension import is_ninja_available

        from wonderland_ds.core import ds_internals

        installed_ops = ds_internals.attr("deepspeed.git_version_info", "installed_ops")
        ALL_OPS = ds_internals.attr("deepspeed.ops.op_builder.all_ops", "ALL_OPS")
        probe_is_compatible = ds_internals.attr(
            "deepspeed.ops.op_builder.builder", "probe_is_compatible"
        )
    except Exception as exc:  # noqa: BLE001
        return out + [Finding("doctor-ds-ops", "warn", f"no op report: {exc}")]
    compat = {
        name: bool(probe_is_compatible(b, False))
        for name, b in ALL_OPS.items()
        if name != "deepspeed_not_implemented"  # a placeholder, not an op
    }
    prebuilt = sorted(n for n, yes in installed_ops.items() if yes)
    good = sorted(n for n, yes in compat.items() if yes)
    bad = sorted(n for n, yes in compat.items() if not yes)
    msg = f"op report: {len(good)}/{len(compat)} ops can be JIT-built ({', '.join(good)})"
    if bad:
        msg += f"; not buildable here: {', '.join(bad)}"
    msg += f"; prebuilt in the wheel: {', '.join(prebuilt) or 'none'}"
    out.append(Finding("doctor-ds-ops", "ok", msg))
    needed = needed_ops(acc, ds_config)
    if not is_ninja_available() and any(not installed_ops.get(op) for op in needed):
        # DeepSpeed asks for ninja before every JIT load, even of an op already built.
        out.append(
            Finding(
                "doctor-ds-ops",
                "error",
                f"ninja is missing: DeepSpeed cannot JIT-load {', '.join(needed)}",
                "pip install ninja",
            )
        )
    root = extensions_root(env)
    for op in needed:
        if installed_ops.get(op):
            out.append(Finding("doctor-jit-cache", "ok", f"{op} is prebuilt in the wheel"))
            continue
        if not compat.get(op, False):
            out.append(
                Finding(
                    "doctor-jit-cache",
                    "warn",
                    f"{op} cannot be built here (DeepSpeed falls back or fails at start)",
                    "run `ds_report` for the reason",
                )
            )
            continue
        out.append(check_build_dir(root / op, op))
    return out


def check_build_dir(build_dir: Path, op: str, now: float | None = None) -> Finding:
    """Built, not built yet, or a stale ``lock``: torch removes it when a build ends, even on
    Ctrl-C, but not when the build is killed (SIGTERM/SIGKILL; DeepSpeed's launcher sends SIGTERM
    0.1 s after passing on a Ctrl-C), and every later load then waits for it forever."""
    lock = build_dir / "lock"
    if lock.exists():
        age = (now or time.time()) - lock.stat().st_mtime
        if age > LOCK_STALE_S:
            return Finding(
                "doctor-jit-cache",
                "error",
                f"{op}: stale build lock {lock} ({age / 60:.0f} min old) from a killed build;"
                " every start will hang waiting for it",
                f"rm {lock} (or the whole {build_dir}), then `wonderland doctor --prebuild`",
                str(lock),
            )
        return Finding(
            "doctor-jit-cache",
            "warn",
            f"{op}: a build is in progress ({lock} is {age:.0f} s old)",
            "wait for it to finish; don't interrupt it",
            str(lock),
        )
    if (build_dir / f"{op}.so").exists():
        return Finding("doctor-jit-cache", "ok", f"{op} is built ({build_dir})")
    est = BUILD_ESTIMATE_S.get(op, 60)
    return Finding(
        "doctor-jit-cache",
        "warn",
        f"{op} is not built yet: the first DeepSpeed start compiles it (~{est} s on 2 cores)",
        "run `wonderland doctor --prebuild` once",
    )
