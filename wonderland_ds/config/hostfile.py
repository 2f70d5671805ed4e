"""DeepSpeed hostfiles (``host slots=N``): parse and validate with DeepSpeed's own rules.

DeepSpeed's launcher (``deepspeed.launcher.runner._parse_hostfile``) accepts lines matching
``^(\\S+)\\s+slots=(\\d+)``, skips blank lines and ``#`` comments, and raises ValueError for
anything else, for a duplicate host and for an empty file. We apply the same grammar (the tests
compare against DeepSpeed's parser) without importing torch, and add what it lets through:
``slots=0``, shell metacharacters in host names (hosts reach ``ssh``/``pdsh`` command lines)
and trailing junk after the slot count.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from wonderland_ds.core.findings import Finding

_LINE = re.compile(r"^(\S+)\s+slots=(\d+)(.*)$")
_HOST_OK = re.compile(r"^[A-Za-z0-9_.\-:\[\]@]+$")
LOCAL_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})


@dataclass(frozen=True)
class Hostfile:
    path: str
    hosts: dict[str, int]

    @property
    def world_size(self) -> int:
        return sum(self.hosts.values())

    @property
    def localhost_only(self) -> bool:
        """True when every host is this machine: DeepSpeed's launcher then needs
        ``--no_ssh_check`` (it runs ``ssh HOST hostname`` first, which fails with no sshd)."""
        return all(h in LOCAL_NAMES for h in self.hosts)


def parse(path: str | Path) -> tuple[Hostfile | None, list[Finding]]:
    """Parse and validate a hostfile; all problems at once, never raises for bad input."""
    p, file = Path(path), str(path)
    fix_fmt = "write one host per line as 'HOSTNAME slots=N', e.g. 'worker-1 slots=8'"

    def one(msg: str, fix: str, where: str = "") -> tuple[None, list[Finding]]:
        return None, [Finding("hostfile", "error", msg, fix, file, where)]

    if not p.exists():
        return one("hostfile does not exist", "pass an existing file, e.g. hostfiles/localhost")
    if p.is_dir():
        return one("is a directory, not a hostfile", "pass a file inside it")
    try:
        lines = p.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        return one(f"cannot be read: {exc}", "check permissions and encoding (UTF-8)")
    hosts: dict[str, int] = {}
    out: list[Finding] = []
    for n, raw in enumerate(lines, start=1):
        line = raw.strip()
        where = f"line {n}"
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if not m:
            hint = ""
            if re.search(r"slots\s*=\s*\d", line):
                hint = " (no spaces around '=': DeepSpeed's parser needs 'slots=N')"
            out.append(
                Finding("hostfile", "error", f"bad entry {line!r}{hint}", fix_fmt, file, where)
            )
            continue
        host, slots, rest = m.group(1), int(m.group(2)), m.group(3).strip()
        if rest and not rest.startswith("#"):
            out.append(
                Finding(
                    "hostfile",
                    "error",
                    f"unexpected text {rest!r} after slots on host {host!r}",
                    "keep only 'HOSTNAME slots=N' on the line (comments start with #)",
                    file,
                    where,
                )
            )
        if not _HOST_OK.match(host):
            out.append(
                Finding(
                    "hostfile",
                    "error",
                    f"host name {host!r} contains characters that are not allowed (shell"
                    " metacharacters reach the ssh/pdsh command line)",
                    "use a plain host name or IP address",
                    file,
                    where,
                )
            )
        if slots == 0:
            out.append(
                Finding(
                    "hostfile",
                    "error",
                    f"host {host!r} has slots=0",
                    "use slots >= 1 (one per GPU)",
                    file,
                    where,
                )
            )
        if host in hosts:
            out.append(
                Finding(
                    "hostfile",
                    "error",
                    f"host {host!r} is listed twice (DeepSpeed refuses this)",
                    "keep one line per host and add up its slots",
                    file,
                    where,
                )
            )
            continue
        hosts[host] = slots
    if not hosts and not out:
        out.append(Finding("hostfile", "error", "hostfile lists no hosts", fix_fmt, file))
    if out:
        return None, out
    return Hostfile(file, hosts), [
        Finding("hostfile", "ok", f"{len(hosts)} host(s), {sum(hosts.values())} slot(s)", "", file)
    ]
