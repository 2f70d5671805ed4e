"""Build the ``deepspeed`` launcher command for a stage, and the environment it needs."""

from __future__ import annotations

import os
import shutil
import socket
import sys
from pathlib import Path

from .hostfile import Hostfile

TRAIN_PY = Path(__file__).resolve().parent / "train.py"

#: Written to RUN_DIR/.deepspeed_env and named by DS_ENV_FILE, so DeepSpeed's pdsh launcher
#: exports them to every node (it forwards only NCCL*/PYTHON*/... variables by itself).
#: NCCL_TIMEOUT is not an NCCL variable: the real knobs are the process-group timeout
#: (passed to deepspeed.init_distributed from wonderland.process_group_timeout_s) and this one.
CARRIED_ENV = {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}


def deepspeed_bin() -> str:
    near = Path(sys.executable).with_name("deepspeed")
    return str(near) if near.exists() else (shutil.which("deepspeed") or "deepspeed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def build(
    hostfile: Hostfile,
    nproc: int | None,
    stage_argv: list[str],
    run_dir: Path,
    master_port: int | None = None,
) -> tuple[list[str], dict[str, str], list[str]]:
    """Returns (command, environment, notes for the user)."""
    cmd = [deepspeed_bin(), "--hostfile", hostfile.path]
    notes = []
    if hostfile.localhost_only:
        # DeepSpeed runs `ssh HOST hostname` first even for localhost and fails without sshd.
        # It also asks `ssh HOST hostname -I` for the master address unless it is given.
        cmd += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
    if nproc is not None:
        cmd += ["--num_gpus", str(nproc)]
    cmd += ["--master_port", str(master_port or free_port()), str(TRAIN_PY), *stage_argv]
    env = dict(os.environ)
    env.update(CARRIED_ENV)
    env["DS_ENV_FILE"] = str((run_dir / ".deepspeed_env").resolve())
    if "OMP_NUM_THREADS" not in env:
        # The launcher leaves it unset on CPU: ranks then oversubscribe the cores (FACTS.md).
        local = nproc or max(hostfile.hosts.values())
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
        notes.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} per rank (was unset)")
    notes.append(
        "NCCL_TIMEOUT is not an NCCL variable; set instead: process-group timeout"
        " (wonderland.process_group_timeout_s) and TORCH_NCCL_ASYNC_ERROR_HANDLING=1,"
        " carried to every node through .deepspeed_env"
    )
    return cmd, env, notes


def write_env_file(run_dir: Path, env: dict[str, str]) -> Path:
    path = run_dir / ".deepspeed_env"
    keys = [*CARRIED_ENV, "OMP_NUM_THREADS"]
    path.write_text("".join(f"{k}={env[k]}\n" for k in keys if k in env))
    return path
