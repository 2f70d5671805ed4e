"""Raw text to Megatron's indexed files (``PREFIX.bin`` + ``PREFIX.idx``), streaming and
resumable.

Documents are read in order (``text.py``), tokenized a batch at a time by the model's own
Hugging Face fast tokenizer (its Rust ``encode_batch``, on every core), each followed by EOS,
and appended to ``PREFIX.bin.partial`` with their lengths in ``PREFIX.lengths.partial``.
After each batch both are fsynced and ``PREFIX.tokenize.json`` records how far they are good,
so a killed run, started again with the same command, truncates them to that point and goes
on. Only when every document is in are the ``.idx`` and then the ``.bin`` renamed into place:
no half-written pair is ever named complete. The same inputs give the same bytes.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import BaseModel, ConfigDict, ValidationError

from wonderland_ds.core.files import atomic_write_text, disk_error, fsync_dir
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.data import indexed, text
from wonderland_ds.data.tokens import expand

FORMAT = "wonderland-tokenize/1"
BATCH_CHARS = 2_000_000
"""A batch ends at this much text too, so long documents keep memory bounded."""


class InputFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    size: int
    mtime_ns: int


class TokenizeState(BaseModel):
    """``PREFIX.tokenize.json``: what a run is making and how far its partial files are good."""

    model_config = ConfigDict(extra="forbid")
    format: str = FORMAT
    inputs: list[InputFile]
    tokenizer: str
    """sha256 of the tokenizer's files."""
    text_key: str
    dtype: str
    file: int = 0
    """The input being read; ``len(inputs)`` once all are in."""
    in_file: int = 0
    """Its documents already written."""
    documents: int = 0
    tokens: int = 0
    text_bytes: int = 0


def _paths(prefix: Path) -> dict[str, Path]:
    return {
        "bin": Path(f"{prefix}.bin"),
        "idx": Path(f"{prefix}.idx"),
        "bin_partial": Path(f"{prefix}.bin.partial"),
        "lengths": Path(f"{prefix}.lengths.partial"),
        "idx_partial": Path(f"{prefix}.idx.partial"),
        "state": Path(f"{prefix}.tokenize.json"),
    }


def load_tokenizer(folder: str) -> Any:
    """The model's fast tokenizer, or a refusal: no tokenizer there, a slow one, no EOS."""
    where = "--tokenizer"
    path = Path(folder).expanduser()
    if not path.is_dir():
        raise Refused(
            Finding(
                "tokenizer",
                "error",
                f"{folder} is not a folder",
                "give the model's folder (a save_pretrained folder with its tokenizer)",
                folder,
                where,
            )
        )
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(path))
    except (OSError, ValueError, TypeError) as exc:
        raise Refused(
            Finding(
                "tokenizer",
                "error",
                f"{folder} holds no tokenizer transformers can load ({type(exc).__name__}:"
                f" {str(exc).splitlines()[0][:200]})",
                "save the model's tokenizer there (tokenizer.save_pretrained(folder))",
                folder,
                where,
            )
        ) from None
    if not tok.is_fast:
        raise Refused(
            Finding(
                "tokenizer",
                "error",
                f"{folder}'s tokenizer is a slow (Python) one",
                "save the fast one (tokenizer.json): AutoTokenizer.from_pretrained(folder,"
                " use_fast=True).save_pretrained(folder)",
                folder,
                where,
            )
        )
    if tok.eos_token_id is None:
        raise Refused(
            Finding(
                "tokenizer",
                "error",
                f"{folder}'s tokenizer has no EOS token to end each document with",
                "set eos_token in its tokenizer_config.json",
                folder,
                where,
            )
        )
    return tok


def _tokenizer_sha(folder: str) -> str:
    h = hashlib.sha256()
    for p in sorted(Path(folder).expanduser().iterdir()):
        if p.is_file() and ("token" in p.name or p.name == "special_tokens_map.json"):
            h.update(p.name.encode() + b"\0" + p.read_bytes())
    return h.hexdigest()


def dtype_for(vocab: int) -> str:
    """uint16 while every id fits, else int32 (as megatron-core's ``DType.optimal_dtype``)."""
    return "uint16" if vocab <= 65536 else "int32"


def _inputs(patterns: list[str], key: str) -> list[InputFile]:
    """The inputs, each opened and its first document read (a wrong format or key is refused
    before anything is written)."""
    files = expand(patterns, text.WHERE)
    for p in files:
        text.kind(p)
    for p in files:
        next(text.documents(p, key), None)
    out = []
    for p in files:
        st = p.stat()
        out.append(InputFile(path=str(p.resolve()), size=st.st_size, mtime_ns=st.st_mtime_ns))
    return out


def _batches(
    state: TokenizeState, key: str, size: int
) -> Iterator[tuple[int, int, bool, list[str]]]:
    """(input index, its documents read after this batch, whether it is finished, the batch)
    from where ``state`` is."""
    for f in range(state.file, len(state.inputs)):
        done = state.in_file if f == state.file else 0
        batch: list[str] = []
        chars = 0
        for doc in text.documents(Path(state.inputs[f].path), key, done):
            batch.append(doc)
            chars += len(doc)
            if len(batch) == size or chars >= BATCH_CHARS:
                done += len(batch)
                yield f, done, False, batch
                batch, chars = [], 0
        yield f, done + len(batch), True, batch


def _resume(paths: dict[str, Path], fresh: TokenizeState) -> TokenizeState:
    """The state to go on from: the recorded one when it is for the same inputs, tokenizer,
    key and dtype, with the partial files cut back to it; else a refusal."""
    try:
        old = TokenizeState.model_validate_json(paths["state"].read_text())
    except (ValidationError, ValueError) as exc:
        raise Refused(
            Finding(
                "tokenize-state",
                "error",
                f"{paths['state']} is not a tokenize state this version writes ({exc})",
                f"delete {paths['state'].name} and the .partial files beside it to start over",
                str(paths["state"]),
                "--out",
            )
        ) from None
    same = ("inputs", "tokenizer", "text_key", "dtype")
    changed = [k for k in same if getattr(old, k) != getattr(fresh, k)]
    if changed:
        raise Refused(
            Finding(
                "tokenize-state",
                "error",
                f"a tokenize to this --out stopped part-way with other {', '.join(changed)}"
                f" ({paths['state']})",
                "run the same command as before to finish it, or delete"
                f" {paths['state'].name} and the .partial files beside it to start over",
                str(paths["state"]),
                "--out",
            )
        )
    item = np.dtype(old.dtype).itemsize
    for path, size in (
        (paths["bin_partial"], old.tokens * item),
        (paths["lengths"], 4 * old.documents),
    ):
        if not path.exists() or path.stat().st_size < size:
            raise Refused(
                Finding(
                    "tokenize-state",
                    "error",
                    f"{path} is shorter than {paths['state'].name} records: the partial files"
                    " were changed or removed",
                    f"delete {paths['state'].name} and the .partial files beside it to start over",
                    str(path),
                    "--out",
                )
            )
        os.truncate(path, size)  # drop what was written after the last recorded batch
    return old


def run(
    inputs: list[str],
    tokenizer: str,
    out: str,
    text_key: str = "text",
    batch_size: int = 1000,
    progress: bool | None = None,
) -> TokenizeState:
    """Tokenizes ``inputs`` into ``out``.bin/.idx (resuming a stopped run to the same
    ``out``); returns the final state. ``progress``: a bar on stderr (None: on a terminal)."""
    prefix = Path(out).expanduser()
    paths = _paths(prefix)
    # A .idx beside the state and the partial .bin: a run stopped between its two renames.
    renaming = paths["state"].exists() and paths["bin_partial"].exists()
    for name in ("bin", "idx"):
        if paths[name].exists() and not (name == "idx" and renaming):
            raise Refused(
                Finding(
                    "tokenize-exists",
                    "error",
                    f"{paths[name]} exists: tokenize writes a new pair and overwrites nothing",
                    "choose another --out, or delete the old .bin and .idx first",
                    str(paths[name]),
                    "--out",
                )
            )
    if not prefix.parent.is_dir():
        raise Refused(
            Finding(
                "tokenize-out",
                "error",
                f"{prefix.parent} is not a folder",
                "create it, or give --out in an existing folder",
                str(prefix),
                "--out",
            )
        )
    files = _inputs(inputs, text_key)
    tok = load_tokenizer(tokenizer)
    fresh = TokenizeState(
        inputs=files,
        tokenizer=_tokenizer_sha(tokenizer),
        text_key=text_key,
        dtype=dtype_for(len(tok)),
    )
    resumed = paths["state"].exists()
    state = _resume(paths, fresh) if resumed else fresh
    if resumed:
        print(
            f"tokenize: going on from {state.documents:,} documents ({state.tokens:,} tokens)"
            f" already in {paths['bin_partial'].name}",
            file=sys.stderr,
        )
    else:
        for name in ("bin_partial", "lengths"):
            paths[name].write_bytes(b"")
        atomic_write_text(paths["state"], state.model_dump_json(indent=2))
    try:
        try:
            _tokenize(tok, state, paths, text_key, batch_size, progress)
        except Refused:  # a bad record further in: the input must change, so nothing resumes
            for name in ("bin_partial", "lengths", "state"):
                paths[name].unlink(missing_ok=True)
            raise
        if not paths["idx"].exists():
            indexed.write_index(paths["idx_partial"], paths["lengths"], state.dtype)
            os.replace(paths["idx_partial"], paths["idx"])  # the .idx first: a .bin alone
        os.replace(paths["bin_partial"], paths["bin"])  # would read as a flat file
        fsync_dir(prefix.parent)
    except OSError as exc:
        if not disk_error(exc):
            raise
        raise Refused(
            Finding(
                "tokenize-disk",
                "error",
                f"writing {prefix}.* failed: {exc.strerror}; {state.documents:,} documents are"
                " kept in the .partial files",
                "free space (or give --out on a larger disk), then run the same command to go on",
                str(prefix),
                "--out",
            )
        ) from None
    paths["lengths"].unlink()
    paths["state"].unlink()
    return state


def _tokenize(
    tok: Any,
    state: TokenizeState,
    paths: dict[str, Path],
    key: str,
    batch_size: int,
    progress: bool | None,
) -> None:
    from tqdm import tqdm

    backend, eos = tok.backend_tokenizer, np.array([tok.eos_token_id])
    bar = tqdm(
        initial=state.documents,
        unit=" docs",
        desc="tokenize",
        disable=None if progress is None else not progress,
        file=sys.stderr,
    )
    t0, bytes0 = time.perf_counter(), state.text_bytes
    with open(paths["bin_partial"], "ab") as b, open(paths["lengths"], "ab") as lengths:
        writer = indexed.IndexWriter(b, lengths, state.dtype)
        for f, done, last, batch in _batches(state, key, batch_size):
            encodings = backend.encode_batch_fast(batch) if batch else []
            state.tokens += writer.add([np.concatenate([e.ids, eos]) for e in encodings])
            for fh in (b, lengths):
                fh.flush()
                os.fsync(fh.fileno())
            read = sum(len(t.encode("utf-8")) for t in batch)
            state.documents += len(batch)
            state.text_bytes += read
            state.file, state.in_file = (f + 1, 0) if last else (f, done)
            atomic_write_text(paths["state"], state.model_dump_json(indent=2))
            bar.update(len(batch))
            seconds = max(time.perf_counter() - t0, 1e-9)
            bar.set_postfix_str(
                f"{state.documents:,} docs, {state.tokens:,} tokens,"
                f" {(state.text_bytes - bytes0) / seconds / 1e6:.1f} MB/s",
                refresh=False,
            )
    bar.close()
