"""``wonderland.cpu_mmap_threshold`` fixes glibc's mmap threshold on CPU ranks: freed large
blocks go back to the system at once, where glibc's default keeps them in its heap once a big
free has raised its threshold. The environment's own setting wins; run.json records what holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.helpers.util import REPO
from wonderland_ds.core.allocator import fix_threshold

PROBE = """
import json, sys
from wonderland_ds.core.allocator import fix_threshold
done = fix_threshold(True, None if sys.argv[1] == "none" else int(sys.argv[1]))
def rss():
    for line in open("/proc/self/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
big = bytearray(30 << 20); del big  # a large free (<= 32 MiB): glibc raises its threshold
chunks = [bytearray(20 << 20) for _ in range(8)]
before = rss()
kept = chunks[::2]; del chunks                 # free every other 20 MiB block: holes
print(json.dumps({"done": done, "returned_mb": before - rss()}))
"""


def _probe(threshold: str) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        [sys.executable, "-c", PROBE, threshold], cwd=REPO, env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_freed_blocks_go_back_with_the_fixed_threshold_and_stay_without_it():
    fixed = _probe(str(16 << 20))
    assert fixed["done"] == {
        "mmap_threshold": 16 << 20, "by": "wonderland.cpu_mmap_threshold (mallopt)",
    }  # fmt: skip
    glibc = _probe("none")
    assert glibc["done"] == {"mmap_threshold": None, "by": "glibc's default (dynamic)"}
    # 4 blocks of 20 MiB freed between kept ones: returned at once, or held as heap holes.
    assert fixed["returned_mb"] > 70, fixed
    assert glibc["returned_mb"] < 10, glibc


def test_the_environment_and_gpus_are_left_alone(monkeypatch):
    assert fix_threshold(False, 131072) == {"mmap_threshold": None, "by": "not a CPU rank"}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert fix_threshold(True, 131072) == {"mmap_threshold": "65536", "by": "environment"}
