"""The README and docs/ read as a manual: short README, its two commands first, no dated log or
issue numbers, and every link and repository path they name exists."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
PAGES = [README, *sorted((REPO / "docs").glob("*.md"))]

#: Top-level folders whose paths the docs name in backticks and code blocks.
PATH_ROOTS = ("docs", "wonderland_ds", "bench", "ds_configs", "hostfiles", "examples", "tests")
#: Files that notes and old docs cited; a citation is wrong wherever the file is not there.
CITED = ("FACTS.md", "DESIGN.md", "BENCHMARKS.md", "RELIABILITY.md")

_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.S | re.M)
_SPAN = re.compile(r"`([^`\n]+)`")
_LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
_ISSUE = re.compile(r"#\d+\b")
_UPSTREAM = re.compile(r"[\w.-]+/[\w.-]+$")
_HEADING = re.compile(r"^#{1,6} .*$", re.M)
_DATE = re.compile(
    r"\b20\d\d-\d\d(-\d\d)?\b|\b\d{1,2} (January|February|March|April|May|June|July|August"
    r"|September|October|November|December) 20\d\d\b"
)
#: docs/performance.md's summary rows end with the date each result was measured, by design.
_MEASURED = re.compile(r"\| 20\d\d-\d\d-\d\d, \[how\]\(#[\w-]+\) \|$", re.M)
_SESSION = re.compile(
    r"\b(this|that|next|previous|earlier|later|last|first|second|third|fourth|fifth|sixth"
    r"|seventh|eighth|ninth|tenth|eleventh|twelfth)\s+session\b",
    re.I,
)


def _text(path: Path) -> str:
    return path.read_text(encoding="utf-8")


def _rel(path: Path) -> str:
    return str(path.relative_to(REPO))


def _prose(text: str) -> str:
    """The text without fenced code blocks (headings inside them are shell comments)."""
    return _FENCE.sub("", text)


def _code_pieces(text: str) -> list[str]:
    """Inline code spans and fenced blocks: where repository paths are named."""
    return [m.group(1) for m in _FENCE.finditer(text)] + _SPAN.findall(_prose(text))


def _repo_paths(text: str) -> set[str]:
    found = set()
    for piece in _code_pieces(text):
        for token in re.split(r"[\s\"'=(),]+", piece):
            token = token.split("::")[0].rstrip(".,;:`")
            if not token.startswith(tuple(f"{r}/" for r in PATH_ROOTS)):
                continue
            if any(c in token for c in "*{}<>[]|$"):  # a pattern or a placeholder
                continue
            found.add(token)
    return found


def test_readme_is_short():
    lines = _text(README).splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines (at most 250; aim for 200)"


def test_readme_opens_with_the_two_commands_and_ci_runs_the_second():
    block = _FENCE.search(_text(README))
    assert block is not None, "README.md has no code block"
    assert _text(README)[: block.start()].strip() == "# wonderland_ds", (
        "the two commands are the first thing after the title"
    )
    commands = block.group(1).strip().splitlines()
    assert len(commands) == 2, f"the first code block holds the two commands: {commands}"
    run, test = commands
    assert run.startswith("python3 -m venv .venv") and "wonderland pipeline" in run
    assert "pytest" in test
    ci = [line.strip() for line in _text(REPO / ".ci" / "run").splitlines()]
    assert test in ci, ".ci/run must run the README's test command verbatim"


def test_no_issue_numbers():
    bad = []
    for page in PAGES:
        for n, line in enumerate(_text(page).splitlines(), 1):
            for m in _ISSUE.finditer(line):
                if not _UPSTREAM.search(line[: m.start()]):
                    bad.append(f"{_rel(page)}:{n}: {m.group()} (name the upstream owner/repo#N)")
            for m in re.finditer(r"\bissues? \d+\b", line, re.I):
                bad.append(f"{_rel(page)}:{n}: {m.group()}")
    assert not bad, "issue numbers in the docs:\n" + "\n".join(bad)


def test_no_dated_log_or_session_talk():
    bad = []
    for page in PAGES:
        text = _prose(_text(page))
        if page.name == "performance.md":
            text = _MEASURED.sub("|", text)
        for heading in _HEADING.findall(text):
            if _DATE.search(heading) or re.search(r"re-?run on|session", heading, re.I):
                bad.append(f"{_rel(page)}: heading {heading!r}")
        for pattern in (_DATE, _SESSION, re.compile(r"\bre-run on\b", re.I)):
            for m in pattern.finditer(text):
                bad.append(f"{_rel(page)}: {m.group()!r}")
    assert not bad, "a manual states what is, not when it was found:\n" + "\n".join(bad)


def test_links_and_repository_paths_exist():
    missing = []
    for page in PAGES:
        text = _text(page)
        for target in _LINK.findall(_prose(text)):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue  # a web address or an anchor on the same page
            if not (page.parent / target.split("#")[0]).exists():
                missing.append(f"{_rel(page)}: link {target}")
        for path in sorted(_repo_paths(text)):
            if not (REPO / path).exists():
                missing.append(f"{_rel(page)}: path {path}")
    assert not missing, "the docs name what is not in the repository:\n" + "\n".join(missing)


def test_docs_cite_no_missing_files():
    bad = []
    for page in PAGES:
        text = _text(page)
        for name in CITED:
            if not (REPO / name).exists() and re.search(rf"\b{re.escape(name)}", text):
                bad.append(f"{_rel(page)}: {name}")
        if "../shared" in text:
            bad.append(f"{_rel(page)}: ../shared (outside the repository)")
    assert not bad, "the docs cite files that do not exist:\n" + "\n".join(bad)


def test_code_cites_no_missing_files():
    """The package's comments and docstrings cite no notes file that is not in the repository."""
    bad = []
    for source in sorted((REPO / "wonderland_ds").rglob("*.py")):
        for n, line in enumerate(_text(source).splitlines(), 1):
            for name in CITED:
                if name in line and not (REPO / name).exists():
                    bad.append(f"{_rel(source)}:{n}: {name}")
            if "../shared" in line:
                bad.append(f"{_rel(source)}:{n}: ../shared")
    assert not bad, "code cites files that do not exist:\n" + "\n".join(bad)
