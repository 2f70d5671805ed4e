"""Raw text in, two weighted sources out, and another mix for stage 16: the worked example of
docs/models-and-data.md.

    python examples/data_mix/prepare.py --out runs/mix

What it writes under ``--out``:

* ``model/``: a tiny GPT-2 ``config.json`` and a BPE tokenizer trained on the text, as
  ``save_pretrained`` writes them (EOS ``<|endoftext|>``).
* ``raw/story_00.jsonl``, ``raw/story_01.jsonl``, ``raw/sums_00.jsonl`` and the held-out
  ``raw/heldout_story.jsonl``, ``raw/heldout_sums.jsonl``: one ``{"text": ...}`` document a
  line, for ``wonderland tokenize`` to turn into ``data/story``, ``data/sums``... (Megatron's
  ``.bin`` plus ``.idx``).
* ``config.json``: ``ds_configs/cpu_zero2_fp32.json``'s DeepSpeed settings with the
  ``causal-lm`` task on two sources, ``story`` 0.8 and ``sums`` 0.2, stage 16 annealing on
  ``sums`` 0.7 and ``story`` 0.3, and document masking on.

Needs ``transformers`` (``pip install 'wonderland_ds[hf]'``).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = (
    "the a cat dog bird fish tree river stone house road ship king queen child wind rain sun"
    " moon runs sleeps sings sees finds takes holds builds crosses follows near under over"
).split()


def story(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(6, 16))) + "."


def sums(rng: random.Random) -> str:
    a, b = rng.randint(0, 99), rng.randint(0, 99)
    return f"{a} plus {b} is {a + b}."


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder to write the model, text and config")
    ap.add_argument("--steps", type=int, default=40, help="stage 15 steps (stage 16: half)")
    args = ap.parse_args(argv)

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import GPT2Config, PreTrainedTokenizerFast

    out = Path(args.out).resolve()
    for sub in ("model", "raw", "data"):
        (out / sub).mkdir(parents=True, exist_ok=True)
    files = {
        "story_00": [story] * 3000,
        "story_01": [story] * 3000,
        "sums_00": [sums] * 3000,
        "heldout_story": [story] * 200,
        "heldout_sums": [sums] * 200,
    }
    texts = {}
    for i, (name, makers) in enumerate(files.items()):
        rng = random.Random(i)
        texts[name] = [make(rng) for make in makers]
        with open(out / "raw" / f"{name}.jsonl", "w") as fh:
            fh.writelines(json.dumps({"text": t}) + "\n" for t in texts[name])

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<unk>"])
    tok.train_from_iterator(texts["story_00"] + texts["sums_00"], trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", unk_token="<unk>"
    )
    fast.save_pretrained(out / "model")
    eos = fast.eos_token_id
    GPT2Config(
        vocab_size=len(fast), n_positions=64, n_embd=64, n_layer=2, n_head=4,
        bos_token_id=eos, eos_token_id=eos,
    ).save_pretrained(out / "model")  # fmt: skip

    repo = Path(__file__).resolve().parents[2]
    config = json.loads((repo / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    config["train_micro_batch_size_per_gpu"] = 8
    config["gradient_accumulation_steps"] = 2
    config["scheduler"]["params"].update(
        warmup_num_steps=args.steps, total_num_steps=4 * args.steps
    )
    data = out / "data"
    config["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(out / "model")},
        "data": {
            "train": {
                "story": {"files": [str(data / "story")], "weight": 0.8},
                "sums": {"files": [str(data / "sums")], "weight": 0.2},
            },
            "stage_train": {
                "16": {
                    "sums": {"files": [str(data / "sums")], "weight": 0.7},
                    "story": {"files": [str(data / "story")], "weight": 0.3},
                }
            },
            "heldout": {
                "story": [str(data / "heldout_story")],
                "sums": [str(data / "heldout_sums")],
            },
            "seq_len": 64,
            "document_masking": True,
        },
        "seed": 1234,
        "stage_train_steps": {"15": args.steps, "16": max(1, args.steps // 2)},
        "save_interval": args.steps,
        "min_warmup_steps": args.steps,
        "log_interval": 10,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    print(f"wrote {out}/model, {out}/raw ({len(files)} jsonl files), {out}/config.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
