"""Write a tiny GPT-2 model directory, a tokenizer and a generated token corpus, plus a
wonderland config that trains it: the shape of a real team's setup, small enough for a CPU.

    python examples/hf_causal_lm/prepare.py --out runs/hf_example
    wonderland pipeline --from 15 --to 18 --config runs/hf_example/config.json \\
        --hostfile hostfiles/localhost --run-dir runs/hf_example/run

What it writes under ``--out``:

* ``model/``: ``config.json`` (GPT-2, 2 layers, 64 wide) and a BPE tokenizer trained on the
  corpus (``tokenizer.json`` and friends), as ``save_pretrained`` writes them.
* ``data/train_00.bin``, ``data/train_01.bin``: the training tokens, flat uint16 (nanoGPT's
  format), in two shards; ``data/heldout_story.bin``, ``data/heldout_sums.bin``: two held-out
  sources with their own loss and gate in stage 17.
* ``config.json``: ``ds_configs/cpu_zero2_bf16_pylm.json``'s DeepSpeed settings with the
  ``causal-lm`` task pointing at the files above (absolute paths).

Needs ``transformers`` (``pip install 'wonderland_ds[hf]'``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

import numpy as np

WORDS = (
    "the a cat dog bird fish tree river stone house road ship king queen child wind rain sun"
    " moon runs sleeps sings sees finds takes holds builds crosses follows near under over"
    " behind quickly slowly quietly old young small great green red dark bright"
).split()


_TABLE: dict[str, list[str]] = {}


def story(rng: random.Random) -> str:
    """Sentences from one fixed bigram table (seeded once): learnable structure, not noise."""
    if not _TABLE:
        table_rng = random.Random(7)
        _TABLE.update({w: table_rng.sample(WORDS, 4) for w in WORDS})
    out, word = [], rng.choice(WORDS)
    for _ in range(rng.randint(8, 20)):
        out.append(word)
        word = rng.choice(_TABLE[word])
    return " ".join(out) + "."


def sums(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a} plus {b} is {a + b}."


def corpus(kind: str, lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    make = story if kind == "story" else sums
    return [make(rng) for _ in range(lines)]


def write_tokens(path: Path, ids: list[int]) -> None:
    arr = np.asarray(ids, dtype=np.uint16)  # vocabulary < 65,536: two bytes a token
    arr.tofile(path)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write the model, data and config")
    ap.add_argument("--train-lines", type=int, default=6000, help="training lines per shard")
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=30, help="stage 15 steps (stage 16: half)")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    out = Path(args.out).resolve()
    (out / "model").mkdir(parents=True, exist_ok=True)
    (out / "data").mkdir(parents=True, exist_ok=True)
    texts = {
        "train_00": corpus("story", args.train_lines, 1) + corpus("sums", args.train_lines // 2, 2),
        "train_01": corpus("story", args.train_lines, 3) + corpus("sums", args.train_lines // 2, 4),
        "heldout_story": corpus("story", 300, 5),
        "heldout_sums": corpus("sums", 300, 6),
    }
    random.Random(0).shuffle(texts["train_00"])
    random.Random(1).shuffle(texts["train_01"])

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<|endoftext|>", "<unk>"])
    tok.train_from_iterator(texts["train_00"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.save_pretrained(out / "model")
    eos = fast.convert_tokens_to_ids("<|endoftext|>")
    for name, lines in texts.items():
        ids: list[int] = []
        for line in lines:
            ids += fast.encode(line) + [eos]
        write_tokens(out / "data" / f"{name}.bin", ids)

    GPT2Config(
        vocab_size=len(fast),
        n_positions=args.seq_len,
        n_embd=64,
        n_layer=2,
        n_head=4,
        bos_token_id=eos,
        eos_token_id=eos,
    ).save_pretrained(out / "model")

    repo = Path(__file__).resolve().parents[2]
    config = json.loads((repo / "ds_configs" / "cpu_zero2_bf16_pylm.json").read_text())
    config["scheduler"]["params"].update(
        warmup_num_steps=args.steps, total_num_steps=4 * args.steps
    )
    config["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(out / "model"), "init": "config"},
        "data": {
            "train": [str(out / "data" / "train_*.bin")],
            "heldout": {
                "story": [str(out / "data" / "heldout_story.bin")],
                "sums": [str(out / "data" / "heldout_sums.bin")],
            },
            "dtype": "uint16",
            "seq_len": args.seq_len,
        },
        "seed": 1234,
        "stage_train_steps": {"15": args.steps, "16": max(1, args.steps // 2)},
        "save_interval": max(1, args.steps // 2),
        "keep_last": 2,
        "min_warmup_steps": args.steps,
        "process_group_timeout_s": 120,
        "log_interval": 10,
        "eval": {"lm_loss_rise": 0.10},
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    tokens = sum((out / "data" / f"{n}.bin").stat().st_size // 2 for n in texts)
    print(f"wrote {out}/model, {tokens} tokens in {out}/data, {out}/config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
