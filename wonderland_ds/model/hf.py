"""A Hugging Face model directory as the front process reads it: ``config.json``, the weights
it holds and the tokenizer files stage 18 copies. No torch or ``transformers`` import.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from wonderland_ds.config.settings import HFModel
from wonderland_ds.core.findings import Finding, Refused

#: config.json keys that give a model's number of positions, by model family.
POSITION_KEYS = ("max_position_embeddings", "n_positions", "n_ctx", "max_sequence_length")
#: Tokenizer files stage 18 copies from the model directory into the export.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "added_tokens.json",
    "chat_template.jinja",
)
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json")


def read_config(spec: HFModel) -> dict[str, Any]:
    """The model directory's ``config.json``, checked for what the task needs."""
    where = "wonderland.model.hf"
    folder = Path(spec.hf).expanduser()
    if not folder.is_dir():
        raise Refused(
            Finding(
                "model-missing",
                "error",
                f"model directory {spec.hf!r} does not exist",
                "point model.hf at a Hugging Face model directory (with config.json)",
                spec.hf,
                where,
            )
        )
    path = folder / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise Refused(
            Finding(
                "model-config",
                "error",
                f"model directory {spec.hf!r} has no config.json",
                "write it with `config.save_pretrained(DIR)` (transformers), or point model.hf"
                " at the directory that has it",
                str(path),
                where,
            )
        ) from None
    except (OSError, ValueError) as exc:
        raise Refused(
            Finding("model-config", "error", f"{path} is not readable JSON: {exc}", "", str(path))
        ) from None
    if not isinstance(config, dict) or not isinstance(config.get("vocab_size"), int):
        raise Refused(
            Finding(
                "model-config",
                "error",
                f"{path} has no integer vocab_size: not a causal-LM config",
                "use a transformers causal-LM config (save_pretrained)",
                str(path),
                "vocab_size",
            )
        )
    if spec.init == "weights" and not any((folder / w).is_file() for w in WEIGHT_FILES):
        raise Refused(
            Finding(
                "model-weights",
                "error",
                f"model.init is 'weights' but {spec.hf!r} holds no safetensors weights"
                f" ({' or '.join(WEIGHT_FILES)})",
                'save them with `model.save_pretrained(DIR)`, or use "init": "config"',
                spec.hf,
                "wonderland.model.init",
            )
        )
    return config


def positions(config: dict[str, Any]) -> int | None:
    for key in POSITION_KEYS:
        if isinstance(config.get(key), int):
            return int(config[key])
    return None


#: Model families with a router load-balancing loss (``output_router_logits``) in transformers.
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "jamba", "granitemoe")


def is_moe(config: dict[str, Any]) -> bool:
    """A mixture-of-experts config whose model trains a router aux loss."""
    return "output_router_logits" in config or config.get("model_type") in MOE_TYPES
