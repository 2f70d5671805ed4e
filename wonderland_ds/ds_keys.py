"""The config keys DeepSpeed itself knows, read from its installed source.

``wonderland check`` must run in well under a second, and importing DeepSpeed (which imports
torch) takes seconds. So instead of importing it, this module parses DeepSpeed's own config and
constants modules with :mod:`ast` (about 0.1 s) and takes from them:

* every identifier-like string literal and annotated field name: the superset of keys that
  DeepSpeed reads anywhere in a config (a valid config is never refused for an unknown key);
* the removed top-level keys DeepSpeed 0.19 refuses outright (``_REMOVED_TOP_LEVEL_CONFIG_KEYS``);
* the field names and aliases of DeepSpeed's pydantic section models, which forbid extra keys.

The test suite checks this against DeepSpeed's real parser (``tests/test_ds_parity.py``).
"""

from __future__ import annotations

import ast
import importlib.util
import re
from functools import lru_cache
from pathlib import Path

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


@lru_cache(maxsize=1)
def _parsed() -> tuple[frozenset[str], frozenset[str]]:
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


@lru_cache(maxsize=None)
def model_fields(relpath: str, class_name: str) -> frozenset[str]:
    """Field names and aliases of one of DeepSpeed's pydantic config models."""
    src = deepspeed_root() / relpath
    tree = ast.parse(src.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            fields: set[str] = set()
            for stmt in node.body:
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                    fields.add(stmt.target.id)
                    call = stmt.value
                    if isinstance(call, ast.Call):
                        for kw in call.keywords:
                            if kw.arg == "alias" and isinstance(kw.value, ast.Constant):
                                fields.add(str(kw.value.value))
            return frozenset(fields)
    raise DeepSpeedNotInstalled(f"{class_name} not found in {src}: unsupported DeepSpeed version")


def zero_keys() -> frozenset[str]:
    return model_fields("runtime/zero/config.py", "DeepSpeedZeroConfig")


def offload_keys(kind: str) -> frozenset[str]:
    cls = {
        "offload_param": "DeepSpeedZeroOffloadParamConfig",
        "offload_optimizer": "DeepSpeedZeroOffloadOptimizerConfig",
    }[kind]
    return model_fields("runtime/zero/offload_config.py", cls)


def precision_keys(section: str) -> frozenset[str]:
    cls = {"fp16": "DeepSpeedFP16Config", "bf16": "DeepSpeedBF16Config"}[section]
    return model_fields("runtime/precision_config.py", cls)
