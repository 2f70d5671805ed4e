"""Files written so a crash leaves the old or the new one, and sha256 read once per launch."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path
from typing import Any

#: Write errors that mean the storage is full or failing (EFBIG: a file-size limit).
DISK_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def disk_error(exc: BaseException) -> bool:
    """``exc`` says the disk is full (or over quota, or failing), not that the code is wrong."""
    return isinstance(exc, OSError) and exc.errno in DISK_ERRNOS


def free_bytes(path: Path) -> int:
    """Bytes an unprivileged writer may still write on ``path``'s filesystem (``path`` or
    its nearest existing parent)."""
    for p in [path, *path.parents]:
        if p.exists():
            st = os.statvfs(p)
            return st.f_bavail * st.f_frsize
    return 0


def tree_bytes(path: Path) -> int:
    """The size of the files under ``path``."""
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def atomic_write_text(path: Path, text: str) -> None:
    """Write-then-rename, with fsyncs, so readers see the old or the new file, never half. A
    write that fails (a full disk) leaves no temporary file behind."""
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            fh.write(text)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


#: sha256 of files already verified in this launch, keyed by everything a write changes
#: (size, mtime, ctime, inode): the front process verifies a checkpoint, rank 0 of the same
#: launch need not read it again (``export_hashes`` / ``import_hashes``). Only verification
#: reads it; hashes computed while writing a checkpoint never come from here.
_VERIFIED: dict[tuple[str, int, int, int, int], str] = {}


def stat_key(path: Path) -> tuple[str, int, int, int, int]:
    st = os.stat(path)
    return (str(Path(path).resolve()), st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino)


def verified_sha256(path: Path) -> str:
    """sha256 of ``path`` for a verification: read once per launch while the file is unchanged."""
    key = stat_key(path)
    digest = _VERIFIED.get(key)
    if digest is None:
        digest = _VERIFIED[key] = sha256_file(path)
    return digest


def export_hashes() -> list[list[Any]]:
    return [[*key, digest] for key, digest in _VERIFIED.items()]


def import_hashes(rows: list[list[Any]]) -> None:
    for row in rows:
        path, size, mtime, ctime, ino, digest = row
        _VERIFIED[(str(path), int(size), int(mtime), int(ctime), int(ino))] = str(digest)
