"""Stage 18: export the checkpoint's fp32 master weights in the ecosystem's format, streamed
one tensor at a time by rank 0 (``wonderland_ds.model.export``), in ``wonderland.export``'s
dtype and shard size.

* A ``transformers`` model (the ``causal-lm`` task, or any task with ``hf_dir``): a
  ``save_pretrained`` folder, ``stage18/``: sharded safetensors weights, ``config.json``, the
  generation config and the model directory's tokenizer files, which
  ``AutoModelForCausalLM.from_pretrained`` reloads as it is.
* Any other model: ``stage18/model.safetensors`` (or shards), the model's own state-dict names
  (no wrapper prefixes), tied tensors stored once.

The export is written into a temporary folder renamed into place, with ``export.json`` (each
file's sha256) last: a crash leaves no half export.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core import distributed as dist
from wonderland_ds.run.inputs import StageInputs
from wonderland_ds.run.preflight import Plan

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions


def run_export(
    opts: StageOptions, run_dir: Path, inputs: StageInputs, plan: Plan
) -> dict[str, Any]:
    import torch

    from wonderland_ds.model import export

    assert plan.source is not None
    task = inputs.task
    out = run_dir / "stage18"
    hf = task.hf_dir is not None
    if dist.is_main():
        spec = inputs.settings.export
        dtype = getattr(torch, spec.dtype)
        tmp = run_dir / f".stage18.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            root = tmp / ("hf" if hf else "weights")
            build = task.build_empty_model or task.build_model
            index = export.export_weights(build, plan.source, root, dtype, spec.max_shard_bytes)
            if task.hf_dir is not None:
                export.hf_files(task.hf_dir, root, dtype)
            files = sorted(p for p in root.rglob("*") if p.is_file())
            meta = {
                "source": str(plan.source),
                "format": "transformers" if hf else "safetensors",
                "tensors": len(index["weight_map"]),
                "dtype": spec.dtype,
                "files": {str(p.relative_to(root)): ck.sha256_file(p) for p in files},
            }
            ck.atomic_write_text(root / "export.json", json.dumps(meta, indent=2))
            if out.exists():
                shutil.rmtree(out)
            os.replace(root, out)
            ck.fsync_dir(out.parent)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    dist.barrier()
    return {"export": str(out), "format": "transformers" if hf else "safetensors"}
