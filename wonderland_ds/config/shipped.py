"""The DeepSpeed configs and hostfiles shipped with wonderland_ds: a checkout's top-level
``ds_configs/`` and ``hostfiles/``, or the same files installed as package data."""

from __future__ import annotations

from pathlib import Path

_HERE = Path(__file__).resolve()
_CHECKOUT = _HERE.parents[2]
_INSTALLED = _HERE.parents[1] / "shipped"


def folder(kind: str) -> Path:
    """``ds_configs`` or ``hostfiles``: the checkout's folder when run from one, else the wheel's."""
    mine = _CHECKOUT / kind
    if (_CHECKOUT / "setup.py").is_file() and mine.is_dir():
        return mine
    return _INSTALLED / kind


def configs() -> dict[str, Path]:
    """Every shipped DeepSpeed config by name (the file name without ``.json``)."""
    return {p.stem: p for p in sorted(folder("ds_configs").glob("*.json"))}


def hostfiles() -> dict[str, Path]:
    return {p.name: p for p in sorted(folder("hostfiles").iterdir()) if p.is_file()}


def config_path(text: str) -> str:
    """A ``--config`` value: a path as given, or a shipped config's name (``a100x8_zero2_fp16``)."""
    if Path(text).exists() or "/" in text:
        return text
    return str(configs().get(text.removesuffix(".json"), text))


def hostfile_path(text: str) -> str:
    """A ``--hostfile`` value: a path as given, or a shipped hostfile's name (``a100x8``)."""
    if Path(text).exists() or "/" in text:
        return text
    return str(hostfiles().get(text, text))


DEFAULT_CONFIG = folder("ds_configs") / "cpu_zero2_fp32.json"
DEFAULT_HOSTFILE = folder("hostfiles") / "localhost"
