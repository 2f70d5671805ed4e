"""Stage 18: export consolidated fp32 weights (DeepSpeed's zero_to_fp32) with a checksum."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch

from . import checkpoint as ck
from . import distributed as dist
from .preflight import Plan


def run_export(
    args: argparse.Namespace, run_dir: Path, decided: dict[str, Any], plan: Plan
) -> dict[str, Any]:
    from .evaluate import consolidated_state

    assert plan.source is not None
    out = run_dir / "stage18"
    if dist.is_main():
        out.mkdir(parents=True, exist_ok=True)
        state = consolidated_state(plan.source)
        tmp = out / ".model.pt.tmp"
        torch.save(state, tmp)
        tmp.replace(out / "model.pt")
        meta = {
            "source": str(plan.source),
            "sha256": ck.sha256_file(out / "model.pt"),
            "tensors": len(state),
        }
        ck.atomic_write_text(out / "export.json", json.dumps(meta, indent=2))
    dist.barrier()
    return {"export": str(out / "model.pt")}
