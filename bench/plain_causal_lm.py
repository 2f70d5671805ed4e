"""The plain DeepSpeed loop the causal-LM benchmark compares against: what a team writes by
hand (nanoGPT's batches from a memory-mapped token file, the ``transformers`` model's own
loss, forward/backward/step, the loss read once a step as every loop logs it); under ZeRO-3 the
model is built inside ``zero.Init`` through ``HfDeepSpeedConfig``. Per rank:

    OMP_NUM_THREADS=1 deepspeed --num_gpus 2 --no_ssh_check --master_addr 127.0.0.1 \\
        bench/plain_causal_lm.py --config CONFIG --steps 40 --out R.json
"""

from __future__ import annotations

import argparse
import json
import os
import time

import deepspeed
import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", required=True, help="a causal-lm wonderland config")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True)
    ap.add_argument("--local_rank", type=int, default=0)
    ap.add_argument("--grad-ckpt", action="store_true", help="non-reentrant gradient checkpointing")
    args = ap.parse_args()
    raw = json.loads(open(args.config).read())
    wl = raw.pop("wonderland")
    deepspeed.init_distributed()
    world, rank = torch.distributed.get_world_size(), torch.distributed.get_rank()
    micro, gas = raw["train_micro_batch_size_per_gpu"], raw["gradient_accumulation_steps"]
    raw["train_batch_size"] = micro * gas * world
    torch.manual_seed(wl.get("seed", 1234))
    keep = None
    if raw.get("zero_optimization", {}).get("stage") == 3:  # built inside zero.Init
        from transformers.integrations import HfDeepSpeedConfig

        keep = HfDeepSpeedConfig(raw)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(wl["model"]["hf"]))
    model.config.use_cache = False
    if args.grad_ckpt:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=raw)
    (path,) = wl["data"]["train"]
    data = np.memmap(path, dtype=wl["data"]["dtype"], mode="r")
    length = wl["data"]["seq_len"]
    rng = np.random.default_rng(rank)
    walls = []
    for _ in range(args.steps):
        for _ in range(gas):
            starts = rng.integers(0, len(data) - length, micro)
            x = torch.from_numpy(np.stack([data[s : s + length] for s in starts]).astype(np.int64))
            x = x.to(engine.device)
            out = engine(input_ids=x, attention_mask=torch.ones_like(x), labels=x)
            engine.backward(out.loss)
            engine.step()
        out.loss.item()
        walls.append(time.time())
    if rank == 0:
        with open(args.out, "w") as fh:
            json.dump({"walls": walls, "world": world}, fh)
    torch.distributed.barrier()
    del keep
    os._exit(0)  # as train.py leaves: no gloo teardown races at interpreter exit


if __name__ == "__main__":
    main()
