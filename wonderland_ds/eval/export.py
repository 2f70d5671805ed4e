"""Stage 18: export the checkpoint's consolidated fp32 weights in the ecosystem's format.

* A ``transformers`` model (the ``causal-lm`` task, or any task with ``hf_dir``): a
  ``save_pretrained`` folder, ``stage18/``: safetensors weights, ``config.json``, the
  generation config and the model directory's tokenizer files, which
  ``AutoModelForCausalLM.from_pretrained`` reloads as it is.
* Any other model: ``stage18/model.safetensors``, the model's own state-dict names (no wrapper
  prefixes), tied tensors stored once.

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
from wonderland_ds.data.tasks import Task
from wonderland_ds.run.inputs import StageInputs
from wonderland_ds.run.preflight import Plan

if TYPE_CHECKING:
    from wonderland_ds.launch.plan import StageOptions


def _hf_export(task: Task, state: dict[str, Any], folder: Path) -> None:
    from wonderland_ds.data.lm import TOKENIZER_FILES
    from wonderland_ds.eval.lm_eval import lm_eval_model

    assert task.hf_dir is not None
    model: Any = lm_eval_model(task, state)
    model.config.use_cache = True  # as a model for generation expects it
    model.save_pretrained(folder, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(task.hf_dir) / name
        if src.is_file():
            shutil.copy2(src, folder / name)


def _plain_export(task: Task, state: dict[str, Any], folder: Path) -> None:
    from safetensors.torch import save_model

    from wonderland_ds.eval.lm_eval import lm_eval_model

    model = lm_eval_model(task, state)  # checks the names fit the task's model
    folder.mkdir(parents=True)
    save_model(model, str(folder / "model.safetensors"))  # tied tensors once, no prefixes


def run_export(
    opts: StageOptions, run_dir: Path, inputs: StageInputs, plan: Plan
) -> dict[str, Any]:
    from wonderland_ds.eval.sweep import consolidated_state

    assert plan.source is not None
    task = inputs.task
    out = run_dir / "stage18"
    hf = task.hf_dir is not None
    if dist.is_main():
        state = consolidated_state(plan.source)
        tmp = run_dir / f".stage18.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        try:
            if hf:
                _hf_export(task, state, tmp / "hf")
            else:
                _plain_export(task, state, tmp / "weights")
            root = tmp / ("hf" if hf else "weights")
            files = sorted(p for p in root.rglob("*") if p.is_file())
            meta = {
                "source": str(plan.source),
                "format": "transformers" if hf else "safetensors",
                "tensors": len(state),
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
