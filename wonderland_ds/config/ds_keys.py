"""The config keys DeepSpeed itself knows, read from its installed source.

``wonderland check`` must run in well under a second, and importing DeepSpeed (which imports
torch) takes seconds. So instead of importing it, this module parses DeepSpeed's own config and
constants modules with :mod:`ast` (about 0.1 s) and takes from them:

* every identifier-like string literal and annotated field name: the superset of keys that
  DeepSpeed reads anywhere in a config (a valid config is never refused for an unknown key);
* the removed top-level keys DeepSpeed 0.19 refuses outright (``_REMOVED_TOP_LEVEL_CONFIG_KEYS``);
* the field names, aliases, annotations and constant bounds of DeepSpeed's pydantic section
  models (``SECTION_MODELS``), which forbid extra keys and type-check values.

The test suite checks this against DeepSpeed's real parser (``tests/test_ds_parity.py``).

What the parse finds is kept in ``~/.cache/wonderland_ds/`` (``$XDG_CACHE_HOME``), keyed by
DeepSpeed's location and this module's own bytes, and used while every source file it was read
from keeps its size and mtime: every process that checks a config (the front and each rank at
a stage start) saves the 0.2-0.3 s the parse costs. A cache that cannot be read or written is
simply not used.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
from dataclasses import dataclass
from functools import cache, lru_cache
from pathlib import Path
from typing import Any

_IDENT = re.compile(r"^[a-z][a-z0-9_]*$")


class DeepSpeedNotInstalled(RuntimeError):
    pass


@lru_cache(maxsize=1)
def deepspeed_root() -> Path:
    spec = importlib.util.find_spec("deepspeed")  # locates, does not import
    if spec is None or spec.origin is None:
        raise DeepSpeedNotInstalled("deepspeed is not installed: pip install 'deepspeed==0.19.*'")
    return Path(spec.origin).parent


def _config_sources() -> list[Path]:
    root = deepspeed_root()
    return sorted(
        p for p in root.rglob("*.py") if "config" in p.name or p.name.endswith("constants.py")
    )


def _cache_file() -> Path:
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    key = hashlib.sha256(str(deepspeed_root()).encode() + Path(__file__).read_bytes())
    return base / "wonderland_ds" / f"ds_keys-{key.hexdigest()[:16]}.json"


def _stats(relpaths: list[str]) -> dict[str, list[int]]:
    root, out = deepspeed_root(), {}
    for rel in relpaths:
        st = (root / rel).stat()
        out[rel] = [st.st_size, st.st_mtime_ns]
    return out


def _load_cache() -> dict[str, Any] | None:
    try:
        data = json.loads(_cache_file().read_text())
        if not isinstance(data, dict) or data["files"] != _stats(sorted(data["files"])):
            return None  # DeepSpeed changed (upgraded, edited): parse again
        return data
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _store_cache(data: dict[str, Any]) -> None:
    path = _cache_file()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError:
        pass


@lru_cache(maxsize=1)
def _index() -> dict[str, Any]:
    """Known and removed keys and every SECTION_MODELS schema: from the cache while DeepSpeed's
    sources are unchanged, else parsed (and cached)."""
    cached = _load_cache()
    if cached is not None:
        return cached
    root = deepspeed_root()
    known, removed = _parse_keys()
    schemas = {
        f"{rel}:{cls}": {n: [f.annotation, [list(b) for b in f.bounds]] for n, f in spec.items()}
        for rel, cls in SECTION_MODELS.values()
        for spec in [_parse_schema(rel, cls)]
    }
    files = {p.relative_to(root).as_posix() for p in _config_sources()}
    files |= {rel for rel, _ in SECTION_MODELS.values()}
    data = {
        "files": _stats(sorted(files)),
        "known": sorted(known),
        "removed": sorted(removed),
        "schemas": schemas,
    }
    _store_cache(data)
    return data


def _parsed() -> tuple[frozenset[str], frozenset[str]]:
    index = _index()
    return frozenset(index["known"]), frozenset(index["removed"])


def _parse_keys() -> tuple[frozenset[str], frozenset[str]]:
    keys: set[str] = set()
    removed: set[str] = set()
    for src in _config_sources():
        tree = ast.parse(src.read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                if _IDENT.match(node.value):
                    keys.add(node.value)
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                keys.add(node.target.id)
            elif isinstance(node, ast.Assign) and isinstance(node.value, ast.Dict):
                names = {t.id for t in node.targets if isinstance(t, ast.Name)}
                if "_REMOVED_TOP_LEVEL_CONFIG_KEYS" in names:
                    removed |= {
                        k.value
                        for k in node.value.keys
                        if isinstance(k, ast.Constant) and isinstance(k.value, str)
                    }
    return frozenset(keys - removed), frozenset(removed)


def known_keys() -> frozenset[str]:
    """Every key DeepSpeed's config code mentions (a superset of the valid top-level keys)."""
    return _parsed()[0]


def removed_keys() -> frozenset[str]:
    """Top-level keys DeepSpeed 0.19 refuses with DeepSpeedConfigError."""
    return _parsed()[1]


#: Sections DeepSpeed validates with one of its pydantic models (unknown keys refused, values
#: type-checked), by dotted path in the config: (module under deepspeed/, class).
SECTION_MODELS: dict[str, tuple[str, str]] = {
    "zero_optimization": ("runtime/zero/config.py", "DeepSpeedZeroConfig"),
    "zero_optimization.offload_param": (
        "runtime/zero/offload_config.py",
        "DeepSpeedZeroOffloadParamConfig",
    ),
    "zero_optimization.offload_optimizer": (
        "runtime/zero/offload_config.py",
        "DeepSpeedZeroOffloadOptimizerConfig",
    ),
    "fp16": ("runtime/precision_config.py", "DeepSpeedFP16Config"),
    "bf16": ("runtime/precision_config.py", "DeepSpeedBF16Config"),
    "bfloat16": ("runtime/precision_config.py", "DeepSpeedBF16Config"),  # old name of bf16
    "tensorboard": ("monitor/config.py", "TensorBoardConfig"),
    "wandb": ("monitor/config.py", "WandbConfig"),
    "csv_monitor": ("monitor/config.py", "CSVConfig"),
    "comet": ("monitor/config.py", "CometConfig"),
    "comms_logger": ("comm/config.py", "CommsLoggerConfig"),
    "hybrid_engine": ("runtime/config.py", "HybridEngineConfig"),
    "compile": ("compile/config.py", "CompileConfig"),
}


@dataclass(frozen=True)
class FieldSpec:
    """One field of a DeepSpeed pydantic model, as written in its source."""

    annotation: str
    """The annotation's source text, e.g. ``int`` or ``Optional[bool]``."""
    bounds: tuple[tuple[str, float], ...] = ()
    """Numeric constraints given as constants in ``Field(...)``: ``(("gt", 0),)``."""


@cache
def _tree(relpath: str) -> ast.Module:
    return ast.parse((deepspeed_root() / relpath).read_text(encoding="utf-8"))


@cache
def model_schema(relpath: str, class_name: str) -> dict[str, FieldSpec]:
    """Fields (by name and by alias) of one of DeepSpeed's pydantic config models."""
    if (relpath, class_name) in SECTION_MODELS.values():
        fields = _index()["schemas"][f"{relpath}:{class_name}"]
        return {
            n: FieldSpec(a, tuple((str(k), float(v)) for k, v in bounds))
            for n, (a, bounds) in fields.items()
        }
    return _parse_schema(relpath, class_name)


def _parse_schema(relpath: str, class_name: str) -> dict[str, FieldSpec]:
    for node in ast.walk(_tree(relpath)):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            fields: dict[str, FieldSpec] = {}
            for stmt in node.body:
                if not (isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)):
                    continue
                names, bounds = [stmt.target.id], []
                call = stmt.value
                if isinstance(call, ast.Call):
                    for kw in call.keywords:
                        if not isinstance(kw.value, ast.Constant):
                            continue
                        if kw.arg == "alias":
                            names.append(str(kw.value.value))
                        elif kw.arg in ("gt", "ge", "lt", "le") and isinstance(
                            kw.value.value, (int, float)
                        ):
                            bounds.append((kw.arg, float(kw.value.value)))
                spec = FieldSpec(ast.unparse(stmt.annotation), tuple(bounds))
                fields.update(dict.fromkeys(names, spec))
            return fields
    raise DeepSpeedNotInstalled(
        f"{class_name} not found in {relpath}: unsupported DeepSpeed version"
    )


def model_fields(relpath: str, class_name: str) -> frozenset[str]:
    """Field names and aliases of one of DeepSpeed's pydantic config models."""
    return frozenset(model_schema(relpath, class_name))


def section_keys(section: str) -> frozenset[str]:
    """The keys DeepSpeed allows in a section of ``SECTION_MODELS``."""
    return model_fields(*SECTION_MODELS[section])


def zero_keys() -> frozenset[str]:
    return section_keys("zero_optimization")


def offload_keys(kind: str) -> frozenset[str]:
    return section_keys(f"zero_optimization.{kind}")


def precision_keys(section: str) -> frozenset[str]:
    return section_keys(section)
