"""Boundaries no other test sits on: the stage-16 warmup minimum (preflight and config rule),
stage 17's minority recall floor, and `latest` written atomically.

Each test here fails on one plausible one-character bug (``>=`` turned into ``>``, a check
nested under another, a plain ``open('w')``) that the rest of the suite lets through.
"""

from __future__ import annotations

import builtins
import io
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.test_check_configs import mutate, run_json, write
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.eval.evaluate import gate
from wonderland_ds.run import preflight

# ------------------------------------------------------------ stage-16 warmup: the boundary


def _plan(run: Path, min_warmup: int) -> preflight.Plan:
    """Stage 16's preflight of the run's stage-15 checkpoint, with the data rules satisfied
    from the checkpoint's own metadata (only the warmup rule is under test)."""
    root = run / "stage15" / "checkpoints"
    named = ck.read_latest(root)
    assert named is not None
    meta = ck.read_meta(root / named)
    assert meta is not None and meta.data is not None
    return preflight.check(
        16,
        "auto",
        run,
        min_warmup=min_warmup,
        seed=meta.data.seed,
        fingerprint=meta.data.fingerprint,
        world_size=meta.world_size,
        zero_stage=meta.zero_stage,
        precision=meta.precision,
    )


def _warmup(plan: preflight.Plan) -> list[str]:
    return [f.severity for f in plan.findings if f.rule == "warmup-behind"]


@pytest.mark.slow
def test_preflight_accepts_exactly_min_warmup_steps_behind(stage15_fp32):
    """The checkpoint has N warmup steps behind it: a minimum of N passes, N + 1 refuses."""
    tag = stage15_fp32 / "stage15" / "checkpoints" / "global_step40"
    behind = json.loads((tag / ck.META).read_text())["warmup_progress"]
    assert behind == 40  # 40 steps of stage 15, a warmup scheduler from step 1

    at = _plan(stage15_fp32, behind)
    assert _warmup(at) == ["ok"], [f.to_dict() for f in at.findings]
    assert not [f for f in at.findings if f.severity == "error"]
    assert at.source == tag

    over = _plan(stage15_fp32, behind + 1)
    assert _warmup(over) == ["error"]
    (refusal,) = [f for f in over.findings if f.rule == "warmup-behind"]
    assert f"only {behind} LR-warmup steps" in refusal.message
    assert f"needs {behind + 1}" in refusal.message


@pytest.mark.parametrize(
    ("warmup", "minimum", "refused"),
    [(500, None, False), (499, None, True), (300, 300, False), (299, 300, True)],
)
def test_config_rule_accepts_warmup_equal_to_the_minimum(
    capsys, tmp_path, warmup, minimum, refused
):
    """`wonderland check --stage 16`: warmup_num_steps equal to the minimum (the default 500,
    or wonderland.min_warmup_steps) is enough; one less is refused."""
    changes = {"scheduler.params.warmup_num_steps": warmup}
    if minimum is not None:
        changes["wonderland.min_warmup_steps"] = minimum
    path = write(tmp_path, mutate(changes))
    rc, findings = run_json(capsys, str(path), "--world-size", "8", "--stage", "16")
    hits = [f for f in findings if f["rule"] == "stage16-warmup"]
    assert bool(hits) is refused, findings
    assert rc == (2 if refused else 0), findings


# ------------------------------------------------------------ stage 17: minority recall floor


def _per_class(recalls: list[float]) -> dict:
    return {"per_class": [{"class": c, "recall": r} for c, r in enumerate(recalls)]}


def test_minority_floor_fails_the_gate_without_a_drop_past_the_margin():
    """Class 3 (a minority) was already weak at stage 15 and lost only 0.05 of recall, within
    the 0.25 margin: it is still under the 0.5 floor, and the floor alone fails the gate."""
    task = SimpleNamespace(minority_classes=(3, 8), num_classes=10)
    base = _per_class([1.0, 1.0, 1.0, 0.45, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    new = _per_class([1.0, 1.0, 1.0, 0.40, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    findings, failed = gate(task, new, base, 0.25, 0.5)
    assert failed == [3]
    assert [(f.rule, f.severity) for f in findings] == [("gate-minority-floor", "error")]
    assert "minority class 3" in findings[0].message

    # A majority class at the same recall is not held to the floor.
    low_majority = _per_class([1.0, 1.0, 0.40, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    base_majority = _per_class([1.0, 1.0, 0.45, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    findings, failed = gate(task, low_majority, base_majority, 0.25, 0.5)
    assert failed == [] and [f.severity for f in findings] == ["ok"]


def test_minority_exactly_at_the_floor_passes():
    task = SimpleNamespace(minority_classes=(3, 8), num_classes=10)
    at_floor = _per_class([1.0, 1.0, 1.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.5, 1.0])
    findings, failed = gate(task, at_floor, at_floor, 0.25, 0.5)
    assert failed == [] and [f.severity for f in findings] == ["ok"]


# ------------------------------------------------------------ `latest` is replaced atomically


class Crash(BaseException):
    """The process dies here (a BaseException: nothing may catch and carry on)."""


def _writes(mode: str | int) -> bool:
    if isinstance(mode, int):  # os.open flags
        return bool(mode & (os.O_WRONLY | os.O_RDWR | os.O_TRUNC | os.O_CREAT))
    return any(c in mode for c in "wax+")


@pytest.fixture
def crash_after_open(monkeypatch):
    """Every file opened for writing under ``root`` is opened, and then the process "dies"
    before one byte is written: a file rewritten in place is left truncated."""
    state = SimpleNamespace(root=None, opened=[])
    real_open, real_os_open = builtins.open, os.open

    def under_root(path) -> bool:
        return state.root is not None and Path(os.fspath(path)).parent == state.root

    def fake_open(file, mode="r", *args, **kwargs):
        fh = real_open(file, mode, *args, **kwargs)
        if not isinstance(file, int) and under_root(file) and _writes(mode):
            state.opened.append(Path(os.fspath(file)).name)
            fh.close()
            raise Crash(file)
        return fh

    def fake_os_open(path, flags, *args, **kwargs):
        fd = real_os_open(path, flags, *args, **kwargs)
        if under_root(path) and _writes(flags):
            state.opened.append(Path(os.fspath(path)).name)
            os.close(fd)
            raise Crash(path)
        return fd

    monkeypatch.setattr(builtins, "open", fake_open)
    monkeypatch.setattr(io, "open", fake_open)  # pathlib opens through io.open
    monkeypatch.setattr(os, "open", fake_os_open)
    return state


def test_latest_survives_a_crash_between_open_and_write(tmp_path, crash_after_open):
    root = tmp_path / "checkpoints"
    root.mkdir()
    ck.set_latest(root, "global_step10")
    assert ck.read_latest(root) == "global_step10"

    crash_after_open.root = root
    with pytest.raises(Crash):
        ck.set_latest(root, "global_step20")
    crash_after_open.root = None
    assert crash_after_open.opened, "set_latest wrote no file under the checkpoint root"
    # Whatever was opened, readers still see the old, complete tag.
    assert ck.read_latest(root) == "global_step10"
    assert (root / ck.LATEST).read_text() == "global_step10"


def test_latest_is_replaced_whole_and_leaves_no_temporary(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    ck.set_latest(root, "global_step10")
    inode = (root / ck.LATEST).stat().st_ino
    ck.set_latest(root, "global_step20")
    assert ck.read_latest(root) == "global_step20"
    # A rename puts a new file in place; a rewrite in place keeps the inode.
    assert (root / ck.LATEST).stat().st_ino != inode
    assert sorted(p.name for p in root.iterdir()) == [ck.LATEST]
