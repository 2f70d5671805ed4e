"""The worked example of docs/models-and-data.md, line by line as written there: raw jsonl ->
``wonderland tokenize`` -> a two-source mix -> stage 16 on another mix -> ``status``, whose
data line is the one the page shows."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.util import REPO

pytest.importorskip("transformers")

PAGE = REPO / "docs" / "models-and-data.md"


def _blocks() -> tuple[list[str], str]:
    """The example's command lines and the status line the page quotes."""
    text = PAGE.read_text()
    section = text.split("### Worked example", 1)[1].split("\n### ", 1)[0]
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", section, re.S | re.M)
    commands = [line for line in blocks[0].splitlines() if line.strip()]
    shown = [line.strip() for line in blocks[1].splitlines() if line.strip().startswith("data:")]
    return commands, shown[0]


@pytest.mark.examples
def test_the_worked_example_runs_as_written(tmp_path):
    commands, shown = _blocks()
    assert commands[0].startswith("python examples/data_mix/prepare.py")
    out = ""
    for line in commands:
        argv = shlex.split(line.replace("runs/mix", str(tmp_path / "mix")))
        if argv[0] == "python":
            argv[0] = sys.executable
        elif argv[0] == "wonderland":
            argv[:1] = [sys.executable, "-m", "wonderland_ds.cli.main"]
        done = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=400)
        assert done.returncode == 0, (line, (done.stdout + done.stderr)[-3000:])
        out = done.stdout + done.stderr
        if "pipeline" in argv:
            assert "INFO  [data-mix] stage 16 trains on data.stage_train.16" in out
    assert shown in out, out  # the last command, status, prints the page's line
