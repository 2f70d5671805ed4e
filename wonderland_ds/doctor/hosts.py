"""The hostfile's hosts: its grammar, then passwordless ssh to each (in parallel) and pdsh."""

from __future__ import annotations

import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor

from wonderland_ds.core.findings import Finding


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
