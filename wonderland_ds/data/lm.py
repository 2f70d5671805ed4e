"""The ``causal-lm`` task: a Hugging Face causal LM on token files, set in JSON.

``"wonderland": {"task": "causal-lm", "model": {"hf": DIR}, "data": {...}}``. The model is
built by the model room (``wonderland_ds.model``); the data are token files read in place
(``tokens.py``). Everything a launch would trip on later is refused here,
in the front process, from ``config.json`` and a few sampled blocks of data, without
importing torch or ``transformers``: a missing file, a size that is not a whole number of
tokens, a token id outside the vocabulary, ``seq_len`` beyond the model's positions.
"""

from __future__ import annotations

from pathlib import Path

from wonderland_ds.config.settings import HFModel, TokenFiles, WonderlandSettings
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data import builtin
from wonderland_ds.data.tasks import Task
from wonderland_ds.data.tokens import TokenData, expand, open_files, scan
from wonderland_ds.model.hf import positions, read_config

NAME = "causal-lm"


def _data(data: TokenFiles, patterns: list[str], where: str, pad_tail: bool) -> TokenData:
    out = TokenData(open_files(expand(patterns, where), data.dtype, where), data.seq_len, pad_tail)
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
    from wonderland_ds.model.construct import build_hf

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
        build_model=lambda: build_hf(model),
        build_empty_model=lambda: build_hf(model, empty=True),
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
