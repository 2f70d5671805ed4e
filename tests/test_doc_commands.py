"""Every ``pytest`` command the README and docs give for a row or a figure selects the tests it
names: collected as written, at least one test, and each ``-k`` alternative matching one."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys

import pytest

from tests.helpers.util import REPO

PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def doc_commands() -> list[str]:
    """The pytest commands that name a test file (a bare ``-m family`` is CI's own step)."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8").replace("\\\n", " ")
        for block in re.findall(r"```\w*\n(.*?)```", text, re.S):
            found += [ln.strip() for ln in block.splitlines()]
        found += re.findall(r"`([^`\n]*\bpytest [^`\n]*)`", text)
    found = [re.sub(r"^(\.venv/bin/)?", "", c.split(" #")[0]) for c in found]
    return list(dict.fromkeys(c for c in found if c.startswith("pytest ") and "tests/" in c))


def collect(command: str) -> tuple[int, list[str], str]:
    """The command's selection, collected only: its exit code, node ids and output."""
    words = [w for w in shlex.split(command)[1:] if w != "-s"]
    r = subprocess.run(
        [sys.executable, "-m", "pytest", *words, "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    ids = [ln for ln in r.stdout.splitlines() if "::" in ln and not ln.startswith(" ")]
    return r.returncode, ids, r.stdout + r.stderr


def k_terms(command: str) -> list[str]:
    """The words of a ``-k "a or b"`` expression (none for anything more complex)."""
    words = shlex.split(command)
    if "-k" not in words:
        return []
    expr = words[words.index("-k") + 1]
    terms = [t.strip() for t in expr.split(" or ")]
    return terms if all(re.fullmatch(r"\w+", t) for t in terms) else []


def test_the_docs_give_commands():
    got = doc_commands()
    assert len(got) >= 10, got
    assert any("-k" in c for c in got) and any("::" in c for c in got)


@pytest.mark.slow
@pytest.mark.parametrize("command", doc_commands())
def test_command_selects_the_tests_it_names(command):
    rc, ids, out = collect(command)
    assert rc == 0 and ids, f"{command}: nothing collected\n{out[-2000:]}"
    for term in k_terms(command):
        assert any(term in i for i in ids), f"{command}: -k {term!r} matches no test"


@pytest.mark.slow
def test_a_test_that_is_not_there_is_caught():
    """The control: a node id that does not exist, and a -k term that matches nothing."""
    rc, ids, _ = collect("pytest tests/test_docs.py::test_no_such_test")
    assert rc != 0 and not ids
    command = 'pytest tests/test_docs.py -k "readme_is_short or no_such_words"'
    rc, ids, _ = collect(command)
    assert rc == 0 and ids and not any("no_such_words" in i for i in ids)
    assert k_terms(command) == ["readme_is_short", "no_such_words"]
