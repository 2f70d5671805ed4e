"""Universal checkpoints through DeepSpeed's own ``ds_to_universal``: ``wonderland convert``.

The conversion is written to a temporary folder and renamed into place only after it
succeeded and its files were hashed, so a crash never leaves a half-converted checkpoint that
looks usable. An existing, verified conversion of the same source is reused.

The converter's own logic decides every byte of the output. What changes, for the DeepSpeed
release it was measured with (:data:`FAST_PATH_DEEPSPEED`), is where its intermediate
fragments live: in memory (:func:`in_memory_fragments`) instead of ~400 small files written
and read back, and how it reads the source (mapped): 2-3x faster (median) on the 25.5M-parameter
benchmark (bench/bench_convert.py); any other release, or an AutoEP checkpoint, or fragments
that would not fit in memory, runs the stock converter, and the metadata says which ran.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fnmatch
import glob
import io
import os
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core import ds_internals
from wonderland_ds.core.findings import Finding, Refused


def universal_tag(tag: str) -> str:
    return f"{tag}_universal"


def _source_digest(source: Path) -> str:
    meta = ck.read_meta(source)
    if meta is not None:
        return ck.sha256_text(repr(sorted((k, v.sha256) for k, v in meta.files.items())))
    return ck.sha256_text(repr(sorted((p.name, p.stat().st_size) for p in source.glob("*.pt"))))


#: The DeepSpeed release whose ``ds_to_universal`` internals the in-memory fragment store below
#: was written against, tested (tests/test_universal_fast.py) and measured with
#: (bench/bench_convert.py). Any other release runs the stock converter unchanged.
FAST_PATH_DEEPSPEED = ds_internals.CHECKED_RELEASE
D2U = "deepspeed.checkpoint.ds_to_universal"
ZC = "deepspeed.checkpoint.zero_checkpoint"
DSC = "deepspeed.checkpoint.deepspeed_checkpoint"

_convert_lock = threading.Lock()  # the patches below are module-wide: one conversion at a time


class _UseStock(Exception):
    """Raised inside the patched converter when the checkpoint needs what the fast path does
    not provide (AutoEP: DeepSpeed's autoep_universal reads the fragment folder itself)."""


class FragmentStore:
    """The converter's intermediate fragment files (``<output>/tmp/<param>/<tp>/<state>.<dp>``),
    kept in memory: ``torch.save`` to such a path stores the object, ``torch.load`` returns it,
    ``glob`` lists it, ``os.makedirs`` creates nothing. Every other path goes to the real disk."""

    def __init__(self, output_folder: str) -> None:
        self.prefix = os.path.join(output_folder, "tmp") + os.sep
        self.objects: dict[str, Any] = {}
        self._by_stem: dict[str, list[str]] = {}  # "<...>/<state>" -> its "<state>.<dp>" paths
        self.saved = 0
        self.loaded = 0
        self.globbed = 0

    def owns(self, path: Any) -> bool:
        return isinstance(path, str) and path.startswith(self.prefix)

    def put(self, path: str, obj: Any) -> None:
        if path not in self.objects:
            self._by_stem.setdefault(path.rpartition(".")[0], []).append(path)
        self.objects[path] = obj  # already a private copy: dump_param_fragment clones its slice
        self.saved += 1

    def get(self, path: str) -> Any:
        try:
            obj = self.objects[path]
        except KeyError:
            raise FileNotFoundError(errno.ENOENT, "no such fragment", path) from None
        self.loaded += 1
        return obj

    def glob(self, pattern: str) -> list[str]:
        self.globbed += 1
        stem, dot, star = pattern.rpartition(".")
        if dot and star == "*" and not glob.has_magic(stem):  # _merge_zero_shards' "<prefix>.*"
            return list(self._by_stem.get(stem, ()))
        return [p for p in self.objects if fnmatch.fnmatchcase(p, pattern)]


class _ModuleView:
    """A module with a few functions replaced, put in place of one module's global name only
    (``ds_to_universal.torch``), so nothing outside the converter sees a change."""

    def __init__(self, real: Any, **replaced: Any) -> None:
        self._real = real
        self.__dict__.update(replaced)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def _mmap_load(real_load: Any) -> Any:
    """``torch.load`` of the source checkpoint's files with ``mmap=True``: the converter
    loads rank 0's optimizer shard three times and the model file twice or more; mapped, each
    load reads only the pickle, and tensor bytes are read once, when they are cut out.
    Files that cannot be mapped (not zip) load as before."""

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        if "mmap" in kwargs or not isinstance(f, (str, os.PathLike)):
            return real_load(f, *args, **kwargs)
        try:
            return real_load(f, *args, mmap=True, **kwargs)
        except Exception:  # noqa: BLE001 - a file mmap cannot take loads the stock way
            return real_load(f, *args, **kwargs)

    return load


def fast_path_unavailable() -> str | None:
    """Why the in-memory fast path cannot run with the installed DeepSpeed, or None."""
    try:
        import deepspeed
        import torch

        dsc = ds_internals.module(DSC)
        d2u = ds_internals.module(D2U)
        zc = ds_internals.module(ZC)
    except ImportError as exc:
        return f"cannot import DeepSpeed's converter modules: {exc}"
    if deepspeed.__version__ != FAST_PATH_DEEPSPEED:
        return f"DeepSpeed {deepspeed.__version__}, the fast path is for {FAST_PATH_DEEPSPEED}"
    needed = (
        "main",
        "_save_checkpoint",
        "dump_param_fragment",
        "_merge_zero_shards",
        "_aggregate_autoep_zero12_metadata",
    )
    missing = [n for n in needed if not callable(getattr(d2u, n, None))]
    if missing:
        return f"ds_to_universal lacks {', '.join(missing)}"
    if not (d2u.torch is torch and d2u.glob is glob and d2u.os is os):
        return "ds_to_universal's torch/glob/os globals are not the modules (patched elsewhere?)"
    if not (zc.torch is torch and dsc.torch is torch):
        return "zero_checkpoint/deepspeed_checkpoint's torch global is not torch"
    return None


@contextlib.contextmanager
def in_memory_fragments(output_folder: str) -> Iterator[FragmentStore]:
    """Point DeepSpeed's converter at a :class:`FragmentStore` for the fragments it writes
    under ``<output_folder>/tmp`` and reads back, and at mapped loads for the checkpoint it
    reads; everything is put back on exit, also when the converter raises. Its own logic
    (what is cut, merged, concatenated, averaged, written) runs unchanged, and its final files
    are written to disk by its own ``torch.save``."""
    import torch

    store = FragmentStore(output_folder)
    real_save, real_load, real_makedirs = torch.save, torch.load, os.makedirs
    mapped_load = _mmap_load(real_load)
    real_aggregate = ds_internals.attr(D2U, "_aggregate_autoep_zero12_metadata")

    def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> None:
        if store.owns(f):
            store.put(f, obj)
        else:
            real_save(obj, f, *args, **kwargs)

    def load(f: Any, *args: Any, **kwargs: Any) -> Any:
        return store.get(f) if store.owns(f) else mapped_load(f, *args, **kwargs)

    def makedirs(name: Any, *args: Any, **kwargs: Any) -> None:
        if not store.owns(os.path.join(name, "")):
            real_makedirs(name, *args, **kwargs)

    def globber(pattern: Any, *args: Any, **kwargs: Any) -> list[str]:
        if store.owns(pattern) and not args and not kwargs:
            return store.glob(pattern)
        return glob.glob(pattern, *args, **kwargs)

    def aggregate(*args: Any, **kwargs: Any) -> Any:
        out = real_aggregate(*args, **kwargs)
        if out[1] is not None:  # AutoEP: autoep_universal reads the fragment folder itself
            raise _UseStock("AutoEP checkpoint")
        return out

    patches = [
        (D2U, "torch", _ModuleView(torch, save=save, load=load)),
        (D2U, "glob", _ModuleView(glob, glob=globber)),
        (D2U, "os", _ModuleView(os, makedirs=makedirs)),
        (D2U, "_aggregate_autoep_zero12_metadata", aggregate),
        (ZC, "torch", _ModuleView(torch, load=mapped_load)),
        (DSC, "torch", _ModuleView(torch, load=mapped_load)),
    ]
    try:
        with ds_internals.patched(patches):
            yield store
    finally:
        store.objects.clear()
        store._by_stem.clear()


def converter_args(source: Path, out: Path) -> argparse.Namespace:
    """``ds_to_universal``'s command line as its ``main`` takes it: one worker each (2 or 4
    were no faster on 2 cores, and a pool must not be forked from a rank)."""
    return argparse.Namespace(
        input_folder=str(source),
        output_folder=str(out),
        num_extract_workers=1,
        num_merge_workers=1,
        keep_temp_folder=False,
        strict=True,
        inject_missing_state=False,
    )


def _run_ds_to_universal(source: Path, out: Path) -> tuple[str | None, dict[str, Any]]:
    """DeepSpeed's own converter, in this process with one worker: rank 0 has DeepSpeed
    imported already (a separate ``python -m`` pays the imports and an interpreter start again;
    more workers were no faster, and its process pool must not be forked from a rank holding
    process-group threads).

    Its intermediate fragments (one ``torch.save`` per parameter, state and rank, read back
    once to be concatenated) stay in memory when the installed DeepSpeed is the one the
    patch was written for and they fit in half the available memory; otherwise, or for an
    AutoEP checkpoint, the stock converter runs unchanged. Returns (None or what went wrong,
    how it ran: recorded in the conversion's metadata)."""
    d2u = ds_internals.module(D2U)

    args = converter_args(source, out)
    info: dict[str, Any] = {"converter": "deepspeed.checkpoint.ds_to_universal"}
    why_stock = fast_path_unavailable() or _fragments_do_not_fit(source)
    log = io.StringIO()
    try:
        with _convert_lock, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
            if why_stock is None:
                try:
                    with in_memory_fragments(str(out)) as store:
                        d2u.main(args)
                    info.update(
                        fragments="memory", fragments_in_memory=store.saved, source_loads="mmap"
                    )
                except _UseStock as exc:
                    why_stock = str(exc)
                    shutil.rmtree(out, ignore_errors=True)
            if why_stock is not None:
                info.update(fragments="disk (stock converter)", stock_because=why_stock)
                d2u.main(args)
    except (Exception, SystemExit) as exc:  # its failure is a refusal, not a traceback
        tail = " | ".join(log.getvalue().strip().splitlines()[-2:])
        return f"{type(exc).__name__}: {exc}" + (f" ({tail})" if tail else ""), info
    return None, info


def _mem_available() -> int | None:
    try:
        with open("/proc/meminfo") as fh:
            return next(int(ln.split()[1]) * 1024 for ln in fh if ln.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return None


def _fragments_do_not_fit(source: Path) -> str | None:
    """The fragments are about the optimizer shards' size; keeping them (and the shard being
    cut) in memory must leave half of the available memory free. None when they fit."""
    need = 2 * sum(p.stat().st_size for p in source.glob("*optim_states.pt"))
    avail = _mem_available()
    if avail is None:
        return None if need <= 1 << 30 else "available memory unknown"
    if need > avail // 2:
        return f"fragments need ~{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available"
    return None


def convert(source: Path, out_root: Path) -> tuple[Path, list[Finding]]:
    """Convert ``source`` (a global_stepN folder) into ``out_root/global_stepN_universal``."""
    final = out_root / universal_tag(source.name)
    digest = _source_digest(source)
    if final.is_dir():
        v = ck.verify(final)
        if v.complete and v.meta and v.meta.source_digest == digest:
            return final, [Finding("universal", "ok", f"reusing verified conversion {final}")]
        shutil.rmtree(final)
    out_root.mkdir(parents=True, exist_ok=True)
    tmp = out_root / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        # imported already on a rank; from the CLI, the ~2 s import is not the conversion's time
        ds_internals.module(D2U)
    t0 = time.perf_counter()
    failure, how = _run_ds_to_universal(source, tmp)
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
    src_meta = ck.read_meta(source)
    meta = src_meta.fields() if src_meta else {}
    meta = {k: v for k, v in meta.items() if k not in ("files", "format", "tag")}
    meta.update(
        {
            "universal": True,
            "source": str(source),
            "source_digest": digest,
            "conversion_seconds": round(seconds, 3),
            "conversion": how,
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
            f"converted {source.name} -> {final} in {seconds:.1f} s ({size / 1e6:.1f} MB)"
            + (f"; stock converter: {how['stock_because']}" if "stock_because" in how else ""),
        )
    ]
