"""The ``causal-lm`` task: a Hugging Face causal LM on flat token files, set in JSON.

``"wonderland": {"task": "causal-lm", "model": {"hf": DIR}, "data": {...}}``. The model is
built with ``transformers``' ``AutoModelForCausalLM`` (the ``hf`` extra); the data are token
files read in place (``tokens.py``). Everything a launch would trip on later is refused here,
in the front process, from ``config.json`` and a few sampled blocks of data, without
importing torch or ``transformers``: a missing file, a size that is not a whole number of
tokens, a token id outside the vocabulary, ``seq_len`` beyond the model's positions.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wonderland_ds.config.settings import HFModel, TokenFiles, WonderlandSettings
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data import builtin
from wonderland_ds.data.tasks import Task
from wonderland_ds.data.tokens import TokenData, expand, open_files, scan

if TYPE_CHECKING:
    from torch import nn

NAME = "causal-lm"
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


def _data(data: TokenFiles, patterns: list[str], where: str, pad_tail: bool) -> TokenData:
    out = TokenData(
        open_files(expand(patterns, where), data.dtype, where), data.dtype, data.seq_len, pad_tail
    )
    if len(out) == 0:
        raise Refused(
            Finding(
                "data-empty",
                "error",
                f"the files of {where} hold no sample of seq_len {data.seq_len} tokens",
                "give more tokens, or a shorter data.seq_len",
                ", ".join(patterns),
                where,
            )
        )
    return out


def check_tokens(data: TokenData, vocab: int, where: str, files: str) -> None:
    """Refuses token ids outside ``[0, vocab)`` among the sampled blocks; every other block
    is checked as the stages read it (``data.vocab``)."""
    data.vocab, data.where = vocab, where
    _, low, largest = scan(data, NAME)
    if largest >= vocab or low < 0:
        bad = largest if largest >= vocab else low
        raise Refused(
            Finding(
                "data-vocab",
                "error",
                f"{where} holds token id {bad}, outside the model's vocabulary of {vocab}"
                " (read from sampled blocks)",
                "tokenize with the model's tokenizer, or check data.dtype and model.hf",
                files,
                where,
            )
        )


def load_task(spec: str, settings: WonderlandSettings) -> Task:
    """``causal-lm`` from the config's ``model`` and ``data``, else ``builtin.load(spec)``."""
    if spec != NAME:
        return builtin.load(spec)
    if settings.model is None or settings.data is None:  # the settings' validator says so too
        raise Refused(
            "task causal-lm needs the config's wonderland.model and wonderland.data",
            'give "wonderland": {"task": "causal-lm", "model": {...}, "data": {...}}',
        )
    return causal_lm(settings.model, settings.data)


def causal_lm(model: HFModel, data: TokenFiles) -> Task:
    """The task, with its data opened in place and checked; no torch import."""
    config = read_config(model)
    limit = positions(config)
    if limit is not None and data.seq_len > limit:
        raise Refused(
            Finding(
                "data-seq-len",
                "error",
                f"data.seq_len {data.seq_len} is longer than the model's {limit} positions",
                f"use data.seq_len <= {limit}",
                str(Path(model.hf) / "config.json"),
                "wonderland.data.seq_len",
            )
        )
    vocab = int(config["vocab_size"])
    train = _data(data, data.train, "wonderland.data.train", pad_tail=False)
    check_tokens(train, vocab, "wonderland.data.train", ", ".join(data.train))
    heldout = {}
    for name, patterns in data.heldout.items():
        where = f"wonderland.data.heldout.{name}"
        heldout[name] = _data(data, patterns, where, pad_tail=True)
        check_tokens(heldout[name], vocab, where, ", ".join(patterns))
    fingerprint, _, _ = scan(train, NAME)
    return Task(
        name=NAME,
        num_classes=vocab,
        build_model=lambda: build_model(model),
        build_empty_model=lambda: build_model(model, empty=True),
        kind="lm",
        normalize=False,
        batch_format="hf",
        train=train,
        heldout=next(iter(heldout.values())),
        heldout_sources=heldout,
        fingerprint_value=fingerprint,
        hf_dir=str(Path(model.hf).expanduser().resolve()),
        meta={"model": model.hf, "init": model.init, "seq_len": data.seq_len},
    )


def import_transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise Refused(
            "task causal-lm needs the transformers package",
            "pip install 'wonderland_ds[hf]' (transformers)",
        ) from None
    transformers.logging.set_verbosity_error()  # its load reports go to stage logs otherwise
    return transformers


def build_model(spec: HFModel, empty: bool = False) -> nn.Module:
    """``AutoModelForCausalLM`` from the directory: its weights (``init: weights``) or a
    seeded random initialization; ``empty``: random, to be overwritten by a checkpoint."""
    import torch

    tf = import_transformers()
    if spec.init == "weights" and not empty:
        model = tf.AutoModelForCausalLM.from_pretrained(spec.hf, dtype=torch.float32)
    else:
        config = tf.AutoConfig.from_pretrained(spec.hf)
        model = tf.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.config.use_cache = False  # training and scoring never decode: no KV cache
    return model
