"""Resume on another world size: resharded at load time against a same-size resume.

    .venv/bin/python bench/bench_reshard.py --reps 3 --out /tmp/reshard.json

Two stage-15 runs of the 25.5M-parameter GPT (ZeRO-2 bf16, the checkpoint ~358 MB: bf16
weights, fp32 master weights and both Adam moments) are made, one on 2 ranks and one on 3.
Then, alternating sides each repetition (the machine is noisy), each from a fresh copy of its
run folder with the page cache dropped (root) so both read the checkpoint from the disk:

* ``same``: ``wonderland train --stage 16 --steps 1`` on 2 ranks resuming the 2-rank checkpoint;
* ``resharded``: the same command on 2 ranks resuming the 3-rank checkpoint (every rank reads
  its share of the 3 saved partitions at load time).

Each side is timed from the command's start to its exit. Also measured: bytes written into the
run folder besides the stage's own new checkpoint (files new or changed outside
``stage16/checkpoints``), per rank the bytes of the saved partitions it copied against its
share of them, and what each rank read from storage while resharding (``/proc/self/io``: the
preflight has just hashed the checkpoint, so little). The reshard's reads alone (the new ranks
as processes, the same code) are then timed from a dropped page cache: their throughput (all
ranks' bytes over the slowest rank's seconds) against the disk's sequential read speed
measured in the same run (``bench/disk.py``, cold). Also timed: the front's reading of the
layout and the reference norms the check compares against (``zero_layout.read_source``).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO))

from bench_resume import BIN, bench_args, config, disk_speeds, run, tree_bytes  # noqa: E402
from disk import read_speed, write_speed  # noqa: E402

from wonderland_ds.checkpoint import zero_layout as zl  # noqa: E402
from wonderland_ds.checkpoint import zero_partitions as zp  # noqa: E402

HOSTFILES = {2: "hostfiles/localhost", 3: "hostfiles/localhost3"}


def drop_caches() -> bool:
    os.sync()
    try:
        Path("/proc/sys/vm/drop_caches").write_text("1\n")
        return True
    except OSError:
        return False


def stage15(cfg: Path, work: Path, world: int) -> Path:
    src = work / f"saved-by-{world}"
    cmd = [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(cfg)]
    run(cmd + ["--run-dir", str(src), "--hostfile", HOSTFILES[world]], work / f"s15-{world}.log")
    return src


def latest(stage_dir: Path) -> Path:
    root = stage_dir / "checkpoints"
    return root / (root / "latest").read_text().strip()


def resume(cfg: Path, src: Path, work: Path, name: str) -> dict:
    run_dir = work / name
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.copytree(src, run_dir, symlinks=True)
    before = {p: p.stat().st_mtime_ns for p in run_dir.rglob("*") if p.is_file()}
    cold = drop_caches()
    cmd = [str(BIN / "wonderland"), "train", "--stage", "16", "--config", str(cfg)]
    cmd += ["--run-dir", str(run_dir), "--resume", "auto", "--steps", "1"]
    cmd += ["--hostfile", HOSTFILES[2]]
    t0 = time.perf_counter()
    run(cmd, work / f"{name}.log")
    took = time.perf_counter() - t0
    own = run_dir / "stage16" / "checkpoints"
    written = [
        p
        for p in run_dir.rglob("*")
        if p.is_file() and own not in p.parents and before.get(p) != p.stat().st_mtime_ns
    ]
    entry = json.loads((run_dir / "run.json").read_text())["stages"]["16"]
    out = {
        "seconds": took,
        "cold": cold,
        "written_besides_checkpoint_bytes": sum(p.stat().st_size for p in written),
        "largest_written": max(((p.stat().st_size, p.name) for p in written), default=None),
        "universal_folders": len(list(run_dir.rglob("*_universal"))),
        "resume": entry.get("resume"),
    }
    shutil.rmtree(run_dir)
    return out


def _read_share(tag_dir: Path, layout: zl.SourceLayout, world: int, rank: int, q) -> None:
    """One new rank's reads, as ``reshard.load`` does them, into fresh partitions."""
    import torch

    from wonderland_ds.checkpoint import shard_reads

    report = shard_reads.Report()
    t0 = time.perf_counter()
    files = [tag_dir / layout.optim_file(r) for r in range(layout.world_size)]
    sources = shard_reads.Sources(files, report)
    for g, group in enumerate(layout.groups):
        copies = zp.transfers(layout.family(), group, group, layout.world_size, world, rank)
        n = zp.partition_numel(layout.family(), group, world)
        sources.fill(
            torch.zeros(n), copies, lambda sd, g=g: zl.flat_fp32(sd["optimizer_state_dict"])[g]
        )
        for key in layout.state_keys:
            sources.fill(
                torch.zeros(n),
                copies,
                lambda sd, g=g, k=key: zl._base(sd["optimizer_state_dict"])["state"][g][k],
            )
    q.put((report.bytes_read, time.perf_counter() - t0))


def cold_reads(tag_dir: Path, layout: zl.SourceLayout, world: int) -> dict:
    """The ranks' reads alone, in parallel, from a dropped page cache (the resume itself reads
    a checkpoint its preflight has just hashed, so from memory)."""
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    q = ctx.Queue()
    cold = drop_caches()
    procs = [
        ctx.Process(target=_read_share, args=(tag_dir, layout, world, r, q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    got = [q.get() for _ in procs]
    for p in procs:
        p.join()
    moved = sum(b for b, _ in got)
    return {"cold": cold, "bytes": moved, "seconds": max(t for _, t in got), "per_rank": got}


def main() -> None:
    args, work = bench_args("reshard")
    try:
        cfg = config(work, args.dim, args.layers)
        src = {w: stage15(cfg, work, w) for w in (2, 3)}
        ckpt3 = latest(src[3] / "stage15")
        layout = zl.read_source(ckpt3, norms=False)
        # What the front adds before launch: the layout and the reference norms (warm cache).
        front = []
        for _ in range(3):
            t0 = time.perf_counter()
            zl.read_source(ckpt3)
            front.append(time.perf_counter() - t0)
        # Each new rank's share: fp32 weights and both moments (4 bytes each) of its partition.
        share = 12 * sum(zp.partition_numel(layout.family(), g, 2) for g in layout.groups)
        result: dict = {
            "dim": args.dim,
            "layers": args.layers,
            "checkpoint_bytes": {w: tree_bytes(latest(src[w] / "stage15")) for w in (2, 3)},
            "share_bytes_per_rank": share,
            "front_layout_and_norms_s": front,
            "disk": disk_speeds(work),
        }
        sides: dict[str, list[dict]] = {"same": [], "resharded": []}
        for i in range(args.reps):
            order = ("same", "resharded") if i % 2 == 0 else ("resharded", "same")
            for side in order:
                sides[side].append(resume(cfg, src[2 if side == "same" else 3], work, side))
        result["runs"] = sides
        # The reads alone against the disk, side by side: 2x the repetitions (they are short).
        reads, disk = [], []
        big = work / "dd.bin"
        write_speed(work, 1024, keep=True)
        for _ in range(2 * args.reps):
            reads.append(cold_reads(ckpt3, layout, 2))
            disk.append(read_speed(big)[0])
        big.unlink()
        result["cold_reads"], result["disk_read_Bps"] = reads, disk
        same = [r["seconds"] for r in sides["same"]]
        resh = [r["seconds"] for r in sides["resharded"]]
        loads = [r["resume"] for r in sides["resharded"]]
        moved = [sum(x["bytes_read"]) / x["seconds"] for x in loads]
        result["summary"] = {
            "same_median_s": statistics.median(same),
            "resharded_median_s": statistics.median(resh),
            "ratio_median": statistics.median(resh) / statistics.median(same),
            "ratio_paired_median": statistics.median(b / a for a, b in zip(same, resh)),
            "written_besides_checkpoint_bytes_max": max(
                r["written_besides_checkpoint_bytes"] for r in sides["resharded"]
            ),
            "universal_folders": sum(r["universal_folders"] for r in sides["resharded"]),
            "bytes_read_per_rank_max": max(max(x["bytes_read"]) for x in loads),
            "io_read_bytes_per_rank_max": max(max(x["io_read_bytes"] or [0]) for x in loads),
            "share_bytes_per_rank": share,
            "reshard_seconds_median": statistics.median(x["seconds"] for x in loads),
            "front_layout_and_norms_s_median": statistics.median(front),
            "reshard_read_Bps_median": statistics.median(moved),
            "cold_read_Bps_median": statistics.median(r["bytes"] / r["seconds"] for r in reads),
            "disk_read_Bps_median": statistics.median(disk),
            "cold_read_vs_disk_read_paired_median": statistics.median(
                r["bytes"] / r["seconds"] / d for r, d in zip(reads, disk)
            ),
        }
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(json.dumps(result["summary"], indent=2))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
