"""``wonderland doctor``: what this machine and cluster will do to a stage, in seconds.

Each check is a function returning findings (``ok``, ``info``, ``warn``, ``error``) with the fix:
the interpreter, torch and its CUDA build, nvcc against that build (DeepSpeed compiles its ops
with ``CUDA_HOME``'s nvcc and refuses a major-version mismatch: the field notes' extension
build failure), NCCL, DeepSpeed and its op report, the JIT build cache, a checkpoint's versions
against the installed ones, the process-group timeout and async error handling (and whether
``.deepspeed_env`` carries them to other nodes), ssh to every host and free disk space.
GPU items read "n/a" on a machine without CUDA: never a failure. Any ``error`` exits 2.

``--prebuild`` compiles DeepSpeed's JIT ops now (on CPU: ``deepspeed_shm_comm``, which
``deepspeed.init_distributed`` builds on first use) so the first training start does not.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TextIO

from wonderland_ds.core.findings import EXIT_OK, EXIT_REFUSED, Finding, has_errors

DEFAULT_PG_TIMEOUT_S = 600  # wonderland.process_group_timeout_s default (settings.py)
LOCK_STALE_S = 600
#: Rough first-build times on 2 CPU cores (measured: shm 25 s, fused_adam on CPU 58 s).
BUILD_ESTIMATE_S = {"deepspeed_shm_comm": 25, "fused_adam": 60, "cpu_adam": 60}
GIB = 1 << 30


def _ver(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB / 10 else f"{n / (1 << 20):.1f} MiB"


# ----------------------------------------------------------------- interpreter and torch


def check_python(version: tuple[int, int, int] | None = None) -> Finding:
    v = version or sys.version_info[:3]
    text = ".".join(map(str, v))
    if tuple(v[:2]) >= (3, 10):
        return Finding("doctor-python", "ok", f"Python {text} (>= 3.10)")
    return Finding(
        "doctor-python",
        "error",
        f"Python {text} is older than 3.10",
        "create the venv with python3.10 or newer",
    )


def check_torch() -> list[Finding]:
    import torch

    cuda = torch.version.cuda
    build = f"CUDA {cuda} build" if cuda else "CPU build (no CUDA)"
    out = [Finding("doctor-torch", "ok", f"torch {torch.__version__}, {build}")]
    if torch.cuda.is_available():
        names = sorted({torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())})
        mem = torch.cuda.get_device_properties(0).total_memory
        out.append(
            Finding(
                "doctor-gpu",
                "ok",
                f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}, {_gib(mem)} each",
            )
        )
    elif cuda:
        out.append(
            Finding(
                "doctor-gpu",
                "warn",
                f"torch is a CUDA {cuda} build but sees no GPU",
                "check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES",
            )
        )
    else:
        out.append(
            Finding("doctor-gpu", "info", "n/a: no CUDA GPU; DeepSpeed uses the CPU and gloo")
        )
    return out


def nvcc_release(nvcc: str) -> str | None:
    """``13.0`` from ``nvcc --version`` (None when it does not run)."""
    try:
        text = subprocess.run(
            [nvcc, "--version"], capture_output=True, text=True, timeout=20
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    m = re.search(r"release (\d+\.\d+)", text)
    return m.group(1) if m else None


def compare_cuda(
    torch_cuda: str | None,
    nvcc: str | None,
    release: str | None,
    skip_check: bool = False,
    minor_ok: Mapping[int, list[str]] | None = None,
) -> Finding:
    """DeepSpeed's rule (``assert_no_cuda_mismatch``): nvcc's major.minor must equal torch's,
    except pairs it lists as API-compatible; ``DS_SKIP_CUDA_CHECK=1`` overrides."""
    if torch_cuda is None:
        seen = f"; nvcc {release} at {nvcc} is not used" if nvcc and release else ""
        return Finding("doctor-nvcc", "info", f"n/a: torch is a CPU build, no CUDA ops{seen}")
    if nvcc is None or release is None:
        return Finding(
            "doctor-nvcc",
            "warn",
            f"no nvcc found (CUDA_HOME/bin or PATH): DeepSpeed cannot JIT-compile its CUDA ops"
            f" (fused_adam, ...) for torch's CUDA {torch_cuda}",
            f"install the CUDA {torch_cuda} toolkit and set CUDA_HOME, or install DeepSpeed"
            " with its ops prebuilt (DS_BUILD_OPS=1 pip install deepspeed)",
        )
    want, have = ".".join(torch_cuda.split(".")[:2]), ".".join(release.split(".")[:2])
    if want == have:
        return Finding("doctor-nvcc", "ok", f"nvcc {release} ({nvcc}) matches torch's CUDA {want}")
    major = have.split(".")[0]
    same_api = (minor_ok or {}).get(int(major), []) if major.isdigit() else []
    if want in same_api and have in same_api:
        return Finding(
            "doctor-nvcc",
            "ok",
            f"nvcc {release} ({nvcc}) vs torch's CUDA {want}: different minor version,"
            " which DeepSpeed accepts as API-compatible",
        )
    fix = (
        f"put the CUDA {want} toolkit first (CUDA_HOME=/usr/local/cuda-{want},"
        f" PATH=$CUDA_HOME/bin:$PATH), or install the torch build for CUDA {have}"
    )
    if skip_check:
        return Finding(
            "doctor-nvcc",
            "warn",
            f"nvcc {release} ({nvcc}) does not match torch's CUDA {want};"
            " DS_SKIP_CUDA_CHECK=1 lets DeepSpeed build anyway (may crash at run time)",
            fix,
        )
    return Finding(
        "doctor-nvcc",
        "error",
        f"nvcc {release} ({nvcc}) does not match torch's CUDA {want}: DeepSpeed's JIT op"
        " build fails (CUDAMismatchException) the first time an op is needed",
        fix,
    )


def check_nvcc(env: Mapping[str, str]) -> Finding:
    import torch

    try:
        from torch.utils.cpp_extension import CUDA_HOME
    except Exception:  # noqa: BLE001 - a broken toolkit probe is itself the finding
        CUDA_HOME = None
    # DeepSpeed compiles with CUDA_HOME's nvcc, not necessarily the one on PATH.
    nvcc = str(Path(CUDA_HOME) / "bin" / "nvcc") if CUDA_HOME else shutil.which("nvcc")
    if nvcc and not Path(nvcc).exists():
        nvcc = shutil.which("nvcc")
    release = nvcc_release(nvcc) if nvcc else None
    try:
        from deepspeed.ops.op_builder.builder import cuda_minor_mismatch_ok
    except Exception:  # noqa: BLE001
        cuda_minor_mismatch_ok = {}
    found = compare_cuda(
        torch.version.cuda,
        nvcc,
        release,
        env.get("DS_SKIP_CUDA_CHECK") == "1",
        cuda_minor_mismatch_ok,
    )
    on_path = shutil.which("nvcc")
    if torch.version.cuda and on_path and nvcc and Path(on_path).resolve() != Path(nvcc).resolve():
        msg = f"{found.message}; PATH's nvcc is another one: {on_path}"
        return Finding(found.rule, found.severity, msg, found.fix)
    return found


def check_nccl() -> Finding:
    import torch

    if not torch.cuda.is_available():
        return Finding("doctor-nccl", "info", "n/a: no CUDA GPU (gloo backend)")
    try:
        v = torch.cuda.nccl.version()
    except Exception as exc:  # noqa: BLE001
        return Finding(
            "doctor-nccl",
            "error",
            f"torch sees GPUs but has no NCCL: {exc}",
            "install a torch CUDA build with NCCL",
        )
    text = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return Finding("doctor-nccl", "ok", f"NCCL {text} (bundled with torch)")


def check_time_slices() -> Finding:
    """Whether ``wonderland.gloo_slice_us`` can act on this host (Linux 6.12+)."""
    from wonderland_ds.training.cpu import slices_supported

    why = slices_supported()
    if why is None:
        return Finding(
            "doctor-time-slices",
            "ok",
            f"Linux {platform.release()}: per-thread time slices (wonderland.gloo_slice_us applies)",
        )
    return Finding(
        "doctor-time-slices",
        "info",
        f"{why}: wonderland.gloo_slice_us does nothing here and a stage says so once at its start",
        'set "gloo_slice_us": 0 in the config\'s "wonderland" section to silence the note, or'
        " run on Linux 6.12 or later",
    )


# ----------------------------------------------------------------- DeepSpeed


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


def check_config(path: str) -> tuple[list[Finding], dict[str, Any] | None, int | None]:
    """(findings, the DeepSpeed part of the config, process_group_timeout_s)."""
    from wonderland_ds.config.ds_config import load_json, validate

    raw, found = load_json(path)
    if raw is None:
        return found, None, None
    _, settings, found = validate(raw, path)
    errors = [f for f in found if f.severity == "error"]
    if errors or settings is None:
        return errors, None, None
    ok = Finding("doctor-config", "ok", "valid (`wonderland check` for every finding)", "", path)
    return [ok], raw, settings.process_group_timeout_s


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
        from deepspeed.git_version_info import installed_ops
        from deepspeed.ops.op_builder.all_ops import ALL_OPS
        from deepspeed.ops.op_builder.builder import probe_is_compatible
        from torch.utils.cpp_extension import is_ninja_available
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


# ----------------------------------------------------------------- checkpoint versions


def _checkpoint_versions(path: Path) -> tuple[Path, dict[str, str], str, bool]:
    """(tag dir, versions, where they came from, whether it reads as a checkpoint at all)."""
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint.describe import resolve_tag_dir, safe_load

    tag_dir = resolve_tag_dir(path)
    meta = ck.read_meta(tag_dir) if (tag_dir / ck.META).exists() else None
    if meta and isinstance(meta.get("versions"), dict):
        return tag_dir, {k: str(v) for k, v in meta["versions"].items()}, ck.META, True
    states = sorted(tag_dir.glob("mp_rank_00_model_states.pt")) or sorted(
        tag_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    if not states:
        return tag_dir, {}, "no DeepSpeed model states file: not a checkpoint folder", False
    obj, why = safe_load(states[0])
    if not isinstance(obj, dict):
        return tag_dir, {}, f"{states[0].name}: {why or 'not a dict'}", False
    if obj.get("ds_version"):
        return tag_dir, {"deepspeed": str(obj["ds_version"])}, states[0].name, True
    return tag_dir, {}, f"{states[0].name} has no ds_version", True


def compare_versions(saved: Mapping[str, str], installed: Mapping[str, str]) -> list[Finding]:
    out = []
    for pkg in ("deepspeed", "torch", "python"):
        was, now = saved.get(pkg), installed.get(pkg)
        if was is None or now is None:
            continue
        if was == now:
            out.append(Finding("doctor-ckpt-versions", "ok", f"{pkg} {now}: same as at save"))
        elif _ver(was) == _ver(now):
            out.append(
                Finding("doctor-ckpt-versions", "ok", f"{pkg} {now}, saved with {was} (same minor)")
            )
        else:
            what = {
                "deepspeed": "ZeRO checkpoint layouts change between minor versions",
                "torch": "optimizer state and pickles may differ",
                "python": "pickled client state may not load",
            }[pkg]
            out.append(
                Finding(
                    "doctor-ckpt-versions",
                    "warn",
                    f"{pkg} {now} is installed, the checkpoint was saved with {was}: {what}",
                    f"resume with {pkg}=={was}, or convert it (`wonderland convert`) and verify"
                    " the first steps' losses",
                )
            )
    return out


def check_checkpoint(path: Path) -> tuple[list[Finding], int]:
    """Version findings and the checkpoint's size in bytes (0 when unreadable)."""
    from wonderland_ds.run import manifest

    fix = "pass a global_stepN folder or its parent"
    if not path.exists():
        return [
            Finding("doctor-checkpoint", "error", "checkpoint does not exist", fix, str(path))
        ], 0
    if not path.is_dir():
        return [Finding("doctor-checkpoint", "error", "not a folder", fix, str(path))], 0
    tag_dir, saved, source, readable = _checkpoint_versions(path)
    size = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())
    if not readable:
        why = Finding("doctor-checkpoint", "error", source, fix, str(tag_dir))
        return [why], size
    if not saved:
        return [
            Finding(
                "doctor-checkpoint",
                "warn",
                f"no version information ({source})",
                "check it with `wonderland inspect`",
                str(tag_dir),
            )
        ], size
    head = Finding(
        "doctor-checkpoint",
        "ok",
        f"{_gib(size)}, versions from {source}",
        "",
        str(tag_dir),
    )
    return [head, *compare_versions(saved, manifest.versions())], size


# ----------------------------------------------------------------- environment and hosts


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


def ssh_probe(host: str, timeout_s: float = 10.0) -> str | None:
    """None when ``ssh HOST true`` works non-interactively, else the reason."""
    cmd = ["ssh", "-o", "BatchMode=yes", "-o", "ConnectTimeout=3", host, "true"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return f"no answer in {timeout_s:.0f} s"
    except OSError as exc:
        return str(exc)
    if r.returncode == 0:
        return None
    lines = [ln for ln in r.stderr.strip().splitlines() if ln.strip()]
    return lines[-1] if lines else f"ssh exited {r.returncode}"


def check_hosts(path: str) -> tuple[list[Finding], bool]:
    """Hostfile grammar, then ssh to every host unless it is localhost-only.
    Returns (findings, multi_node)."""
    from wonderland_ds.config import hostfile

    hf, found = hostfile.parse(path)
    if hf is None:
        return found, False
    if hf.localhost_only:
        return [
            Finding(
                "doctor-ssh",
                "ok",
                f"localhost only ({hf.world_size} slots): no ssh needed (`wonderland train`"
                " passes --no_ssh_check)",
                "",
                path,
            )
        ], False
    out = list(found)
    if shutil.which("ssh") is None:
        return out + [
            Finding("doctor-ssh", "error", "ssh is not installed", "install openssh-client", path)
        ], True
    hosts = list(hf.hosts)
    with ThreadPoolExecutor(max_workers=min(16, len(hosts))) as pool:
        answers = dict(zip(hosts, pool.map(ssh_probe, hosts)))
    for host, why in answers.items():
        if why is None:
            out.append(Finding("doctor-ssh", "ok", f"{host}: reachable by ssh", "", path))
        else:
            out.append(
                Finding(
                    "doctor-ssh",
                    "error",
                    f"{host}: not reachable by ssh ({why})",
                    "DeepSpeed's launcher needs passwordless ssh to every host: ssh-copy-id"
                    f" {host}, check ~/.ssh/config, or remove it from the hostfile",
                    path,
                )
            )
    if shutil.which("pdsh") is None:
        out.append(
            Finding(
                "doctor-ssh",
                "warn",
                "pdsh is not installed: DeepSpeed's default multi-node launcher needs it",
                "install pdsh, or launch with `deepspeed --launcher openmpi`",
                path,
            )
        )
    return out, True


def check_disk(where: Path, ckpt_bytes: int) -> Finding:
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if ckpt_bytes <= 0:
        msg = f"{_gib(free)} free at {probe} (no --checkpoint to size a save against)"
        if free < 5 * GIB:
            return Finding("doctor-disk", "warn", msg, "free some space before a long run")
        return Finding("doctor-disk", "ok", msg)
    # A save writes a whole new checkpoint before retention deletes the oldest one.
    need = ckpt_bytes
    if free < need:
        return Finding(
            "doctor-disk",
            "error",
            f"{_gib(free)} free at {probe}, one checkpoint needs {_gib(need)}: the next save fails",
            "free space or point --run-dir at a larger disk",
        )
    if free < 4 * need:
        return Finding(
            "doctor-disk",
            "warn",
            f"{_gib(free)} free at {probe}: room for {free // need} checkpoint(s) of"
            f" {_gib(need)} (keep_last + 1 are on disk during a save)",
            "lower wonderland.keep_last or free space",
        )
    return Finding(
        "doctor-disk",
        "ok",
        f"{_gib(free)} free at {probe}: room for {min(free // need, 1000)}"
        f"{'+' if free // need > 1000 else ''} checkpoints of {_gib(need)}",
    )


# ----------------------------------------------------------------- prebuild


def prebuild(
    ops: list[str] | None, stream: TextIO, ds_config: Mapping[str, Any] | None = None
) -> list[Finding]:
    """Build (or load from the cache) DeepSpeed's JIT ops, showing elapsed time."""
    from deepspeed.accelerator import get_accelerator
    from deepspeed.ops.op_builder.all_ops import ALL_OPS
    from tqdm import tqdm

    names = ops or needed_ops(get_accelerator()._name, ds_config)
    unknown = [n for n in names if n not in ALL_OPS]
    if unknown:
        return [
            Finding(
                "doctor-prebuild",
                "error",
                f"unknown op(s) {unknown}",
                f"choose from: {', '.join(sorted(ALL_OPS))}",
            )
        ]
    est = sum(BUILD_ESTIMATE_S.get(n, 60) for n in names)
    print(
        f"building DeepSpeed ops {', '.join(names)}: don't interrupt (first time ~{est} s;"
        " a build killed midway leaves a lock that makes every later start wait forever)",
        file=stream,
        flush=True,
    )
    out = []
    tty = bool(getattr(stream, "isatty", lambda: False)())
    bar = tqdm(
        total=len(names),
        file=stream,
        disable=not tty,
        unit="op",
        bar_format="{desc} {n_fmt}/{total_fmt} ops [{elapsed}]",
    )
    stop = threading.Event()

    def tick() -> None:  # keep the elapsed time moving while the compiler runs
        while not stop.wait(0.5):
            bar.refresh()

    ticker = threading.Thread(target=tick, daemon=True)
    ticker.start()
    # Build where a stage launched from this environment will look (launch.extensions_dir).
    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_root(os.environ))
    try:
        for name in names:
            bar.set_description_str(f"building {name}")
            cached = (extensions_root(os.environ) / name / f"{name}.so").exists()
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(sys.stderr):
                    ALL_OPS[name].load(verbose=False)
            except Exception as exc:  # noqa: BLE001 - a failed build is the finding
                out.append(
                    Finding(
                        "doctor-prebuild",
                        "error",
                        f"{name} failed to build: {str(exc).splitlines()[0][:300]}",
                        "run `ds_report`; check the compiler, ninja and nvcc findings above",
                    )
                )
                continue
            finally:
                bar.update(1)
            took = time.perf_counter() - t0
            line = (
                f"{name} was already built; loaded in {took:.1f} s"
                if cached
                else f"{name} built in {took:.1f} s"
            )
            if not tty:
                print(line, file=stream, flush=True)
            out.append(Finding("doctor-prebuild", "ok", line))
    finally:
        stop.set()
        ticker.join()
        bar.close()
    return out


# ----------------------------------------------------------------- the command


def run_checks(
    hostfile: str | None = None,
    checkpoint: str | None = None,
    run_dir: str | None = None,
    config: str | None = None,
    env: Mapping[str, str] | None = None,
) -> list[Finding]:
    env = os.environ if env is None else env
    pg_timeout_s: int | None = None
    out = [check_python()]
    out += check_torch()
    out.append(check_nvcc(env))
    out.append(check_nccl())
    out.append(check_time_slices())
    ds_config = None
    if config:
        found, ds_config, pg_timeout_s = check_config(config)
        out += found
    out += check_deepspeed(env, ds_config)
    ckpt_bytes = 0
    if checkpoint:
        found, ckpt_bytes = check_checkpoint(Path(checkpoint))
        out += found
    multi = False
    host_findings: list[Finding] = []
    if hostfile:
        host_findings, multi = check_hosts(hostfile)
    out += check_env(env, multi, Path.home(), Path.cwd(), pg_timeout_s)
    out += host_findings
    if run_dir is None and checkpoint:  # the run that holds the checkpoint, if any
        from wonderland_ds.run.manifest import NAME

        held = Path(checkpoint).resolve()
        run_dir = next((str(p) for p in [held, *held.parents] if (p / NAME).exists()), None)
    out.append(check_disk(Path(run_dir or "."), ckpt_bytes))
    return out


def summary(findings: list[Finding]) -> dict[str, int]:
    return {s: sum(f.severity == s for f in findings) for s in ("ok", "info", "warn", "error")}


def main(
    hostfile: str | None,
    checkpoint: str | None,
    run_dir: str | None,
    prebuild_ops: list[str] | None,
    as_json: bool,
    config: str | None = None,
    stdout: TextIO | None = None,
) -> int:
    stdout = stdout or sys.stdout
    t0 = time.perf_counter()
    # DeepSpeed logs to stdout (its logger) and prints from its op probes: keep stdout for the
    # report so that --json stays parseable.
    with contextlib.redirect_stdout(sys.stderr):
        findings = run_checks(hostfile, checkpoint, run_dir, config)
        if prebuild_ops is not None and not has_errors(findings):
            ds_config = check_config(config)[1] if config else None
            built = prebuild(prebuild_ops, sys.stderr, ds_config)
            done = {f.message.split()[0] for f in built if f.severity == "ok"}
            # The "not built yet" warnings from before the build are answered now.
            findings = [
                f
                for f in findings
                if not (f.rule == "doctor-jit-cache" and f.message.split()[0] in done)
            ]
            findings += built
        elif prebuild_ops is not None:
            findings.append(
                Finding(
                    "doctor-prebuild",
                    "warn",
                    "skipped: fix the failures above first",
                )
            )
    code = EXIT_REFUSED if has_errors(findings) else EXIT_OK
    counts = summary(findings)
    if as_json:
        json.dump(
            {
                "host": platform.node(),
                "checks": [f.to_dict() for f in findings],
                "summary": counts,
                "exit_code": code,
                "seconds": round(time.perf_counter() - t0, 2),
            },
            stdout,
            indent=2,
        )
        stdout.write("\n")
        return code
    for f in findings:
        print(f.line(), file=stdout)
    print(
        f"doctor: {counts['ok']} ok, {counts['info']} info, {counts['warn']} warning(s),"
        f" {counts['error']} failure(s) in {time.perf_counter() - t0:.1f} s",
        file=stdout,
    )
    return code
