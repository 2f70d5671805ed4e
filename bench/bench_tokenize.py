"""``wonderland tokenize`` against the plain way: the fast tokenizer's batched
``encode_batch`` over all texts at once, then one write.

The text is real: the Python sources, docs and license texts installed in this environment
(``--mb`` megabytes of them, one document a file, as jsonl), and the tokenizer a byte-level BPE
of 32,000 ids trained on the first few megabytes of it with ``tokenizers`` and saved as a
``transformers`` fast tokenizer. Each side runs as its own process, from the start of the
process to its exit (both load the tokenizer through ``transformers``), the two alternating
``--reps`` times; peak memory is each process's ``ru_maxrss``. The two ``.bin`` files must be
the same bytes (every document's ids plus EOS).

    python bench/bench_tokenize.py --out R.json                 # 40 MB, ~3 min on 2 cores
    python bench/bench_tokenize.py --mb 2 --reps 1 --out R.json # the smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

PLAIN = r"""
import json, sys
import numpy as np
from transformers import AutoTokenizer
tok = AutoTokenizer.from_pretrained(sys.argv[1])
with open(sys.argv[2]) as fh:
    texts = [json.loads(line)["text"] for line in fh]
enc = tok.backend_tokenizer.encode_batch_fast(texts)
eos = tok.eos_token_id
ids = np.concatenate([np.array(e.ids + [eos], dtype=np.uint16) for e in enc])
ids.tofile(sys.argv[3])
"""


def corpus(path: Path, mb: float) -> int:
    """Writes ``mb`` MB of installed text files as jsonl (one document a file)."""
    root = Path(sysconfig.get_paths()["purelib"])
    budget, written = int(mb * 1e6), 0
    with open(path, "w") as fh:
        for p in sorted(root.rglob("*")):
            if p.suffix not in (".py", ".md", ".rst", ".txt") or not p.is_file():
                continue
            try:
                text = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
            if not text.strip():
                continue
            fh.write(json.dumps({"text": text}) + "\n")
            written += len(text.encode())
            if written >= budget:
                break
    return written


def train_tokenizer(texts_path: Path, folder: Path, sample_mb: float = 4) -> None:
    from tokenizers import ByteLevelBPETokenizer
    from transformers import PreTrainedTokenizerFast

    texts, size = [], 0
    with open(texts_path) as fh:
        for line in fh:
            texts.append(json.loads(line)["text"])
            size += len(texts[-1])
            if size > sample_mb * 1e6:
                break
    bpe = ByteLevelBPETokenizer()
    bpe.train_from_iterator(texts, vocab_size=32000, special_tokens=["<|endoftext|>"])
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>").save_pretrained(folder)


def timed(argv: list[str]) -> tuple[float, float]:
    """(wall seconds, peak RSS MiB) of one process."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    _, status, usage = os.wait4(proc.pid, 0)
    seconds = time.perf_counter() - t0
    if status != 0:
        sys.exit(f"{argv[:4]} failed: {proc.stderr.read().decode()[-2000:] if proc.stderr else ''}")
    return seconds, usage.ru_maxrss / 1024


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=40)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        text_bytes = corpus(work / "corpus.jsonl", args.mb)
        train_tokenizer(work / "corpus.jsonl", work / "tok")
        samples: dict[str, list[tuple[float, float]]] = {"tokenize": [], "plain": []}
        for rep in range(args.reps):
            ours = work / f"ours{rep}"
            samples["tokenize"].append(
                timed(
                    [
                        sys.executable,
                        "-m",
                        "wonderland_ds.cli.main",
                        "tokenize",
                        str(work / "corpus.jsonl"),
                        "--tokenizer",
                        str(work / "tok"),
                        "--out",
                        str(ours),
                    ]
                )  # fmt: skip
            )
            plain = work / f"plain{rep}.bin"
            samples["plain"].append(
                timed(
                    [
                        sys.executable,
                        "-c",
                        PLAIN,
                        str(work / "tok"),
                        str(work / "corpus.jsonl"),
                        str(plain),
                    ]
                )  # fmt: skip
            )
            same = Path(f"{ours}.bin").read_bytes() == plain.read_bytes()
            if not same:
                sys.exit("tokenize's .bin differs from the plain way's tokens")
            tokens = plain.stat().st_size // 2
            for p in (Path(f"{ours}.bin"), Path(f"{ours}.idx"), plain):
                p.unlink()
    wall = {k: statistics.median(s for s, _ in v) for k, v in samples.items()}
    peak = {k: max(m for _, m in v) for k, v in samples.items()}
    result = {
        "text_mb": round(text_bytes / 1e6, 1),
        "tokens": tokens,
        "wall_s": {k: round(v, 2) for k, v in wall.items()},
        "peak_rss_mib": {k: round(v, 1) for k, v in peak.items()},
        "time_ratio": round(wall["tokenize"] / wall["plain"], 3),
        "memory_ratio": round(peak["tokenize"] / peak["plain"], 3),
        "same_bytes": True,
        "samples": samples,
        "cores": os.cpu_count(),
    }
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))


if __name__ == "__main__":
    main()
