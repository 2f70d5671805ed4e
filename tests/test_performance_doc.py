"""docs/performance.md's commands run as written: every ``bench/`` script it names exists, and
each command line it gives parses with that script's own flags (none missing, none unknown)."""

from __future__ import annotations

import datetime
import re
import subprocess
import sys

import pytest

from tests.helpers.util import REPO

PAGE = REPO / "docs" / "performance.md"
# Stops a script right after its flags parse: the command is valid, nothing is run.
PARSE_ONLY = """
import argparse, os, runpy, sys
original = argparse.ArgumentParser.parse_args
def parse(self, args=None, namespace=None):
    original(self, args, namespace)
    print("PARSED", flush=True)
    os._exit(0)
argparse.ArgumentParser.parse_args = parse
script = sys.argv[1]
sys.argv = sys.argv[1:]
sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
runpy.run_path(script, run_name="__main__")
"""
# The page's placeholders, as a reader fills them in.
FILL = {"Z": "2", "CKPT": "/tmp/ckpt/global_step10", "R.json": "/tmp/r.json"}


def commands() -> list[str]:
    """Each command line of the page that runs a bench/ Python script, continuations joined."""
    text = PAGE.read_text(encoding="utf-8").replace("\\\n", " ")
    found = []
    for block in re.findall(r"```\n(.*?)```", text, re.S):
        found += [line.strip() for line in block.splitlines() if "bench/" in line]
    prose = re.sub(r"```\n.*?```", "", text, flags=re.S).splitlines()
    # indented blocks (inside a list item), then commands in running text (may wrap a line)
    found += [ln.strip() for ln in prose if ln.startswith("    ") and "bench/" in ln]
    inline = r"`([^`\n]*bench/\w+\.py[^`\n]*(?:\n[^`\n]*)?)`"
    found += [c for c in re.findall(inline, "\n".join(prose)) if " " in c]
    found = [c.split(" #")[0] for c in found]  # a trailing comment
    return [" ".join(c.split()) for c in dict.fromkeys(found) if re.search(r"bench/\w+\.py", c)]


def test_the_page_gives_commands():
    got = commands()
    assert len(got) >= 12, got
    assert any("bench_engine.py" in c for c in got) and any("bench_zero3.py" in c for c in got)


def parse(command: str) -> subprocess.CompletedProcess:
    """The command's script, run only until its flags parse."""
    words = command.split()
    at = next(i for i, w in enumerate(words) if re.fullmatch(r"bench/\w+\.py", w))
    script = REPO / words[at]
    assert script.exists(), command
    args = [FILL.get(w, w) for w in words[at + 1 :]]
    if "deepspeed" in words[:at]:
        args.append("--local_rank=0")  # what DeepSpeed's launcher adds (torchrun: the env)
    return subprocess.run(
        [sys.executable, "-c", PARSE_ONLY, str(script), *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip


@pytest.mark.bench
@pytest.mark.parametrize("command", commands())
def test_command_parses_as_written(command):
    r = parse(command)
    assert r.returncode == 0 and "PARSED" in r.stdout, (command, r.stderr[-2000:])


@pytest.mark.bench
def test_a_command_without_a_required_flag_fails():
    """The control: the resume benchmark's command without its ``--out`` does not parse."""
    r = parse("python bench/bench_resume.py --reps 6")
    assert r.returncode == 2 and "PARSED" not in r.stdout and "--out" in r.stderr, r.stderr


#: A summary row's last cell: when the result was measured, and the section with its command.
MEASURED = re.compile(r"\| (20\d\d-\d\d-\d\d), \[how\]\(#([\w-]+)\) \|$")


def slug(heading: str) -> str:
    """A heading's anchor as GitHub makes it: lower case, punctuation dropped, spaces to -."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def sections() -> dict[str, str]:
    text = PAGE.read_text(encoding="utf-8")
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return {slug(parts[i]): parts[i + 1] for i in range(1, len(parts), 2)}


def summary_rows() -> list[str]:
    lines = PAGE.read_text(encoding="utf-8").splitlines()
    at = lines.index("| bar | target | result | measured |")
    rows = []
    for line in lines[at + 2 :]:
        if not line.startswith("|"):
            break
        rows.append(line)
    return rows


def section_commands(body: str) -> list[str]:
    """The command lines of a section's code blocks."""
    lines = []
    for block in re.findall(r"```\w*\n(.*?)```", body.replace("\\\n", " "), re.S):
        lines += [ln.strip() for ln in block.splitlines() if ln.strip()]
    return [c for c in lines if re.search(r"bench/|pytest|wonderland ", c)]


def test_every_result_names_its_date_and_a_section_with_its_command():
    rows, found = summary_rows(), sections()
    assert len(rows) >= 20, rows
    for row in rows:
        m = MEASURED.search(row)
        assert m, f"no 'DATE, [how](#section)' cell: {row}"
        when = datetime.date.fromisoformat(m.group(1))
        assert datetime.date(2026, 11, 1) <= when <= datetime.date.today(), row
        assert m.group(2) in found, f"no section #{m.group(2)}: {row}"
        assert section_commands(found[m.group(2)]), f"#{m.group(2)} gives no command"


def test_a_row_without_its_section_or_date_is_caught():
    """The control: a row that lost its date, and one that points at no section."""
    assert not MEASURED.search("| a bar | <= 1x | met: 1.0x |")
    m = MEASURED.search("| a bar | <= 1x | met | 2026-12-01, [how](#no-such-section) |")
    assert m and m.group(2) not in sections()


SCRIPT = r"bench/\w+\.(?:py|sh)"
THIS = __file__.rsplit("/", 1)[1]
ALL = "bench/run_benchmarks.sh"  # runs the page's scripts one after another (hours)


def sources_of_tests() -> str:
    """The tests' text, this module's own left out (its controls name scripts)."""
    files = sorted((REPO / "tests").glob("test_*.py"))
    return "\n".join(f.read_text(encoding="utf-8") for f in files if f.name != THIS)


def not_started(scripts: set[str], tests: str) -> list[str]:
    """The scripts no test starts: a test names it as a string, or it is a helper (a model,
    the plain side, a plot) that a started script runs."""
    started = {s for s in scripts if f'"{s}"' in tests}
    helpers = "\n".join((REPO / s).read_text(encoding="utf-8") for s in started)
    return sorted(s for s in scripts - started if s.rsplit("/", 1)[1] not in helpers)


def test_every_script_the_page_names_is_run_by_a_test():
    """Each bench/ script the page names (in a command, a code block or running text) and each
    that `run_benchmarks.sh` runs is started by a test, at a small size."""
    scripts = set(re.findall(SCRIPT, PAGE.read_text(encoding="utf-8")))
    assert ALL in scripts
    scripts |= set(re.findall(SCRIPT, (REPO / ALL).read_text(encoding="utf-8")))
    scripts.discard(ALL)
    tests = sources_of_tests()
    missing = not_started(scripts, tests)
    assert len(scripts) >= 20 and not missing, f"no test runs: {missing}"


def test_a_script_no_test_starts_is_caught():
    """The control: with its test gone, a script and the helper only it runs are both found."""
    tests = sources_of_tests()
    gone = tests.replace('"bench/bench_causal_lm.py"', "")
    scripts = {"bench/bench_causal_lm.py", "bench/plain_causal_lm.py", "bench/bench_loader.py"}
    assert not_started(scripts, tests) == []
    assert not_started(scripts, gone) == ["bench/bench_causal_lm.py", "bench/plain_causal_lm.py"]
