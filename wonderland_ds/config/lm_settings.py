"""The causal-LM task's sections of ``"wonderland"``: ``model`` (a Hugging Face model
directory) and ``data`` (token files, weighted sources, a mix per stage, document masking).
Each field's docstring is its description in docs/configuration.md."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from wonderland_ds.config.strict import _Strict


class HFModel(_Strict):
    """The causal-LM task's model: a Hugging Face model directory."""

    hf: str
    """A Hugging Face model directory with ``config.json`` (and, for ``init: weights``, its
    weights as safetensors; tokenizer files in it are copied into stage 18's export)."""
    init: Literal["config", "weights"] = "config"
    """``config``: random initialization from ``config.json`` (seeded by ``seed``);
    ``weights``: load the directory's weights."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """The dtype the model is built and loaded in. DeepSpeed keeps fp32 master weights
    itself under ``bf16``/``fp16``, so float32 is right unless host memory at load is the
    limit; a half dtype needs DeepSpeed's matching ``bf16``/``fp16`` section."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """The attention kernel ``transformers`` uses: ``sdpa`` (torch's fused attention),
    ``eager`` (plain matmuls) or ``flash_attention_2`` (needs the ``flash-attn`` package and
    a GPU)."""
    gradient_checkpointing: bool = False
    """Recompute each decoder layer's activations in the backward pass (non-reentrant
    checkpointing): activation memory falls to about one layer's, for about a third more
    compute per step."""
    router_aux_loss: bool = True
    """Mixture-of-experts models (Mixtral, Qwen2-MoE, Qwen3-MoE, OLMoE): train the router's
    load-balancing loss with the model's own ``router_aux_loss_coef`` and log it as
    ``aux_loss``. false: the language-model loss only."""


class Source(_Strict):
    """One named source of a weighted training mix."""

    files: list[str] = Field(min_length=1)
    """The source's token files or globs, in order (a glob's matches sorted)."""
    weight: float = Field(gt=0)
    """Its share of every global batch, relative to the other sources' weights (normalized:
    ``0.7`` and ``0.3`` or ``7`` and ``3`` are the same mix)."""


Mix = list[str] | dict[str, Source]
"""Training data: token files or globs (one source, sampled by size), or named sources with
weights."""


def _check_mix(mix: Mix, where: str) -> Mix:
    if isinstance(mix, dict):
        if not mix:
            raise ValueError(f"{where} names no source")
        for name in mix:
            if not name.replace("_", "").replace("-", "").isalnum():
                raise ValueError(
                    f"{where} source name {name!r}: use letters, digits, '-' and '_' (it names"
                    " metrics.csv columns)"
                )
    elif not mix:
        raise ValueError(f"{where} lists no files")
    return mix


class TokenFiles(_Strict):
    """The causal-LM task's data, read in place: flat token files (raw little-endian tokens,
    as nanoGPT and OLMo-core write them) or Megatron's indexed files (``PREFIX.bin`` with its
    ``PREFIX.idx``; a list entry may be the prefix)."""

    train: Mix
    """Training data: token files or globs, in order (a glob's matches sorted), or named
    weighted sources, ``{"web": {"files": [...], "weight": 0.7}, "code": {"files": [...],
    "weight": 0.3}}``: every global batch takes its samples from the sources in those
    proportions (a deterministic interleave, the same for any world size), and a source that
    runs out starts a new epoch in a new order."""
    stage_train: dict[str, Mix] = Field(default_factory=dict)
    """A stage's own training data, in the shape of ``train``, keyed by stage number:
    ``{"16": {"hq": {...}, "web": {...}}}`` anneals stage 16 on another mix while the LR
    schedule continues. The stream of a declared mix starts at its own first sample; the
    preflight records the change instead of refusing it."""
    max_epochs: float = Field(4.0, gt=0)
    """``check`` warns when a stage's steps would read a source more than this many times
    (repeating data past about four epochs stops paying: Muennighoff et al., 2023)."""
    heldout: dict[str, list[str]] = Field(min_length=1)
    """Stage 17's held-out sets: source name -> token files or globs; each source gets its own
    loss, perplexity and gate."""
    dtype: Literal["uint8", "int8", "int16", "uint16", "int32", "uint32", "int64"] | None = None
    """The flat files' token type (default uint16; uint32 or int32 for vocabularies of 65,536
    or more). An indexed file's comes from its index: given, it must agree."""
    seq_len: int = Field(ge=2)
    """Tokens per sample (at most the model's positions)."""
    document_masking: bool = False
    """Keep attention and positions inside each document of a packed sample: position ids
    restart after every EOS, attention is block-diagonal (built by ``transformers`` from the
    restarts) and no token is predicted across a boundary. ``check`` refuses an architecture
    that does not support it. false: samples attend across documents (as Megatron's default
    and nanoGPT do)."""
    eos_id: int | None = Field(None, ge=0)
    """The token that ends each document (document masking); default the model config's
    ``eos_token_id``, the token ``wonderland tokenize`` appends."""

    @field_validator("train")
    @classmethod
    def _train_mix(cls, value: Mix) -> Mix:
        return _check_mix(value, "train")

    @field_validator("stage_train")
    @classmethod
    def _stage_mixes(cls, value: dict[str, Mix]) -> dict[str, Mix]:
        for key, mix in value.items():
            if not key.isdigit() or not 1 <= int(key) <= 18:
                raise ValueError(f"stage_train key {key!r} is not a stage number 1..18")
            _check_mix(mix, f"stage_train[{key!r}]")
        return value

    def mix_for(self, stage: int | None) -> tuple[str, Mix]:
        """(name, data) of the training data stage ``stage`` reads: its own mix
        (``stage_train.N``) when declared, else ``train``."""
        key = str(stage)
        if stage is not None and key in self.stage_train:
            return f"stage_train.{key}", self.stage_train[key]
        return "train", self.train

    @field_validator("heldout")
    @classmethod
    def _sources_have_files(cls, value: dict[str, list[str]]) -> dict[str, list[str]]:
        for name, files in value.items():
            if not files:
                raise ValueError(f"held-out source {name!r} lists no files")
        return value
