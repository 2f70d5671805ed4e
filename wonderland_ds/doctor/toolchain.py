"""The interpreter, torch and its GPUs, nvcc against torch's CUDA and NCCL: what DeepSpeed
compiles and runs with on this machine.

GPU items read "n/a" on a machine without CUDA: never a failure.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

from wonderland_ds.core.findings import Finding
from wonderland_ds.doctor.sizes import gib


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
                f"{torch.cuda.device_count()} GPU(s): {', '.join(names)}, {gib(mem)} each",
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
        from wonderland_ds.core import ds_internals

        cuda_minor_mismatch_ok = ds_internals.attr(
            "deepspeed.ops.op_builder.builder", "cuda_minor_mismatch_ok"
        )
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
