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

from wonderland_ds.config.lm_settings import HFModel, Mix, TokenFiles
from wonderland_ds.config.settings import WonderlandSettings
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data import builtin
from wonderland_ds.data.scans import scan
from wonderland_ds.data.tasks import Task
from wonderland_ds.data.tokens import TokenData, expand, open_files
from wonderland_ds.model.hf import positions, read_config

NAME = "causal-lm"


def _data(data: TokenFiles, patterns: list[str], where: str, pad_tail: bool) -> TokenData:
    out = TokenData(open_files(expand(patterns, where), data.dtype, where), data.seq_len, pad_tail)
    _not_empty(len(out), data.seq_len, patterns, where)
    return out


def _not_empty(samples: int, seq_len: int, patterns: list[str], where: str) -> None:
    if samples == 0:
        raise Refused(
            Finding(
                "data-empty",
                "error",
                f"the files of {where} hold no sample of seq_len {seq_len} tokens",
                "give more tokens, or a shorter data.seq_len",
                ", ".join(patterns),
                where,
            )
        )


def train_data(data: TokenFiles, mix: Mix, where: str) -> TokenData:
    """The training data of a mix: one dataset over its files, or its named weighted sources
    (each refused on its own when it is missing or holds no sample)."""
    if isinstance(mix, list):
        return _data(data, mix, where, pad_tail=False)
    parts, bad = [], []
    for name, source in mix.items():
        at = f"{where}.{name}.files"
        try:
            files = open_files(expand(source.files, at), data.dtype, at)
            _not_empty(len(TokenData(files, data.seq_len)), data.seq_len, source.files, at)
        except Refused as exc:
            bad += exc.findings
            continue
        parts.append((name, source.weight, files))
    if bad:
        raise Refused(bad)
    return TokenData.blended(parts, data.seq_len)


def mix_files(mix: Mix) -> str:
    if isinstance(mix, list):
        return ", ".join(mix)
    return "; ".join(f"{name}: {', '.join(s.files)}" for name, s in mix.items())


def mix_fingerprint(data: TokenFiles, name: str) -> str | None:
    """The fingerprint of the config's mix ``name`` (``train`` or ``stage_train.N``), or None
    when the config declares no such mix."""
    mixes = {"train": data.train} | {f"stage_train.{k}": m for k, m in data.stage_train.items()}
    if name not in mixes:
        return None
    return scan(train_data(data, mixes[name], f"wonderland.data.{name}"), NAME)[0]


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


def load_task(spec: str, settings: WonderlandSettings, stage: int | None = None) -> Task:
    """``causal-lm`` from the config's ``model`` and ``data`` (the training data stage
    ``stage`` reads), else ``builtin.load(spec)``."""
    if spec != NAME:
        return builtin.load(spec)
    if settings.model is None or settings.data is None:  # the settings' validator says so too
        raise Refused(
            "task causal-lm needs the config's wonderland.model and wonderland.data",
            'give "wonderland": {"task": "causal-lm", "model": {...}, "data": {...}}',
        )
    return causal_lm(settings.model, settings.data, stage)


def causal_lm(model: HFModel, data: TokenFiles, stage: int | None = None) -> Task:
    """The task, with stage ``stage``'s data opened in place and checked; no torch import."""
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
    mix_name, mix = data.mix_for(stage)
    where = f"wonderland.data.{mix_name}"
    train = train_data(data, mix, where)
    check_tokens(train, vocab, where, mix_files(mix))
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
        meta={
            "model": model.hf,
            "init": model.init,
            "seq_len": data.seq_len,
            "mix": mix_name,
            "vocab": vocab,
        },
        document_eos=document_eos(data, config, vocab) if data.document_masking else None,
    )


def document_eos(data: TokenFiles, config: dict, vocab: int) -> int:
    """The token ending each document, for document masking: ``data.eos_id``, else the
    model config's ``eos_token_id`` (the first of a list)."""
    eos: object = data.eos_id
    if eos is None:
        found = config.get("eos_token_id")
        eos = found[0] if isinstance(found, list) and found else found
    if not isinstance(eos, int) or not 0 <= eos < vocab:
        given = "data.eos_id" if data.eos_id is not None else "the model config's eos_token_id"
        raise Refused(
            Finding(
                "data-eos",
                "error",
                f"data.document_masking needs the token that ends each document: {given} is"
                f" {eos!r}, not a token id below the vocabulary size {vocab}",
                "give wonderland.data.eos_id (the EOS your tokenizer appended)",
                "",
                "wonderland.data.eos_id",
            )
        )
    return eos


def epoch_findings(settings: WonderlandSettings, batch: int, file: str) -> list[Finding]:
    """``check``: a source that stages 15 and 16 (and any stage with its own mix) would read
    more than ``data.max_epochs`` times at ``batch`` samples a step. A mix's stream runs on
    through the stages that read it (a stage's own mix starts at its first sample)."""
    from wonderland_ds.data.blend import Blend, Source

    data = settings.data
    if data is None:
        return []
    stages = sorted({15, 16} | {int(k) for k in data.stage_train})
    samples: dict[str, int] = {}
    for n in stages:
        name, _ = data.mix_for(n)
        samples[name] = samples.get(name, 0) + settings.steps_for(n) * batch
    out = []
    for name, total in samples.items():
        where = f"wonderland.data.{name}"
        mix = data.train if name == "train" else data.stage_train[name.split(".", 1)[1]]
        try:
            train = train_data(data, mix, where)
        except Refused as exc:
            return exc.findings
        sources = train.sources or [Source("all files", 1.0, 0, len(train))]
        for source, read in zip(sources, Blend(sources, settings.seed).counts(total)):
            epochs = read / source.size
            if epochs > data.max_epochs:
                what = (
                    f"source {source.name!r} (weight {source.weight:.3g})"
                    if train.sources
                    else "it"
                )
                out.append(
                    Finding(
                        "data-epochs",
                        "warn",
                        f"{where}: {what} would be read {epochs:.1f} times ({read} samples of"
                        f" {source.size}) over {total // batch} steps of {batch} samples, more"
                        f" than data.max_epochs {data.max_epochs:g}",
                        "add data to the source, lower its weight or the steps, or raise"
                        " data.max_epochs if the repetition is meant",
                        file,
                        where,
                    )
                )
    return out
