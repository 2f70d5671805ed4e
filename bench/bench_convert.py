"""Universal conversion benchmark: DeepSpeed's ``ds_to_universal`` stock vs wonderland's.

    .venv/bin/python bench/bench_convert.py --reps 3 [--checkpoint CKPT] [--out convert.json]

``CKPT`` is a ``global_stepN`` folder; without it a stage-15 checkpoint of the 25.5M-parameter
GPT (ZeRO-2 bf16, 2 ranks) is made first, as ``bench_resume.py`` makes it. Then, alternating
sides each repetition (the machine is noisy), each into a fresh folder after an ``os.sync()``
(no writeback of the previous side pending):

* ``stock``: ``deepspeed.checkpoint.ds_to_universal.main`` in this process, one worker, as
  ``universal.py`` called it before: fragments written to ``<out>/tmp`` and read back;
* ``wonderland``: ``universal._run_ds_to_universal``: the same converter with its fragments
  kept in memory and the source checkpoint loaded mapped (``mmap=True``).

Throughput is (bytes read + bytes written) / seconds: the checkpoint folder's size plus the
universal folder's size, as in ``bench_resume.py``; against what the disk needs to read and
write as much, both speeds measured in the same run (``bench/disk.py``; the read is cold when
the page cache can be dropped, i.e. as root). The conversions themselves read a checkpoint
that is in the page cache, as a resume right after the save would.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from disk import read_speed, write_speed  # noqa: E402


def tree_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def make_checkpoint(work: Path, dim: int, layers: int) -> Path:
    """A stage-15 run of the benchmark GPT, as bench_resume.py makes it."""
    import bench_resume

    os.environ["WL_BENCH_DIM"], os.environ["WL_BENCH_LAYERS"] = str(dim), str(layers)
    cfg = bench_resume.config(work, dim, layers)
    src = work / "stage15"
    cmd = [str(bench_resume.BIN / "wonderland"), "train", "--stage", "15", "--config", str(cfg)]
    bench_resume.run(cmd + ["--run-dir", str(src)], work / "stage15.log")
    ckpts = src / "stage15" / "checkpoints"
    return ckpts / (ckpts / "latest").read_text().strip()


def stock(source: Path, out: Path) -> None:
    from deepspeed.checkpoint import ds_to_universal as d2u

    from wonderland_ds.checkpoint.universal import converter_args

    args = converter_args(source, out)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        d2u.main(args)


def wonderland(source: Path, out: Path) -> dict:
    from wonderland_ds.checkpoint.universal import _run_ds_to_universal

    failure, how = _run_ds_to_universal(source, out)
    if failure is not None:
        sys.exit(f"wonderland conversion failed: {failure}")
    return how


def files(folder: Path) -> list[str]:
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", help="a global_stepN folder (default: make one)")
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--out", help="write the results here (json)")
    ap.add_argument("--keep", action="store_true", help="keep the work folder")
    args = ap.parse_args()

    import torch

    torch.set_num_threads(1)  # as on a rank here: OMP_NUM_THREADS = cores // local ranks
    work = Path(tempfile.mkdtemp(prefix="wl-bench-convert-"))
    try:
        source = (
            Path(args.checkpoint)
            if args.checkpoint
            else make_checkpoint(work, args.dim, args.layers)
        )
        write = write_speed(work, 1024, keep=True)
        read, cold = read_speed(work / "dd.bin")
        (work / "dd.bin").unlink()
        result: dict = {
            "checkpoint": str(source),
            "checkpoint_bytes": tree_bytes(source),
            "disk": {"write_Bps": write, "read_Bps": read, "read_cold": cold},
            "runs": {"stock": [], "wonderland": []},
        }
        import deepspeed

        result["versions"] = {"deepspeed": deepspeed.__version__, "torch": torch.__version__}
        sides = {"stock": stock, "wonderland": wonderland}
        listing: dict[str, list[str]] = {}
        for rep in range(args.reps):
            for name, fn in sides.items():
                out = work / f"{name}-{rep}" / f"{source.name}_universal"
                os.sync()
                t0 = time.perf_counter()
                how = fn(source, out)
                seconds = time.perf_counter() - t0
                run: dict = {"seconds": seconds, "universal_bytes": tree_bytes(out)}
                if how:
                    run["how"] = how
                result["runs"][name].append(run)
                listing.setdefault(name, files(out))
                print(f"rep {rep} {name:>10}: {seconds:.3f} s", flush=True)
                shutil.rmtree(out.parent)
        if listing["stock"] != listing["wonderland"]:
            sys.exit("the two sides wrote different files: " + repr(listing))
        disk = result["disk"]
        summary: dict = {}
        for name, runs in result["runs"].items():
            t = [r["seconds"] for r in runs]
            moved = result["checkpoint_bytes"] + runs[0]["universal_bytes"]
            need = result["checkpoint_bytes"] / disk["read_Bps"]
            need += runs[0]["universal_bytes"] / disk["write_Bps"]
            med = statistics.median(t)
            summary[name] = {
                "min_s": min(t),
                "median_s": med,
                "MBps_median": moved / med / 1e6,
                "MBps_best": moved / min(t) / 1e6,
                "vs_disk_median": need / med,
                "vs_disk_best": need / min(t),
                "disk_need_s": need,
            }
        summary["speedup_median"] = summary["stock"]["median_s"] / summary["wonderland"]["median_s"]
        result["summary"] = summary
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=2))
        print(
            f"disk: write {write / 1e6:,.0f} MB/s, read {read / 1e6:,.0f} MB/s"
            f" ({'cold' if cold else 'page cache not dropped'});"
            f" checkpoint {result['checkpoint_bytes'] / 1e6:.0f} MB"
        )
        for name in sides:
            s = summary[name]
            print(
                f"{name:>10}: min {s['min_s']:.3f} s, median {s['median_s']:.3f} s,"
                f" {s['MBps_median']:,.0f} MB/s (median), {100 * s['vs_disk_median']:.0f}% of the"
                f" disk's need (median; best {100 * s['vs_disk_best']:.0f}%)"
            )
        print(f"speedup (median): {summary['speedup_median']:.2f}x")
    finally:
        if args.keep:
            print("work folder kept:", work)
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
