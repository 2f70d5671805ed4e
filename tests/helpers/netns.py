"""Processes of a network-namespace host, killed as a power loss kills them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path


def kill_all(namespace: str, only: tuple[bytes, ...] = ()) -> list[int]:
    """SIGKILL every process in ``namespace`` (``ip netns pids``), or only those whose command
    line contains one of ``only``. The pids killed."""
    pids = subprocess.run(
        ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=True
    ).stdout.split()
    killed = []
    for pid in pids:
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
            if only and not any(word in cmdline for word in only):
                continue
            os.kill(int(pid), 9)
        except (OSError, ProcessLookupError):
            continue
        killed.append(int(pid))
    return killed
