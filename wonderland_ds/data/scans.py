"""The token files' scans (fingerprint, smallest and largest sampled token), computed once per
launch: by the front process, whose results rank 0 receives (``launch/stage.py``)."""

from __future__ import annotations

import json

from wonderland_ds.data.tokens import TokenData

#: Scans of unchanged files (keyed by names, sizes, mtimes and inodes), so a stage's data is
#: fingerprinted once: by the front process, whose results rank 0 receives (stage.py).
_SCANS: dict[str, tuple[str, int, int]] = {}


def _scan_key(data: TokenData, name: str) -> str:
    parts: list[object] = [name, data.dtype, data.seq_len, data.layout]
    for f in data.files:
        st = f.path.stat()
        parts.append([str(f.path.resolve()), st.st_size, st.st_mtime_ns, st.st_ino])
    return json.dumps(parts)


def scan(data: TokenData, name: str) -> tuple[str, int, int]:
    """(fingerprint, smallest and largest sampled token) of ``data``, computed once while the
    files are unchanged."""
    key = _scan_key(data, name)
    if key not in _SCANS:
        _SCANS[key] = data.read_blocks(name)
    return _SCANS[key]


def fingerprint_of(data: TokenData, name: str) -> str:
    return scan(data, name)[0]


def export_scans() -> dict[str, list[object]]:
    return {k: list(v) for k, v in _SCANS.items()}


def import_scans(scans: dict[str, list[object]]) -> None:
    for k, (fp, low, high) in scans.items():
        _SCANS[k] = (str(fp), int(low), int(high))  # type: ignore[call-overload]
