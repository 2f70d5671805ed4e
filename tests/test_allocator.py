"""CPU ranks fix glibc's mmap threshold: freed large blocks go back to the system at once,
where glibc's default keeps them in its heap once a big free has raised its threshold. The
environment's own setting and the opt-out are respected, and run.json records what was done."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.util import REPO
from wonderland_ds.core.allocator import THRESHOLD, fix_threshold

PROBE = """
import json, sys
from wonderland_ds.core.allocator import fix_threshold
done = fix_threshold(True)
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
big = bytearray(16 << 20); del big  # a large free (<= 32 MiB): glibc raises its threshold
chunks = [bytearray(1 << 20) for _ in range(120)]
before = rss()
kept = chunks[::2]; del chunks                 # free every other 1 MiB block: holes
print(json.dumps({"done": done, "returned_mb": before - rss()}))
"""


def _probe(**env: str) -> dict:
    skip = ("MALLOC_", "WONDERLAND_CPU_MALLOC")
    full = {k: v for k, v in os.environ.items() if not k.startswith(skip)} | env
    done = subprocess.run(
        [sys.executable, "-c", PROBE], cwd=REPO, env=full, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_go_back_with_the_fixed_threshold_and_stay_without_it():
    fixed = _probe()
    assert fixed["done"] == {"mmap_threshold": THRESHOLD, "by": "wonderland (mallopt)"}
    glibc = _probe(WONDERLAND_CPU_MALLOC="glibc")
    assert glibc["done"]["mmap_threshold"] is None
    # 60 blocks of 1 MiB freed between kept ones: returned at once, or held as heap holes.
    assert fixed["returned_mb"] > 50, fixed
    assert glibc["returned_mb"] < 10, glibc


def test_the_environment_and_gpus_are_left_alone(monkeypatch):
    assert fix_threshold(False) == {"mmap_threshold": None, "by": "not a CPU rank"}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_threshold(True) == {"mmap_threshold": "65536", "by": "environment"}
