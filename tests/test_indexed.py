"""Megatron's indexed files (``.bin`` + ``.idx``), read in place and written, against
megatron-core's own ``IndexedDatasetBuilder`` and ``IndexedDataset``."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from tests.helpers import megatron
from tests.helpers.util import REPO, losses, wonderland
from wonderland_ds.cli import main as cli
from wonderland_ds.core.findings import Refused
from wonderland_ds.data import indexed
from wonderland_ds.data.tokens import TokenData, expand, open_files

mcore = megatron.indexed_dataset()

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")  # megatron-core on numpy 2
DTYPES = ["uint8", "int8", "int16", "uint16", "int32", "int64"]


def documents(n: int = 40, seed: int = 0, high: int = 100) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, high, int(rng.integers(1, 30))) for _ in range(n)]


def megatron_write(prefix, docs, dtype="int32", split=False):
    """Writes ``docs`` with megatron-core's builder; ``split``: two sequences a document."""
    builder = mcore.IndexedDatasetBuilder(f"{prefix}.bin", dtype=getattr(np, dtype))
    for d in docs:
        t = torch.from_numpy(np.asarray(d, dtype=np.int64))
        if split and len(d) > 1:
            half = len(d) // 2
            builder.add_document(t, [half, len(d) - half])
        else:
            builder.add_item(t)
            builder.end_document()
    builder.finalize(f"{prefix}.idx")


@pytest.mark.parametrize("dtype", DTYPES)
def test_megatron_core_files_read_through_their_index_in_every_dtype(tmp_path, dtype):
    docs = documents()
    megatron_write(tmp_path / "c", docs, dtype, split=True)
    (f,) = open_files([tmp_path / "c.bin"], None, "wonderland.data.train")
    assert f.dtype == dtype and f.index == tmp_path / "c.idx"
    flat = np.concatenate(docs)
    assert f.tokens == len(flat)
    data = TokenData([f], seq_len=8)
    x, y = data.take(np.arange(len(data)))
    assert x.dtype == np.int64 and (x == y).all()
    assert x.ravel().tolist() == flat[: len(data) * 8].tolist()
    index = indexed.read_index(tmp_path / "c.idx", "w")
    reader = mcore.IndexedDataset(str(tmp_path / "c"))
    assert index.documents.tolist() == reader.document_indices.tolist()
    assert index.lengths.tolist() == reader.sequence_lengths.tolist()


@pytest.mark.parametrize("dtype", ["uint16", "int32"])
def test_the_writer_writes_megatron_cores_bytes(tmp_path, dtype):
    docs = documents(300, seed=1, high=60000)
    megatron_write(tmp_path / "theirs", docs, dtype)
    with open(tmp_path / "ours.bin", "wb") as b, open(tmp_path / "lengths", "wb") as lengths:
        writer = indexed.IndexWriter(b, lengths, dtype)
        assert writer.add(docs[:100]) + writer.add(docs[100:]) == sum(map(len, docs))
    indexed.write_index(tmp_path / "ours.idx", tmp_path / "lengths", dtype)
    for suffix in (".bin", ".idx"):
        ours, theirs = (tmp_path / f"{n}{suffix}" for n in ("ours", "theirs"))
        assert ours.read_bytes() == theirs.read_bytes(), suffix
    reader = mcore.IndexedDataset(str(tmp_path / "ours"))
    assert [reader[i].tolist() for i in range(len(reader))] == [d.tolist() for d in docs]


def test_a_prefix_or_a_glob_names_the_bin_not_the_index(tmp_path):
    megatron_write(tmp_path / "a", documents(5))
    megatron_write(tmp_path / "b", documents(5, seed=2))
    assert expand([str(tmp_path / "a")], "w") == [tmp_path / "a.bin"]
    assert expand([str(tmp_path / "*")], "w") == [tmp_path / "a.bin", tmp_path / "b.bin"]


def refusal(tmp_path, dtype=None) -> str:
    with pytest.raises(Refused) as caught:
        open_files([tmp_path / "c.bin"], dtype, "wonderland.data.train")
    (finding,) = caught.value.findings
    return f"[{finding.rule}] {finding.message} | {finding.fix}"


def test_a_bad_index_is_refused_naming_what_is_wrong(tmp_path):
    megatron_write(tmp_path / "c", documents(), "int32")
    assert "data.dtype is uint16 but the index" in refusal(tmp_path, "uint16")
    assert open_files([tmp_path / "c.bin"], "int32", "w")[0].dtype == "int32"  # agreeing
    idx, good = tmp_path / "c.idx", (tmp_path / "c.idx").read_bytes()
    # The .bin lost its last token: the pair no longer belongs together.
    data = (tmp_path / "c.bin").read_bytes()
    (tmp_path / "c.bin").write_bytes(data[:-4])
    assert "[data-size]" in refusal(tmp_path) and "do not belong together" in refusal(tmp_path)
    (tmp_path / "c.bin").write_bytes(data)
    for broken, text in (
        (b"NOTANIDX\x00" + good[9:], "no MMIDIDX header"),
        (good[:9] + struct.pack("<Q", 2) + good[17:], "index version 2"),
        (good[:17] + bytes([7]) + good[18:], "dtype float32: token ids must be integers"),
        (good[:17] + bytes([42]) + good[18:], "unknown dtype code 42"),
        (good[:-8], "truncated or not written to the end"),
    ):
        idx.write_bytes(broken)
        assert text in refusal(tmp_path), text
    # A pointer that does not follow the sequence before it.
    head = indexed.HEADER
    (sequences,) = struct.unpack("<Q", good[18:26])
    at = head + 4 * sequences + 8 * 3
    idx.write_bytes(good[:at] + struct.pack("<q", 1) + good[at + 8 :])
    assert "sequence 3 starts at byte 1" in refusal(tmp_path)
    idx.write_bytes(good)
    assert open_files([tmp_path / "c.bin"], None, "w")[0].tokens == len(data) // 4


def test_the_fingerprint_sees_the_document_boundaries(tmp_path):
    docs = documents()
    megatron_write(tmp_path / "c", docs)
    before = TokenData(open_files([tmp_path / "c.bin"], None, "w"), 8).fingerprint("t")[0]
    merged = [np.concatenate(docs[:2])] + docs[2:]  # the same tokens, one boundary fewer
    megatron_write(tmp_path / "c", merged)
    after = TokenData(open_files([tmp_path / "c.bin"], None, "w"), 8).fingerprint("t")[0]
    assert after != before


def _config(tmp_path, train, dtype):
    transformers = pytest.importorskip("transformers")
    model = tmp_path / "model"
    transformers.GPT2Config(
        vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2
    ).save_pretrained(model)
    config = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    data = {"train": [str(train)], "heldout": {"web": [str(train)]}, "seq_len": 16}
    if dtype:
        data["dtype"] = dtype
    config["wonderland"] = {"task": "causal-lm", "model": {"hf": str(model)}, "data": data}
    path = tmp_path / f"config_{train.name}.json"
    path.write_text(json.dumps(config))
    return path


@pytest.mark.slow
def test_a_megatron_int32_corpus_trains_as_the_same_tokens_in_a_flat_file(tmp_path, capsys):
    """No data.dtype: megatron-core's int32 corpus trains step for step as its tokens do in a
    flat uint16 file (the same samples in the same order give the same losses)."""
    docs = documents(400, seed=3, high=64)
    megatron_write(tmp_path / "corpus", docs, "int32")
    np.concatenate(docs).astype(np.uint16).tofile(tmp_path / "flat.bin")
    runs = {}
    for name, train, dtype in (
        ("indexed", tmp_path / "corpus", None),
        ("flat", tmp_path / "flat.bin", "uint16"),
    ):
        cfg = _config(tmp_path, train, dtype)
        assert cli.main(["check", str(cfg)]) == 0, capsys.readouterr().out
        run = tmp_path / f"run_{name}"
        args = ["--config", str(cfg), "--run-dir", str(run), "--steps", "3", "--nproc", "1"]
        done = wonderland("train", "--stage", "15", *args)
        assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
        runs[name] = losses(run / "stage15")
    assert len(runs["indexed"]) == 3 and runs["indexed"] == runs["flat"], runs


def test_check_refuses_an_indexed_token_outside_the_vocabulary(tmp_path, capsys):
    megatron_write(tmp_path / "corpus", documents(50, high=100), "int32")  # ids to 99 of 64
    rc = cli.main(["check", str(_config(tmp_path, tmp_path / "corpus", None)), "--json"])
    found = {f["rule"]: f for f in json.loads(capsys.readouterr().out)}
    assert rc == 2 and "outside the model's vocabulary of 64" in found["data-vocab"]["message"]
