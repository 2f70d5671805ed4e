"""``wonderland check CONFIG...``: validate DeepSpeed JSON configs (and a hostfile) without a
GPU; a config naming a user task also builds its model and runs one forward on its data."""

from __future__ import annotations

import argparse
import contextlib
import sys
from typing import Any

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK, EXIT_REFUSED, Finding, has_errors, render
from wonderland_ds.launch.flags import positive, stage_number


def cmd_check(args: argparse.Namespace) -> int:
    from wonderland_ds.config import ds_config, hostfile

    findings: list[Finding] = []
    world = args.world_size
    hf = None
    if args.hostfile:
        hf, found = hostfile.parse(args.hostfile)
        findings += found
        if hf is not None and world is None:
            world = hf.world_size
    stages = {args.stage} if args.stage else set()
    for path in args.configs:
        found = ds_config.check_file(path, world, stages)
        findings += found or [Finding("config", "ok", "valid", "", path)]
        if not has_errors(found):
            # Library lines (DeepSpeed's logger binds stdout at its import) go to stderr:
            # stdout is the report, --json's too.
            with contextlib.redirect_stdout(sys.stderr):
                task = _task_findings(path, args.task)
                findings += task + _eval_findings(path, world)
                if not has_errors(task):  # the estimate needs a model that loads
                    findings += _memory_findings(path, world, hf)
                    findings += _epoch_findings(path, world)
            if hf is not None and hf.localhost_only:  # the stage would run on this CPU
                findings += _cpu_findings(path)
    render(findings, args.json)
    if not args.json:
        n_err = sum(f.severity == "error" for f in findings)
        n_warn = sum(f.severity == "warn" for f in findings)
        verdict = "refused" if n_err else "ok"
        print(f"{verdict}: {len(args.configs)} config(s), {n_err} error(s), {n_warn} warning(s)")
    return EXIT_REFUSED if has_errors(findings) else EXIT_OK


def _cpu_findings(path: str) -> list[Finding]:
    """A bf16 config for this machine (a localhost hostfile) whose CPU would emulate bf16
    (doctor/cpu.py)."""
    from wonderland_ds.config import ds_config
    from wonderland_ds.doctor.cpu import check_bf16

    raw, _ = ds_config.load_json(path)
    bf16 = (raw or {}).get("bf16") or {}
    return check_bf16("bf16" if isinstance(bf16, dict) and bf16.get("enabled") else "", path)


def _task_findings(path: str, spec: str | None) -> list[Finding]:
    """The task check for a valid config that names a user task, or for ``--task``."""
    from wonderland_ds.config import ds_config
    from wonderland_ds.eval.check import check_task, names_a_task

    raw, _ = ds_config.load_json(path)
    assert raw is not None
    spec = spec or names_a_task(raw)
    if spec is None:
        return []
    _, settings, _ = ds_config.validate(raw, path)
    assert settings is not None
    micro = raw.get("train_micro_batch_size_per_gpu")
    return check_task(spec, settings, micro if isinstance(micro, int) and micro > 0 else 1, path)


def _eval_findings(path: str, world: int | None) -> list[Finding]:
    """Stage 17's lm-eval tasks (eval/task_check.py), when the config names any."""
    from wonderland_ds.config import ds_config
    from wonderland_ds.eval.task_check import settings_findings

    raw, _ = ds_config.load_json(path)
    assert raw is not None
    _, settings, _ = ds_config.validate(raw, path)
    if settings is None or not settings.eval.tasks:
        return []
    return settings_findings(settings, world or 1, path)


def _epoch_findings(path: str, world: int | None) -> list[Finding]:
    """Sources the causal-LM stages would repeat more than data.max_epochs times."""
    from wonderland_ds.config import ds_config
    from wonderland_ds.data.lm import epoch_findings

    raw, _ = ds_config.load_json(path)
    assert raw is not None
    _, settings, _ = ds_config.validate(raw, path)
    if settings is None or settings.data is None:
        return []
    try:
        batch = ds_config.deepspeed_dict(raw, None, world or 1)["train_batch_size"]
    except ValueError:
        return []  # the batch triangle's own finding says why
    return epoch_findings(settings, int(batch), path)


def _memory_findings(path: str, world: int | None, hf: Any) -> list[Finding]:
    """The causal-LM task's memory per rank against a device's (model/memory.py)."""
    from wonderland_ds.config import ds_config
    from wonderland_ds.core.findings import Refused
    from wonderland_ds.model import memory

    raw, _ = ds_config.load_json(path)
    assert raw is not None
    _, settings, _ = ds_config.validate(raw, path)
    if settings is None or settings.model is None or settings.data is None:
        return []
    nodes = len(hf.hosts) if hf is not None else 1
    world = world or 1
    here = hf is None or hf.localhost_only
    device = memory.device_memory_gb(settings, max(1, world // nodes), here)
    try:
        return memory.findings(raw, settings, world, nodes, device, path)
    except Refused as exc:
        return exc.findings


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("check", help="validate DeepSpeed JSON configs and a hostfile, no GPU")
    p.add_argument("configs", nargs="+", metavar="CONFIG", help="DeepSpeed JSON config file(s)")
    p.add_argument("--hostfile", help="hostfile whose slots give the world size")
    p.add_argument("--world-size", type=positive, help="data-parallel size (default: hostfile)")
    p.add_argument("--stage", type=stage_number, help="apply the rules for this stage (e.g. 16)")
    p.add_argument(
        "--task",
        help="also build this task's model and run one forward and loss on one micro-batch of"
        " its data (default: the config's task when it is causal-lm or module:function)",
    )
    p.add_argument("--json", action="store_true", help="print findings as a JSON list")
    p.set_defaults(func=cmd_check)
