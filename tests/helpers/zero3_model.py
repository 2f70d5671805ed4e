"""One rank of a model-room check, launched by torchrun on gloo: builds the causal-LM model
as a stage does (``wonderland_ds.model.construct``) under the given ZeRO stage, records how
it is held (partitioned or whole, this rank's peak anonymous memory), trains a few steps on
a fixed batch and writes ``OUT/rankR.json``.

    torchrun --nproc_per_node 2 tests/helpers/zero3_model.py SPEC.json OUT
SPEC: {"hf": DIR, "init": "weights", "zero": 3, "steps": 3, "tokens": [[...] per rank]
or null (the same batch on every rank), "seq": 32, "model": {HFModel levers}}
"""

import json
import os
import sys
import threading
import time
from pathlib import Path

import deepspeed
import torch

from wonderland_ds.config.settings import HFModel
from wonderland_ds.core.process import status_mb
from wonderland_ds.model import construct


def anon_kb() -> int:
    return int(1024 * (status_mb("RssAnon") or 0))


class Peak(threading.Thread):
    """This process's peak anonymous memory, sampled every 2 ms (the kernel keeps no peak of it)."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.peak, self.running = anon_kb(), True
        self.start()

    def run(self) -> None:
        while self.running:
            self.peak = max(self.peak, anon_kb())
            time.sleep(0.002)

    def take(self) -> int:
        time.sleep(0.01)
        value, self.peak = self.peak, anon_kb()
        return value


spec = json.loads(Path(sys.argv[1]).read_text())
out = Path(sys.argv[2])
deepspeed.init_distributed(dist_backend="gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
ds = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "zero_optimization": {"stage": spec["zero"], "stage3_param_persistence_threshold": 0},
    "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
    "steps_per_print": 10**9,
}
model_spec = HFModel(hf=spec["hf"], init=spec.get("init", "weights"), **spec.get("model", {}))
peak = Peak()
base = anon_kb()
torch.manual_seed(0)
with construct.partitioned(ds, hf=True):
    model = construct.build_hf(model_spec)
built = peak.take()
params = list(model.parameters())
record = {
    "rank": rank,
    "world": world,
    "baseline_kb": base,
    "build_peak_kb": built,
    "partitioned": all(hasattr(p, "ds_tensor") and p.numel() == 0 for p in params),
    "numel": sum(int(getattr(p, "ds_numel", p.numel())) for p in params),
    "held": sum(int(p.ds_tensor.numel()) if hasattr(p, "ds_tensor") else p.numel() for p in params),
    "buffers": {n: float(b.double().sum()) for n, b in model.named_buffers()},
    "leaf": [type(m).__name__ for m in model.modules() if getattr(m, "_z3_leaf", False)],
    "checkpointing": bool(getattr(model, "is_gradient_checkpointing", False)),
}
routes: list[list[int]] = []


def on_router(module, args, output):
    routes.append(sorted(set(output[2].flatten().tolist())))


for m in model.modules():
    if type(m).__name__.endswith("TopKRouter"):
        m.register_forward_hook(on_router)
engine, *_ = deepspeed.initialize(
    model=model, model_parameters=[p for p in params if p.requires_grad], config=ds
)
seq = spec.get("seq", 32)
tokens = spec.get("tokens")
if tokens:
    ids = torch.tensor(tokens[rank][:seq])[None]
else:
    gen = torch.Generator().manual_seed(7)
    ids = torch.randint(0, model.config.vocab_size, (1, seq), generator=gen)
losses, aux = [], []
peak.take()
for step in range(spec.get("steps", 3)):
    out_ = engine(input_ids=ids, labels=ids)
    losses.append(float(out_.loss))
    if getattr(out_, "aux_loss", None) is not None:
        aux.append(float(out_.aux_loss))
    engine.backward(out_.loss)
    engine.step()
    if step == 0:
        record["first_routes"] = list(routes)
record |= {"losses": losses, "aux": aux, "train_peak_kb": peak.take()}
peak.running = False
out.mkdir(parents=True, exist_ok=True)
(out / f"rank{rank}.json").write_text(json.dumps(record))
torch.distributed.barrier()
os._exit(0)  # gloo teardown can hang at exit on this machine; the record is written
