"""``wonderland configs``: the DeepSpeed configs and hostfiles shipped with wonderland_ds, by the
names ``--config NAME`` and ``--hostfile NAME`` take."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from wonderland_ds.cli.common import Commands
from wonderland_ds.config import shipped
from wonderland_ds.core.findings import EXIT_OK


def config_row(name: str, path: Path) -> dict[str, Any]:
    """A shipped config's name, ZeRO stage, precision, task and the world size its batch sizes
    fix (train_batch_size = micro x grad_acc x world, all three given), else None."""
    from wonderland_ds.config import ds_config

    row: dict[str, Any] = {"name": name, "path": str(path)}
    raw, _ = ds_config.load_json(path)
    cfg, settings, _ = ds_config.validate(raw, str(path)) if raw is not None else (None, None, [])
    if raw is None or cfg is None or settings is None:
        return row | {"valid": False}
    tb, mb, gas = (
        cfg.train_batch_size,
        cfg.train_micro_batch_size_per_gpu,
        cfg.gradient_accumulation_steps,
    )
    fixed = tb // (mb * gas) if tb and mb and gas and tb % (mb * gas) == 0 else None
    return row | {
        "valid": True,
        "zero_stage": cfg.zero_optimization.stage,
        "precision": cfg.precision,
        "world_size": fixed,
        "task": settings.task,
    }


def hostfile_row(name: str, path: Path) -> dict[str, Any]:
    from wonderland_ds.config import hostfile

    hf, _ = hostfile.parse(path)
    if hf is None:
        return {"name": name, "path": str(path), "valid": False}
    return {
        "name": name,
        "path": str(path),
        "valid": True,
        "hosts": len(hf.hosts),
        "world_size": hf.world_size,
    }


def cmd_configs(args: argparse.Namespace) -> int:
    configs = [config_row(n, p) for n, p in shipped.configs().items()]
    hostfiles = [hostfile_row(n, p) for n, p in shipped.hostfiles().items()]
    if args.json:
        print(json.dumps({"configs": configs, "hostfiles": hostfiles}, indent=2))
        return EXIT_OK
    print(f"DeepSpeed configs ({shipped.folder('ds_configs')}), for --config NAME:")
    print(f"  {'name':<26} {'zero':>4}  {'precision':<9}  {'world':>5}  task")
    for c in configs:
        if not c["valid"]:
            print(f"  {c['name']:<26} invalid: see `wonderland check {c['path']}`")
            continue
        world = c["world_size"] if c["world_size"] is not None else "any"
        print(
            f"  {c['name']:<26} {c['zero_stage']:>4}  {c['precision']:<9}  {world:>5}  {c['task']}"
        )
    print(f"hostfiles ({shipped.folder('hostfiles')}), for --hostfile NAME:")
    print(f"  {'name':<26} {'hosts':>5}  {'world':>5}")
    for h in hostfiles:
        if not h["valid"]:
            print(f"  {h['name']:<26} invalid: {h['path']}")
            continue
        print(f"  {h['name']:<26} {h['hosts']:>5}  {h['world_size']:>5}")
    return EXIT_OK


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("configs", help="list the shipped DeepSpeed configs and hostfiles")
    p.add_argument("--json", action="store_true", help="print them as a JSON object")
    p.set_defaults(func=cmd_configs)
