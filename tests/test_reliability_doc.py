"""docs/reliability.md: its counts are the tests' own, and it stays a page about this repo."""

from __future__ import annotations

import re

from tests.helpers import reliability_counts as rc


def test_counts_block_matches_what_the_tests_enumerate():
    page = rc.PAGE.read_text(encoding="utf-8")
    assert page.count(rc.BEGIN) == 1 and page.count(rc.END) == 1
    fresh = rc.render()
    assert rc.block(page) == fresh, (
        "docs/reliability.md's counts are stale: run python -m tests.helpers.reliability_counts"
    )
    c = rc.counts()
    assert c["refused"] == c["configs"] + c["hostfiles"] + c["damaged"] + c["flags"]
    assert min(c.values()) > 0


def test_counts_follow_a_new_case():
    """Adding a case to a sweep changes the rendered block (it is computed, not copied)."""
    c = rc.counts()
    bumped = dict(c, flags=c["flags"] + 1, refused=c["refused"] + 1)
    assert rc.render(bumped) != rc.render(c)
    assert f"| {c['flags'] + 1} |" in rc.render(bumped)


def test_page_has_no_hand_written_tallies_dates_or_outside_files():
    page = rc.PAGE.read_text(encoding="utf-8")
    prose = page.replace(rc.block(page), "")
    # A tally such as "157/157" or "**90** configs" outside the generated block goes stale.
    assert not re.findall(r"\b\d+/\d+\b", prose)
    assert not re.findall(r"\*\*\d+\*\* \w+", prose)
    months = "January|February|March|April|May|June|July|August|September|October|November|December"
    assert not re.findall(rf"\b\d{{1,2}} ({months}) \d{{4}}\b|\b\d{{4}}-\d{{2}}-\d{{2}}\b", prose)
    for outside in ("FACTS.md", "DESIGN.md", "issue "):
        assert outside not in page, outside
