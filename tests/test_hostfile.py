"""Hostfiles: refused with the line named, and never laxer than DeepSpeed's own parser.

DeepSpeed's launcher (``deepspeed.launcher.runner._parse_hostfile``) is imported once per
module; importing it pulls in torch (seconds).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.conftest import REPO
from wonderland_ds.cli import main as cli
from wonderland_ds.config import hostfile

SHIPPED = sorted(p for p in (REPO / "hostfiles").iterdir() if p.is_file())


@pytest.fixture(scope="module")
def ds_parse():
    from deepspeed.launcher.runner import _parse_hostfile

    return _parse_hostfile


def ds_result(ds_parse, text: str) -> dict[str, int] | None:
    """DeepSpeed's host -> slots for the text, None if it refuses it (as the launcher reads)."""
    try:
        return dict(ds_parse(text.splitlines(keepends=True)))
    except ValueError:
        return None


@dataclass(frozen=True)
class BadHostfile:
    id: str
    text: str
    where: str
    """The finding's path: 'line N', or '' when the file as a whole is wrong."""
    needle: str
    ds_rejects: bool
    """What DeepSpeed's own parser does with it (we refuse all of them)."""


BROKEN = [
    BadHostfile("spaces-around-equals", "node-1 slots = 8\n", "line 1", "no spaces", True),
    BadHostfile("bare-host", "# hosts\nnode-1\n", "line 2", "bad entry 'node-1'", True),
    BadHostfile(
        "duplicate-host",
        "node-1 slots=8\nnode-2 slots=8\n\nnode-1 slots=4\n",
        "line 4",
        "listed twice",
        True,
    ),
    BadHostfile("slots-zero", "node-1 slots=8\nnode-2 slots=0\n", "line 2", "slots=0", False),
    BadHostfile("slots-double-zero", "node-1 slots=00\n", "line 1", "slots=0", False),
    BadHostfile("empty", "", "", "no hosts", True),
    BadHostfile("blank-lines-only", "\n\n   \n", "", "no hosts", True),
    BadHostfile("comments-only", "# node-1 slots=8\n  # node-2 slots=8\n", "", "no hosts", True),
    BadHostfile("semicolon", "node-1;reboot slots=8\n", "line 1", "not allowed", False),
    BadHostfile("command-substitution", "$(reboot) slots=8\n", "line 1", "not allowed", False),
    BadHostfile("backtick", "`id` slots=8\n", "line 1", "not allowed", False),
    BadHostfile("pipe", "node|sh slots=8\n", "line 1", "not allowed", False),
    BadHostfile("ampersand", "node&& slots=8\n", "line 1", "not allowed", False),
    BadHostfile("quote", "'node' slots=8\n", "line 1", "not allowed", False),
    BadHostfile("trailing-junk", "node-1 slots=2 gpus=4\n", "line 1", "'gpus=4'", False),
    BadHostfile("digits-then-junk", "node-1 slots=2x\n", "line 1", "'x'", False),
    BadHostfile("slots-not-a-number", "node-1 slots=x\n", "line 1", "bad entry", True),
    BadHostfile("slots-negative", "node-1 slots=-2\n", "line 1", "bad entry", True),
    BadHostfile("slots-empty", "node-1 slots=\n", "line 1", "bad entry", True),
    BadHostfile("slot-singular", "node-1 slots=8\nnode-2 slot=8\n", "line 2", "bad entry", True),
    BadHostfile("mpi-style", "node-1:8\n", "line 1", "bad entry", True),
    BadHostfile("bad-line-after-blanks", "\n\nnode-1 slots=8\n\nnode-2\n", "line 5", "", True),
]


def test_corpus_is_large_and_ids_unique() -> None:
    assert len(BROKEN) >= 10
    assert len({c.id for c in BROKEN}) == len(BROKEN)


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.id)
def test_broken_hostfile(case: BadHostfile, tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text(case.text, encoding="utf-8")
    hf, findings = hostfile.parse(path)
    assert hf is None
    assert findings and all(f.severity == "error" for f in findings)
    assert all(f.rule == "hostfile" and f.file == str(path) and f.fix for f in findings)
    assert case.where in [f.path for f in findings]
    assert any(case.needle in f.message for f in findings), [f.message for f in findings]


@pytest.mark.parametrize("case", BROKEN, ids=lambda c: c.id)
def test_broken_hostfile_vs_deepspeed(case: BadHostfile, ds_parse) -> None:
    """Whatever DeepSpeed refuses we refuse; the rest we refuse on top (documented per case)."""
    assert (ds_result(ds_parse, case.text) is None) is case.ds_rejects


def test_all_problems_reported_at_once(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a slots=1\nb slots = 2\nc slots=0\na slots=1\n`x` slots=1 junk\n")
    hf, findings = hostfile.parse(path)
    assert hf is None
    assert sorted({f.path for f in findings}) == ["line 2", "line 3", "line 4", "line 5"]
    assert len([f for f in findings if f.path == "line 5"]) == 2  # junk and the backticks


@pytest.mark.parametrize("kind", ["missing", "directory", "non-utf8"])
def test_unreadable_hostfile(kind: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "hosts"
    if kind == "directory":
        path.mkdir()
    elif kind == "non-utf8":
        path.write_bytes(b"n\xf6de slots=8\n")
    hf, findings = hostfile.parse(path)
    assert hf is None
    assert [(f.rule, f.severity, f.path) for f in findings] == [("hostfile", "error", "")]
    needle = {"missing": "does not exist", "directory": "directory", "non-utf8": "cannot be read"}
    assert needle[kind] in findings[0].message
    config = REPO / "ds_configs" / "cpu_zero2_bf16.json"
    assert cli.main(["check", str(config), "--hostfile", str(path)]) == 2
    out = capsys.readouterr()
    assert "Traceback" not in out.err
    assert f"ERROR [hostfile] {path}:" in out.out


# ---------------------------------------------------------------- agreement with DeepSpeed


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_shipped_hostfile_same_as_deepspeed(path: Path, ds_parse) -> None:
    hf, findings = hostfile.parse(path)
    assert hf is not None, findings
    with path.open() as fd:
        assert dict(ds_parse(fd.readlines())) == hf.hosts
    assert hf.world_size == sum(hf.hosts.values()) > 0


#: Lines around the grammar's edges: whenever we accept, DeepSpeed accepts with the same slots.
EDGE_CASES = [
    "node slots=8",
    "  node slots=8  ",
    "node\tslots=8",
    "node  \t slots=16",
    "node slots=8 # the big one",
    "node slots=8\r",
    "10.0.0.1 slots=4",
    "user@node-1.example.com slots=4",
    "[fe80::1] slots=4",
    "node_1 slots=4",
    "node slots=8\n# c\nnode2 slots=1",
    "node slots=08",
    "node slots=8slots=9",
    "node slots=8 slots=9",
    "node slots =8",
    "node slots= 8",
    "node Slots=8",
    "node SLOTS=8",
    "slots=8",
    "node slots=+8",
    "node slots=8.0",
    "node slots=1e3",
    "node #slots=8",
    "#node slots=8\nnode slots=2",
    "node slots=8\nnode slots=8",
    "node slots=8\nNODE slots=8",
    "node,node2 slots=8",
    "node*\tslots=8",
    "\ufeffnode slots=8",
]


@pytest.mark.parametrize("text", EDGE_CASES)
def test_never_laxer_than_deepspeed(text: str, tmp_path: Path, ds_parse) -> None:
    path = tmp_path / "hosts"
    path.write_text(text + "\n", encoding="utf-8")
    hf, findings = hostfile.parse(path)
    theirs = ds_result(ds_parse, text + "\n")
    if theirs is None:
        assert hf is None, f"DeepSpeed refuses {text!r}, we accepted it"
    if hf is not None:
        assert hf.hosts == theirs
    else:
        assert any(f.severity == "error" and f.fix for f in findings)


def test_edge_cases_exercise_both_outcomes(tmp_path: Path, ds_parse) -> None:
    """The edge cases are not all accepted or all refused (the test above would be vacuous)."""
    ours = []
    for i, text in enumerate(EDGE_CASES):
        path = tmp_path / f"h{i}"
        path.write_text(text + "\n", encoding="utf-8")
        ours.append(hostfile.parse(path)[0] is not None)
    theirs = [ds_result(ds_parse, t + "\n") is not None for t in EDGE_CASES]
    assert 8 <= sum(ours) < len(EDGE_CASES)
    assert sum(theirs) > sum(ours)  # we are stricter somewhere
    assert sum(not t for t in theirs) >= 5  # and DeepSpeed refuses several
