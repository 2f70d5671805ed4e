"""A language model that learns facts, and lm-eval tasks that ask for them, all written here.

Made-up names (sixteen in the tests, up to 528 in the benchmark) each have a colour ("the color of alba is gold ."). The training corpus
repeats the true facts; the "unlearning" corpus states every name with the next colour, so a
stage 16 trained on it forgets the task. The model is a tiny Llama with a word-level tokenizer
saved beside it; the lm-eval tasks are YAML files over one jsonl file:

* ``colors_mc``: multiple choice among the four colours (acc, acc_norm);
* ``colors_gen``: greedy generation until ".", the first word taken (exact_match). Its even
  documents ask for a colour (the answer and "." come in 2 tokens), its odd ones for a name
  ("the color of" -> "NAME is COLOR", 4 tokens): lm-eval deals document i to rank i % 2, so
  on 2 ranks one rank generates twice as long as the other, every time;
* ``colors_ppl``: rolling log-likelihood of each fact (word/byte perplexity, bits per byte);
* ``colors``: a group of ``colors_mc`` and ``colors_gen``.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np

from tests.helpers.util import REPO

NAMES = "alba brin cato dara eno fia gus hale iva jon kip lumo mira nox oda pim".split()
NAMES += [f"{a}{b}" for a in ("ka", "lo", "mu", "ri", "se", "to", "vi", "ze") for b in range(64)]
COLORS = ["red", "blue", "green", "gold"]
TRUTH = {n: COLORS[(i * 7 + i // 4) % 4] for i, n in enumerate(NAMES)}
SHIFTED = {n: COLORS[(COLORS.index(c) + 1) % 4] for n, c in TRUTH.items()}
WORDS = ["<eos>", "<unk>", "the", "color", "of", "is", ".", *NAMES, *COLORS]

TASKS = {
    "colors_mc": """
output_type: multiple_choice
doc_to_text: "the color of {{name}} is"
doc_to_choice: "{{choices}}"
doc_to_target: label
metric_list:
  - metric: acc
  - metric: acc_norm
""",
    "colors_gen": """
output_type: generate_until
doc_to_text: "{{prompt}}"
doc_to_target: answer
generation_kwargs:
  until: ["."]
  max_gen_toks: 4
  do_sample: false
filter_list:
  - name: first_word
    filter:
      - function: regex
        regex_pattern: "(\\\\w+)"
      - function: take_first
metric_list:
  - metric: exact_match
""",
    "colors_ppl": """
output_type: loglikelihood_rolling
doc_to_text: ""
doc_to_target: "{{text}}"
metric_list:
  - metric: word_perplexity
  - metric: byte_perplexity
  - metric: bits_per_byte
""",
}
GROUP = """group: colors
task:
  - colors_mc
  - colors_gen
aggregate_metric_list:
  - metric: acc
    weight_by_size: true
"""


def fact(name: str, color: str) -> str:
    return f"the color of {name} is {color} ."


def tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    fast.save_pretrained(folder)
    return fast


def model_dir(folder: Path, with_tokenizer: bool = True, hidden: int = 64, layers: int = 2) -> Path:
    from transformers import LlamaConfig

    folder.mkdir(parents=True, exist_ok=True)
    if with_tokenizer:
        tokenizer(folder)
    LlamaConfig(
        vocab_size=len(WORDS),
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        tie_word_embeddings=False,
    ).save_pretrained(folder)
    return folder


def corpus(path: Path, facts: dict[str, str], repeats: int, seed: int) -> Path:
    """The facts, each followed by EOS, shuffled ``repeats`` times, as flat uint16 tokens."""
    fast = tokenizer(path.parent / ".tok")
    rng = random.Random(seed)
    ids: list[int] = []
    for _ in range(repeats):
        order = list(facts.items())
        rng.shuffle(order)
        for name, color in order:
            ids += fast.encode(fact(name, color)) + [fast.eos_token_id]
    np.asarray(ids, dtype=np.uint16).tofile(path)
    return path


def task_folder(folder: Path, docs: int = len(NAMES)) -> Path:
    """The task YAMLs and their jsonl, ``docs`` documents."""
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / "colors.jsonl"
    with data.open("w") as fh:
        for name in NAMES[:docs]:
            color = TRUTH[name]
            row = {
                "name": name,
                "choices": COLORS,
                "label": COLORS.index(color),
                "answer": color,
                "text": fact(name, color),
            }
            fh.write(json.dumps(row) + "\n")
    gen = folder / "gen.jsonl"
    with gen.open("w") as fh:
        for i, name in enumerate(NAMES[:docs]):
            ask = {"prompt": f"the color of {name} is", "answer": TRUTH[name]}
            fh.write(json.dumps(ask if i % 2 == 0 else {"prompt": "the color of", "answer": name}))
            fh.write("\n")
    for name, body in TASKS.items():
        file = gen if name == "colors_gen" else data
        head = f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {file}\n"
        text = f"task: {name}\n{head}test_split: test\n{body.lstrip()}"
        (folder / f"{name}.yaml").write_text(text)
    (folder / "colors_group.yaml").write_text(GROUP)
    return folder


def config(
    tmp: Path, tasks: list[str], zero: int = 3, train: str = "train.bin", **eval_extra
) -> Path:
    """A ZeRO-``zero`` fp32 config on 2 ranks training the model on ``tmp/train``, scoring
    ``tasks`` in stage 17. Every parameter is partitioned under ZeRO-3 (no persistence
    threshold), so each forward pass gathers collectively."""
    body = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    body["train_micro_batch_size_per_gpu"] = 4
    body["gradient_accumulation_steps"] = 2
    body["zero_optimization"] = {"stage": zero}
    if zero == 3:
        body["zero_optimization"]["stage3_param_persistence_threshold"] = 0
    body["optimizer"]["params"]["lr"] = 0.01
    body["scheduler"]["params"].update(warmup_max_lr=0.01, warmup_num_steps=20, total_num_steps=400)
    body["wonderland"] = {
        "task": "causal-lm",
        "model": {"hf": str(tmp / "model")},
        "data": {
            "train": [str(tmp / train)],
            "heldout": {"facts": [str(tmp / "held.bin")]},
            "dtype": "uint16",
            "seq_len": 32,
        },
        "seed": 5,
        "stage_train_steps": {"15": 120, "16": 30},
        "save_interval": 200,
        "keep_last": 1,
        "min_warmup_steps": 20,
        "process_group_timeout_s": 120,
        "log_interval": 50,
        "eval": {
            "tasks": tasks,
            "include_path": str(tmp / "tasks"),
            "batch_size": 4,
            **eval_extra,
        },
    }
    path = tmp / f"config_{Path(train).stem}.json"
    path.write_text(json.dumps(body, indent=2))
    return path


def setup(
    tmp: Path, tasks: list[str], docs: int = 16, hidden: int = 64, layers: int = 2, **kw
) -> Path:
    """Model, corpora, tasks about the first ``docs`` names and the config in ``tmp``;
    returns the config."""
    model_dir(tmp / "model", hidden=hidden, layers=layers)
    names = NAMES[:docs]
    corpus(tmp / "train.bin", {n: TRUTH[n] for n in names}, 120, 1)
    corpus(tmp / "unlearn.bin", {n: SHIFTED[n] for n in names}, 120, 2)
    corpus(tmp / "held.bin", {n: TRUTH[n] for n in names}, 4, 3)
    task_folder(tmp / "tasks", docs)
    return config(tmp, tasks, **kw)
