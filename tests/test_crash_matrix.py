"""Killed during a checkpoint save, at every point of the save protocol.

Each point is a real SIGKILL of a forked process that runs the production save protocol
(async_ckpt.Writer for each rank's shards, the ``.done-rankR`` markers, checkpoint.finalize,
retention) with a hook that kills it at the k-th point. After each kill, `latest` must name a
complete checkpoint that verifies and loads, and the newest complete checkpoint must survive.
The real DeepSpeed path is covered by tests/test_reliability.py and tests/test_engine.py.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import torch

from wonderland_ds.checkpoint import async_save as async_ckpt
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint import markers
from wonderland_ds.checkpoint.describe import safe_load

WORLD, FILES_PER_RANK = 2, 4


def save(root: Path, step: int, hook) -> None:
    """What engine.save does after DeepSpeed's save_checkpoint hands over the shards."""
    tag_dir = root / ck.tag_for(step)
    tag_dir.mkdir(parents=True, exist_ok=True)
    writers = [async_ckpt.Writer(hook) for _ in range(WORLD)]
    for rank, w in enumerate(writers):
        for i in range(FILES_PER_RANK):
            w.write(
                {"w": torch.full((256,), float(step * 10 + i))},
                str(tag_dir / f"zero_pp_rank_{rank}_shard{i}.pt"),
                True,
            )
        w.submit(lambda rank=rank: markers.mark_done(tag_dir, rank, markers.rng_states()))
    meta = {"global_step": step, "stage": 15}
    writers[0].submit(
        lambda: ck.finalize(root, tag_dir, WORLD, meta, keep_last=1, timeout_s=30, hook=hook)
    )
    for w in writers:
        w.wait()
        w.close()


def count_points(root: Path) -> list[str]:
    calls: list[str] = []
    save(root, 10, lambda p: None)
    save(root, 20, calls.append)  # the same save the matrix kills: it also retires step 10
    return calls


def test_every_kill_point_leaves_latest_on_a_complete_checkpoint(tmp_path):
    names = count_points(tmp_path / "count")
    points = len(names)
    assert points >= 29, names  # 8 files x 3 points, finalize's 4, retention's rename
    assert {
        "before-file",
        "mid-file",
        "after-file",
        "after-shards",
        "before-meta",
        "before-latest",
        "after-latest",
        "retain-renamed",
    } <= set(names)
    ok = 0
    for k in range(1, points + 1):
        root = tmp_path / f"k{k}"
        save(root, 10, lambda p: None)  # the previous complete checkpoint
        pid = os.fork()
        if pid == 0:  # the child saves step 20 and is SIGKILLed at point k
            n = [0]

            def hook(point: str, n: list[int] = n, k: int = k) -> None:
                n[0] += 1
                if n[0] == k:
                    os.kill(os.getpid(), signal.SIGKILL)

            try:
                save(root, 20, hook)
            finally:
                os._exit(0)  # only reached when the kill point was never hit
        _, status = os.waitpid(pid, 0)
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, k
        latest = ck.read_latest(root)
        assert latest in ("global_step10", "global_step20"), (k, latest)
        v = ck.verify(root / latest)
        assert v.complete, (k, v.findings)
        for name in v.meta.files:  # every file loads (the RNG file has numpy arrays)
            obj, why = safe_load(root / latest / name)
            assert obj is not None, (k, name, why)
        # latest may lag the newest complete checkpoint (killed between the metadata and
        # latest); --resume auto then takes the newer one. Nothing complete was deleted.
        newest = ck.newest_complete(root)
        assert newest is not None and newest.tag_dir.name >= latest, k
        ok += 1
    assert ok == points
    print(f"kill points survived: {ok}/{points}")
