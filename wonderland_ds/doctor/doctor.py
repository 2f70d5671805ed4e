"""``wonderland doctor``: what this machine and cluster will do to a stage, in seconds.

Each check is a function returning findings (``ok``, ``info``, ``warn``, ``error``) with the fix:
the interpreter, torch and its CUDA build, nvcc against that build, NCCL (``toolchain``);
DeepSpeed, its op report and the JIT build cache (``ops``); a checkpoint's versions against the
installed ones and free disk space (``checkpoint``); the process-group timeout and async error
handling, and whether ``.deepspeed_env`` carries them to other nodes (``environment``); ssh to
every host (``hosts``). GPU items read "n/a" on a machine without CUDA: never a failure. Any
``error`` exits 2.

``--prebuild`` compiles DeepSpeed's JIT ops now (``prebuild``) so the first training start does
not. This module runs the checks in order and hands them to ``report``.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TextIO

from wonderland_ds.core.findings import EXIT_OK, EXIT_REFUSED, Finding, has_errors
from wonderland_ds.doctor import report
from wonderland_ds.doctor.checkpoint import check_checkpoint, check_disk
from wonderland_ds.doctor.cpu import check_bf16
from wonderland_ds.doctor.environment import check_env
from wonderland_ds.doctor.hosts import check_hosts
from wonderland_ds.doctor.ops import check_deepspeed
from wonderland_ds.doctor.prebuild import prebuild
from wonderland_ds.doctor.slurm import check_slurm
from wonderland_ds.doctor.toolchain import (
    check_nccl,
    check_nvcc,
    check_python,
    check_torch,
)


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
    ds_config = None
    if config:
        found, ds_config, pg_timeout_s = check_config(config)
        out += found
        bf16 = (ds_config or {}).get("bf16") or {}
        out += check_bf16("bf16" if isinstance(bf16, dict) and bf16.get("enabled") else "", config)
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
    out += check_slurm(env)
    if run_dir is None and checkpoint:  # the run that holds the checkpoint, if any
        from wonderland_ds.run.manifest import NAME

        held = Path(checkpoint).resolve()
        run_dir = next((str(p) for p in [held, *held.parents] if (p / NAME).exists()), None)
    out.append(check_disk(Path(run_dir or "."), ckpt_bytes))
    return out


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
    report.write(findings, code, t0, as_json, stdout)
    return code
