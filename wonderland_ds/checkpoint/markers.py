"""A rank's ``.done-rankR`` marker: its shards of a save are durable, and it carries the rank's
RNG states (the save's ``wonderland_rng.pt`` is written from every rank's marker)."""

from __future__ import annotations

import base64
import json
import os
import time
from pathlib import Path
from typing import Any

import torch


class MarkersMissing(TimeoutError):
    """Rank 0 waited for other ranks' markers in vain: a consequence of their failure (a
    ``.failed-rankR`` marker says so at once) or of a slow disk (the time limit)."""


def wait_for_markers(tag_dir: Path, world: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        done = [r for r in range(world) if (tag_dir / f".done-rank{r}").exists()]
        if len(done) == world:
            return
        failed = [r for r in range(world) if (tag_dir / f".failed-rank{r}").exists()]
        if failed:
            raise MarkersMissing(f"ranks {failed} failed writing {tag_dir.name}")
        if time.monotonic() > deadline:
            missing = sorted(set(range(world)) - set(done))
            raise MarkersMissing(
                f"ranks {missing} did not finish writing {tag_dir.name} within {timeout_s:.0f} s"
            )
        time.sleep(0.02)


def mark_failed(tag_dir: Path, rank: int) -> None:
    """This rank's write failed: an empty file (no data block, so it fits on a full disk) that
    stops rank 0's wait for this rank's marker at once. Best effort: the stop is agreed anyway."""
    try:
        (tag_dir / f".failed-rank{rank}").touch()
    except OSError:
        pass


def rng_states() -> dict[str, Any]:
    """This process's RNG states (torch CPU, numpy, python), as saved in wonderland_rng.pt."""
    import random

    import numpy as np

    return {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(legacy=True)[1].copy(),  # type: ignore[index]
        "python": repr(random.getstate()),
    }


def _encode_rng(rng: dict[str, Any]) -> dict[str, Any]:
    return {
        "torch": base64.b64encode(rng["torch"].numpy().tobytes()).decode(),
        "numpy": [int(v) for v in rng["numpy"]],
        "python": rng["python"],
    }


def _decode_rng(body: dict[str, Any]) -> dict[str, Any]:
    import numpy as np

    raw = bytearray(base64.b64decode(body["torch"]))
    return {
        "torch": torch.frombuffer(raw, dtype=torch.uint8).clone(),
        # A uint32 tensor, not an ndarray: the file then loads with weights_only=True
        # (an ndarray's dtype class is not on torch's allowlist).
        "numpy": torch.from_numpy(np.asarray(body["numpy"], dtype=np.uint32)),
        "python": body["python"],
    }


def mark_done(tag_dir: Path, rank: int, rng: dict[str, Any]) -> None:
    """This rank's shards are durable: the marker (atomic, fsynced) carries its RNG states."""
    marker = tag_dir / f".done-rank{rank}"
    tmp = tag_dir / f".done-rank{rank}.tmp"
    with open(tmp, "w") as fh:
        json.dump(_encode_rng(rng), fh)
        fh.flush()
        os.fsync(fh.fileno())
    os.replace(tmp, marker)


def read_markers(tag_dir: Path, world: int) -> list[dict[str, Any]]:
    """Every rank's RNG states from its marker (after :func:`wait_for_markers`). A marker
    without them fails the save (the RNG file is never written with a rank missing)."""
    out = []
    for r in range(world):
        text = (tag_dir / f".done-rank{r}").read_text()
        try:
            out.append(_decode_rng(json.loads(text)))
        except (ValueError, KeyError, TypeError) as exc:
            raise OSError(f"rank {r}'s marker in {tag_dir} holds no RNG states: {exc}") from None
    return out
