"""Universal checkpoints through DeepSpeed's own ``ds_to_universal``: ``wonderland convert``.

The conversion is written to a temporary folder and renamed into place only after it
succeeded and its files were hashed, so a crash never leaves a half-converted checkpoint that
looks usable. An existing, verified conversion of the same source is reused.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shutil
import time
from pathlib import Path

from . import checkpoint as ck
from .findings import Finding, Refused


def universal_tag(tag: str) -> str:
    return f"{tag}_universal"


def _source_digest(source: Path) -> str:
    meta = ck.read_meta(source)
    if meta is not None:
        return ck.sha256_text(repr(sorted((k, v["sha256"]) for k, v in meta["files"].items())))
    return ck.sha256_text(repr(sorted((p.name, p.stat().st_size) for p in source.glob("*.pt"))))


def _run_ds_to_universal(source: Path, out: Path) -> str | None:
    """DeepSpeed's own converter, in this process with one worker: rank 0 has DeepSpeed
    imported already (a separate ``python -m`` paid 2.3 s of imports and interpreter start on
    a 5.5 s conversion, BENCHMARKS.md; 2 or 4 workers were no faster on 2 cores, and its
    process pool must not be forked from a rank holding process-group threads).
    Returns None, or what went wrong."""
    from deepspeed.checkpoint import ds_to_universal as d2u

    args = argparse.Namespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )
    log = io.StringIO()
    try:
        with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            d2u.main(args)
    except (Exception, SystemExit) as exc:  # its failure is a refusal, not a traceback
        tail = " | ".join(log.getvalue().strip().splitlines()[-2:])
        return f"{type(exc).__name__}: {exc}" + (f" ({tail})" if tail else "")
    return None


def convert(source: Path, out_root: Path) -> tuple[Path, list[Finding]]:
    """Convert ``source`` (a global_stepN folder) into ``out_root/global_stepN_universal``."""
    final = out_root / universal_tag(source.name)
    digest = _source_digest(source)
    if final.is_dir():
        v = ck.verify(final)
        if v.complete and v.meta and v.meta.get("source_digest") == digest:
            return final, [Finding("universal", "ok", f"reusing verified conversion {final}")]
        shutil.rmtree(final)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    failure = _run_ds_to_universal(source, tmp)
    seconds = time.perf_counter() - t0
    (out_root / "latest_universal").unlink(missing_ok=True)  # names tmp; we pass tags explicitly
    if failure is not None:
        shutil.rmtree(tmp, ignore_errors=True)
        raise Refused(
            Finding(
                "universal",
                "error",
                f"ds_to_universal failed on {source}: {failure}",
                "check the checkpoint with `wonderland inspect`; a checkpoint without"
                " universal_checkpoint_info needs --inject-missing-state",
                str(source),
            )
        )
    src_meta = ck.read_meta(source) or {}
    meta = {k: v for k, v in src_meta.items() if k not in ("files", "format", "tag")}
    meta.update(
        {
            "universal": True,
            "source": str(source),
            "source_digest": digest,
            "conversion_seconds": round(seconds, 3),
        }
    )
    ck.write_meta(tmp, meta)
    os.replace(tmp, final)
    ck.fsync_dir(out_root)
    size = sum(p.stat().st_size for p in final.rglob("*") if p.is_file())
    return final, [
        Finding(
            "universal",
            "ok",
            f"converted {source.name} -> {final} in {seconds:.1f} s ({size / 1e6:.1f} MB)",
        )
    ]
