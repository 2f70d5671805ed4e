"""``wonderland tokenize``: raw text to Megatron's indexed files, read back with megatron-core's
``IndexedDataset``; deterministic, resumable after a real SIGKILL, and refusing bad input."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tests.helpers import megatron
from tests.helpers.lm_tasks import WORDS, tokenizer
from tests.helpers.util import snapshot
from wonderland_ds.cli import main as cli

mcore = megatron.indexed_dataset()
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")


def sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    words = WORDS[2:]
    return [" ".join(rng.choice(words, int(rng.integers(0, 12)))) for _ in range(n)]


@pytest.fixture
def corpus(tmp_path):
    """A tokenizer folder and inputs of every kind: {name: texts} in the order they are read."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    tok = tokenizer(tmp_path / "model")
    src = tmp_path / "src"
    src.mkdir()
    texts = {"a.jsonl": sentences(30, 1), "b.parquet": sentences(40, 2), "c.txt": ["the color ."]}
    with open(src / "a.jsonl", "w") as fh:
        for i, t in enumerate(texts["a.jsonl"]):
            fh.write(json.dumps({"id": i, "text": t}) + ("\n\n" if i == 3 else "\n"))
    pq.write_table(pa.table({"text": texts["b.parquet"]}), src / "b.parquet", row_group_size=7)
    (src / "c.txt").write_text(texts["c.txt"][0])
    with gzip.open(src / "d.jsonl.gz", "wt") as fh:
        texts["d.jsonl.gz"] = sentences(5, 3)
        fh.writelines(json.dumps({"text": t}) + "\n" for t in texts["d.jsonl.gz"])
    return tmp_path, tok, texts


def tokenize(tmp_path, out, *extra):
    return cli.main(
        ["tokenize", str(tmp_path / "src" / "*"), "--tokenizer", str(tmp_path / "model"),
         "--out", str(out), *extra]
    )  # fmt: skip


def test_every_document_is_the_tokenizers_ids_plus_eos(corpus, capsys):
    tmp_path, tok, texts = corpus
    assert tokenize(tmp_path, tmp_path / "out", "--batch-size", "8") == 0
    assert "76 documents" in capsys.readouterr().out
    reader = mcore.IndexedDataset(str(tmp_path / "out"))
    docs = [t for name in sorted(texts) for t in texts[name]]
    assert len(reader) == len(docs) == 76
    assert reader.index.dtype == np.uint16  # a small vocabulary
    for i, t in enumerate(docs):
        assert reader[i].tolist() == tok(t)["input_ids"] + [tok.eos_token_id], i
    assert sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("out")) == [
        "out.bin",
        "out.idx",
    ]  # no partial file or state is left
    # Deterministic: the same inputs give the same bytes, whatever the batch size.
    assert tokenize(tmp_path, tmp_path / "again", "--batch-size", "1000") == 0
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"out{suffix}").read_bytes() == (
            tmp_path / f"again{suffix}"
        ).read_bytes()


def test_a_vocabulary_over_65536_writes_int32(tmp_path, capsys):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i + 2 for i in range(70000)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(
        tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>"
    ).save_pretrained(tmp_path / "model")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "t.txt").write_text("w69999 w3 w70001")
    assert tokenize(tmp_path, tmp_path / "out") == 0
    reader = mcore.IndexedDataset(str(tmp_path / "out"))
    assert reader.index.dtype == np.int32 and reader[0].tolist() == [70001, 5, 1, 0]


def big_input(tmp_path, n):
    (tmp_path / "src").mkdir()
    tokenizer(tmp_path / "model")
    with open(tmp_path / "src" / "big.jsonl", "w") as fh:
        fh.writelines(json.dumps({"text": t}) + "\n" for t in sentences(n, 5))


def test_a_killed_run_goes_on_and_writes_the_same_bytes(tmp_path):
    big_input(tmp_path, 60000)
    out = tmp_path / "out"
    argv = [sys.executable, "-m", "wonderland_ds.cli.main", "tokenize", str(tmp_path / "src" / "*")]
    argv += ["--tokenizer", str(tmp_path / "model"), "--out", str(out), "--batch-size", "20"]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    state = tmp_path / "out.tokenize.json"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and proc.poll() is None:
        if state.exists() and json.loads(state.read_text() or "{}").get("documents", 0) >= 2000:
            break
        time.sleep(0.01)
    assert proc.poll() is None, "the run ended before it could be killed"
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL
    # Killed part-way: nothing is named complete, the partial files are ahead of the state.
    assert not (tmp_path / "out.bin").exists() and not (tmp_path / "out.idx").exists()
    written = json.loads(state.read_text())["documents"]
    assert 2000 <= written < 60000
    resumed = subprocess.run(argv, capture_output=True, text=True, timeout=120)
    assert resumed.returncode == 0, resumed.stderr
    assert f"going on from {written:,} documents" in resumed.stderr
    assert "60,000 documents" in resumed.stdout
    whole = [*argv[:-4], "--out", str(tmp_path / "whole"), "--batch-size", "500"]
    whole = subprocess.run(whole, capture_output=True)
    assert whole.returncode == 0, whole.stderr
    for suffix in (".bin", ".idx"):
        assert (tmp_path / f"out{suffix}").read_bytes() == (
            tmp_path / f"whole{suffix}"
        ).read_bytes()
    assert not state.exists() and not list(tmp_path.glob("*.partial"))


def refused(capsys, tmp_path, argv) -> str:
    before = snapshot(tmp_path)
    rc = cli.main(["tokenize", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err, err
    assert snapshot(tmp_path) == before, "a refusal wrote or deleted something"
    return err


def test_bad_input_is_refused_naming_what_and_the_fix(corpus, capsys):
    tmp_path, _, _ = corpus
    model, src = str(tmp_path / "model"), tmp_path / "src"
    out = ["--tokenizer", model, "--out", str(tmp_path / "o")]
    assert "nope.jsonl" in refused(capsys, tmp_path, [str(src / "nope.jsonl"), *out])
    (src / "x.csv").write_text("a,b")
    assert "x.csv: not a text file" in refused(capsys, tmp_path, [str(src / "x.csv"), *out])
    err = refused(capsys, tmp_path, [str(src / "a.jsonl"), *out, "--text-key", "body"])
    assert "line 1: no string under 'body' (keys: id, text)" in err and "--text-key" in err
    err = refused(capsys, tmp_path, [str(src / "b.parquet"), *out, "--text-key", "body"])
    assert "no column 'body' (columns: text)" in err
    (tmp_path / "empty").mkdir()
    err = refused(capsys, tmp_path, [str(src / "c.txt"), "--tokenizer", str(tmp_path / "empty"),
                                     "--out", str(tmp_path / "o")])  # fmt: skip
    assert "holds no tokenizer" in err
    (tmp_path / "o.bin").write_bytes(b"keep")
    assert "overwrites nothing" in refused(capsys, tmp_path, [str(src / "c.txt"), *out])
