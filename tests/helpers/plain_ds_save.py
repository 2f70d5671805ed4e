"""A plain DeepSpeed script (no wonderland): trains a few steps and saves a checkpoint the
way teams outside this project do. Used to test `wonderland inspect` on foreign checkpoints.

    RANK=0 WORLD_SIZE=1 LOCAL_RANK=0 MASTER_ADDR=127.0.0.1 MASTER_PORT=29599 \
        python tests/helpers/plain_ds_save.py OUT_DIR [--no-scheduler]
"""

import sys

import deepspeed
import torch
from torch import nn

out = sys.argv[1]
config = {
    "train_micro_batch_size_per_gpu": 4,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": 2},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
}
if "--no-scheduler" not in sys.argv:
    config["scheduler"] = {"type": "WarmupLR", "params": {"warmup_num_steps": 10}}
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2))
engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
for _ in range(3):
    loss = engine(torch.randn(4, 8)).pow(2).mean()
    engine.backward(loss)
    engine.step()
engine.save_checkpoint(out)
