"""The checkpoint to resume and the disk to save to: a checkpoint's versions against the
installed ones, and room for the next save.
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Mapping
from pathlib import Path

from wonderland_ds.core.findings import Finding
from wonderland_ds.doctor.sizes import GIB, gib


def _minor(text: str | None) -> tuple[int, int] | None:
    m = re.match(r"(\d+)\.(\d+)", text or "")
    return (int(m.group(1)), int(m.group(2))) if m else None


def _checkpoint_versions(path: Path) -> tuple[Path, dict[str, str], str, bool]:
    """(tag dir, versions, where they came from, whether it reads as a checkpoint at all)."""
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.checkpoint.describe import resolve_tag_dir, safe_load

    tag_dir = resolve_tag_dir(path)
    meta = ck.read_meta(tag_dir) if (tag_dir / ck.META).exists() else None
    if meta and meta.versions is not None:
        return tag_dir, dict(meta.versions), ck.META, True
    states = sorted(tag_dir.glob("mp_rank_00_model_states.pt")) or sorted(
        tag_dir.glob("zero_pp_rank_0_mp_rank_*_model_states.pt")
    )
    if not states:
        return tag_dir, {}, "no DeepSpeed model states file: not a checkpoint folder", False
    obj, why = safe_load(states[0])
    if not isinstance(obj, dict):
        return tag_dir, {}, f"{states[0].name}: {why or 'not a dict'}", False
    if obj.get("ds_version"):
        return tag_dir, {"deepspeed": str(obj["ds_version"])}, states[0].name, True
    return tag_dir, {}, f"{states[0].name} has no ds_version", True


def compare_versions(saved: Mapping[str, str], installed: Mapping[str, str]) -> list[Finding]:
    out = []
    for pkg in ("deepspeed", "torch", "python"):
        was, now = saved.get(pkg), installed.get(pkg)
        if was is None or now is None:
            continue
        if was == now:
            out.append(Finding("doctor-ckpt-versions", "ok", f"{pkg} {now}: same as at save"))
        elif _minor(was) == _minor(now):
            out.append(
                Finding("doctor-ckpt-versions", "ok", f"{pkg} {now}, saved with {was} (same minor)")
            )
        else:
            what = {
                "deepspeed": "ZeRO checkpoint layouts change between minor versions",
                "torch": "optimizer state and pickles may differ",
                "python": "pickled client state may not load",
            }[pkg]
            out.append(
                Finding(
                    "doctor-ckpt-versions",
                    "warn",
                    f"{pkg} {now} is installed, the checkpoint was saved with {was}: {what}",
                    f"resume with {pkg}=={was}, or convert it (`wonderland convert`) and verify"
                    " the first steps' losses",
                )
            )
    return out


def check_checkpoint(path: Path) -> tuple[list[Finding], int]:
    """Version findings and the checkpoint's size in bytes (0 when unreadable)."""
    from wonderland_ds.run import manifest

    fix = "pass a global_stepN folder or its parent"
    if not path.exists():
        return [
            Finding("doctor-checkpoint", "error", "checkpoint does not exist", fix, str(path))
        ], 0
    if not path.is_dir():
        return [Finding("doctor-checkpoint", "error", "not a folder", fix, str(path))], 0
    tag_dir, saved, source, readable = _checkpoint_versions(path)
    size = sum(p.stat().st_size for p in tag_dir.rglob("*") if p.is_file())
    if not readable:
        why = Finding("doctor-checkpoint", "error", source, fix, str(tag_dir))
        return [why], size
    if not saved:
        return [
            Finding(
                "doctor-checkpoint",
                "warn",
                f"no version information ({source})",
                "check it with `wonderland inspect`",
                str(tag_dir),
            )
        ], size
    head = Finding(
        "doctor-checkpoint",
        "ok",
        f"{gib(size)}, versions from {source}",
        "",
        str(tag_dir),
    )
    return [head, *compare_versions(saved, manifest.versions())], size


def check_disk(where: Path, ckpt_bytes: int) -> Finding:
    probe = where
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if ckpt_bytes <= 0:
        msg = f"{gib(free)} free at {probe} (no --checkpoint to size a save against)"
        if free < 5 * GIB:
            return Finding("doctor-disk", "warn", msg, "free some space before a long run")
        return Finding("doctor-disk", "ok", msg)
    # A save writes a whole new checkpoint before retention deletes the oldest one.
    need = ckpt_bytes
    if free < need:
        return Finding(
            "doctor-disk",
            "error",
            f"{gib(free)} free at {probe}, one checkpoint needs {gib(need)}: the next save fails",
            "free space or point --run-dir at a larger disk",
        )
    if free < 4 * need:
        return Finding(
            "doctor-disk",
            "warn",
            f"{gib(free)} free at {probe}: room for {free // need} checkpoint(s) of"
            f" {gib(need)} (keep_last + 1 are on disk during a save)",
            "lower wonderland.keep_last or free space",
        )
    return Finding(
        "doctor-disk",
        "ok",
        f"{gib(free)} free at {probe}: room for {min(free // need, 1000)}"
        f"{'+' if free // need > 1000 else ''} checkpoints of {gib(need)}",
    )
