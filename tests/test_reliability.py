"""The fault-injection matrix, rows 3, 5, 7, 8 and 9 (docs/reliability.md).

Rows 1, 2, 4 and 6 (kills and disk-full during saves, retention) belong to the async-save
work. Everything here goes through `wonderland train` as a user runs it: in-process through
``cli.main`` where the front refuses before launching (fast), through a subprocess where only a
real process can show it (no traceback, a hung rank).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tests.conftest import REPO, TINY32
from tests.helpers.util import snapshot, wonderland
from tests.test_check_configs import BROKEN as BROKEN_CONFIGS
from tests.test_check_configs import MALFORMED, mutate
from tests.test_hostfile import BROKEN as BROKEN_HOSTFILES
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.cli import main as cli
from wonderland_ds.cli.train import build_train_parser
from wonderland_ds.launch.flags import overrides
from wonderland_ds.run import manifest

STAGE16 = ["--stage", "16", "--optimizer-state", "--scheduler-state"]
MODEL = "mp_rank_00_model_states.pt"
OPTIM0 = "zero_pp_rank_0_mp_rank_00_optim_states.pt"
OPTIM1 = "zero_pp_rank_1_mp_rank_00_optim_states.pt"
RNG = "wonderland_rng.pt"
HANG_CONFIG = REPO / "tests" / "configs" / "tiny_hang_pg20.json"


# ------------------------------------------------------------------------------- helpers


def train(capsys, argv: list[str]) -> tuple[int, str, str]:
    """`wonderland train ARGV` in this process: (exit code, stdout, stderr). An argparse
    refusal is a SystemExit, as it is for the user."""
    try:
        rc = cli.main(["train", *argv])
    except SystemExit as exc:
        rc = exc.code if isinstance(exc.code, int) else 1
    out = capsys.readouterr()
    return rc, out.out, out.err


def refused(capsys, argv: list[str], watch: list[Path]) -> str:
    """Exit 2, no traceback, and every watched tree exactly as it was; returns stderr."""
    before = {str(p): snapshot(p) for p in watch}
    rc, out, err = train(capsys, argv)
    assert rc == 2, (out + err)[-3000:]
    assert "Traceback" not in out + err
    assert {str(p): snapshot(p) for p in watch} == before  # nothing written, moved or deleted
    return err


def copy_tag(stage15: Path, dest_root: Path, tag: str = "global_step40") -> Path:
    dest_root.mkdir(parents=True, exist_ok=True)
    dest = dest_root / tag
    shutil.copytree(stage15 / "stage15" / "checkpoints" / tag, dest)
    ck.set_latest(dest_root, tag)
    return dest


def rehash(tag_dir: Path) -> None:
    """Rewrite the metadata's checksums so that only the intended defect is left."""
    old = json.loads((tag_dir / ck.META).read_text())
    (tag_dir / ck.META).unlink()
    ck.write_meta(
        tag_dir,
        {k: v for k, v in old.items() if k not in ("files", "format", "tag", "completed_at")},
    )


def truncate(path: Path, drop: int = 100) -> None:
    path.write_bytes(path.read_bytes()[:-drop])


def flip_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


class Payload:
    """Unpickling this creates ``marker``: proof that a load ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_payload(tag_dir: Path, name: str, marker: Path) -> None:
    """Add a pickled payload to one file and re-hash: the checksums all pass."""
    path = tag_dir / name
    states = torch.load(path, weights_only=False)
    states["payload"] = Payload(marker)
    torch.save(states, path)
    rehash(tag_dir)


@pytest.fixture
def src(stage15_fp32) -> Path:
    return stage15_fp32 / "stage15" / "checkpoints" / "global_step40"


# --------------------------------------------------- row 3: damaged checkpoints, fallback

#: (damage, file it names, what the message must say about it). Each damages global_step40.
DAMAGE: dict[str, tuple[Callable[[Path], None], str, str]] = {
    "truncated-shard": (lambda d: truncate(d / OPTIM1), OPTIM1, "truncated"),
    "flipped-byte": (lambda d: flip_byte(d / MODEL), MODEL, "fails its sha256 check (expected "),
    "missing-shard": (lambda d: (d / OPTIM0).unlink(), OPTIM0, "is missing"),
}


@pytest.mark.slow
@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_damaged_checkpoint_is_refused_naming_file_and_check(capsys, src, tmp_path, damage):
    hurt, name, says = DAMAGE[damage]
    ckpt = copy_tag(src.parents[2], tmp_path / "ckpts")
    hurt(ckpt)
    err = refused(
        capsys,
        ["--config", TINY32, *STAGE16, "--resume", str(ckpt), "--run-dir", str(tmp_path / "r")],
        [tmp_path],
    )
    line = next(x for x in err.splitlines() if "[ckpt-checksum]" in x)
    assert f"{ckpt}: {name}: shard {name}" in line and says in line, err
    assert not (tmp_path / "r").exists()


@pytest.mark.slow
def test_edited_latest_is_refused_for_an_explicit_path(capsys, src, tmp_path):
    root = tmp_path / "ckpts"
    copy_tag(src.parents[2], root)
    (root / "latest").write_text("global_step999")
    err = refused(
        capsys,
        ["--config", TINY32, *STAGE16, "--resume", str(root), "--run-dir", str(tmp_path / "r")],
        [tmp_path],
    )
    assert f"[ckpt-latest] {root / 'latest'}: 'latest' names global_step999" in err


def auto_plan(capsys, run: Path) -> dict:
    """`wonderland train --stage 16 --resume auto --dry-run --json` on a run: the plan."""
    before = snapshot(run)
    rc, out, err = train(
        capsys,
        ["--config", TINY32, *STAGE16, "--resume", "auto", "--run-dir", str(run), "--dry-run"]
        + ["--json"],
    )
    assert rc == 0, (out + err)[-3000:]
    assert snapshot(run) == before  # a plan changes nothing
    return json.loads(out)["preflight"]


@pytest.mark.slow
@pytest.mark.parametrize("damage", [*sorted(DAMAGE), "edited-latest", "latest-outside"])
def test_resume_auto_falls_back_to_the_previous_complete_checkpoint(
    capsys, stage15_fp32, tmp_path, damage
):
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    root = run / "stage15" / "checkpoints"
    if damage == "edited-latest":
        (root / "latest").write_text("global_step999")
        want, says = "global_step40", "latest names global_step999, which is not complete"
    elif damage == "latest-outside":
        (root / "latest").write_text("../../../elsewhere/global_step40")
        want, says = "global_step40", "not a checkpoint tag (global_stepN)"
    else:
        DAMAGE[damage][0](root / "global_step40")
        want, says = "global_step30", "latest names global_step40, which is not complete (shard "
    plan = auto_plan(capsys, run)
    assert plan["source"] == str(root / want)
    said = [f["message"] for f in plan["findings"] if f["rule"] == "resume-auto"]
    assert any(says in m for m in said), said
    assert any(f"falling back to the newest complete checkpoint {root / want}" in m for m in said)


@pytest.mark.slow
def test_resume_auto_warns_when_latest_was_edited_back(capsys, stage15_fp32, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    root = run / "stage15" / "checkpoints"
    (root / "latest").write_text("global_step20")
    plan = auto_plan(capsys, run)
    assert plan["source"] == str(root / "global_step20")  # latest decides, but not silently
    warn = [f for f in plan["findings"] if f["severity"] == "warn"]
    assert warn and "but global_step40 is newer" in warn[0]["message"], plan["findings"]
    assert str(root / "global_step40") in warn[0]["fix"]


@pytest.mark.slow
@pytest.mark.nightly  # every damage's refusal and fallback stay in the default suite
def test_resume_auto_really_resumes_the_fallback_and_leaves_the_damage_alone(
    stage15_fp32, tmp_path
):
    """The real launch: stage 16 from a run whose newest checkpoint has a truncated shard."""
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    root = run / "stage15" / "checkpoints"
    truncate(root / "global_step40" / OPTIM1)
    damaged = snapshot(root / "global_step40")
    result = wonderland(
        "train", "--config", TINY32, *STAGE16, "--resume", "auto", "--run-dir", str(run),
        "--steps", "2",
    )  # fmt: skip
    out = result.stdout + result.stderr
    assert result.returncode == 0, out[-4000:]
    assert f"falling back to the newest complete checkpoint {root / 'global_step30'}" in out
    assert f"resumed {root / 'global_step30'} at step 30" in out
    assert snapshot(root / "global_step40") == damaged  # the evidence is left as it was
    m = json.loads((run / "stage16" / "checkpoints" / "global_step32" / ck.META).read_text())
    assert m["global_step"] == 32 and m["stage"] == 16
    assert json.loads((run / "run.json").read_text())["stages"]["16"]["resumed_from"] == str(
        root / "global_step30"
    )


# ------------------------------------------------------------------ row 5: a hung rank


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


@pytest.mark.slow
@pytest.mark.proofs
def test_hung_rank_fails_within_the_process_group_timeout_naming_it(tmp_path):
    """Rank 1 SIGSTOPs itself after step 3; rank 0 must fail at the 20 s process-group timeout
    (not DeepSpeed's or gloo's 10/30 minutes) and name rank 1, and the front must say so."""
    timeout_s = json.loads(HANG_CONFIG.read_text())["wonderland"]["process_group_timeout_s"]
    grace_s = max(3, min(30, timeout_s // 4))  # distributed.explain_timeout's wait
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "wonderland_ds.cli.main", "train", "--stage", "15"]
    cmd += ["--config", str(HANG_CONFIG), "--run-dir", str(run)]
    cmd += ["--fault", "hang@step:step=3:rank=1"]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    stream = proc.stdout
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(
        target=lambda: lines.extend((time.monotonic(), x) for x in stream), daemon=True
    )
    reader.start()

    def first(pattern: str, within: float) -> tuple[float, re.Match[str]]:
        deadline = time.monotonic() + within
        while time.monotonic() < deadline:
            for t, line in list(lines):
                if m := re.search(pattern, line):
                    return t, m
            if proc.poll() is not None and not reader.is_alive():
                break
            time.sleep(0.1)
        raise AssertionError(f"no {pattern!r}:\n" + "".join(x for _, x in lines)[-4000:])

    pid = None
    try:
        t_fault, m = first(r"FAULT INJECTED: hang at step step 3 rank 1 \(pid (\d+)\)", 240)
        pid = int(m.group(1))
        deadline = time.monotonic() + 10
        while _state(pid) != "T" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert _state(pid) == "T"  # the fault really happened: rank 1 is frozen, not dead
        t_failed, _ = first(r"\[wonderland\] a collective timed out", timeout_s + grace_s + 60)
        assert _state(pid) == "T"  # still frozen: rank 0 failed on its own, at its timeout
        # DeepSpeed's launcher now SIGTERMs every rank and waits 30 s before SIGKILLing one that
        # does not go (a stopped process never does); do its SIGKILL now to keep the test short.
        os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=90)
        reader.join(timeout=10)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        if pid is not None and _state(pid) not in ("gone", "Z"):
            os.kill(pid, signal.SIGKILL)
    out = "".join(x for _, x in lines)
    seconds = t_failed - t_fault
    print(f"hung rank: rank 0 failed {seconds:.1f} s after the hang (timeout {timeout_s} s)")
    assert timeout_s <= seconds <= timeout_s + grace_s + 10, seconds
    assert rc not in (0, 2, 3), out[-3000:]
    entry = json.loads((run / "run.json").read_text())["stages"]["15"]
    assert entry["status"] == "failed"
    silent = f"rank 1 ({socket.gethostname()}) did not answer"  # the rank and its host
    assert silent in entry["error"] and f"{timeout_s} s" in entry["error"]
    front = next(x for x in out.splitlines() if x.startswith("stage 15 failed"))
    assert "rank 0 reported: a collective timed out" in front and silent in front
    assert f"--resume auto --run-dir {run}" in front


# ------------------------------------------------------------- row 7: bad input sweep

CONFIG_CASES = [c for c in BROKEN_CONFIGS if c.severity == "error"]
WONDERLAND_CASES = [
    (
        "pg-timeout-5",
        {"wonderland.process_group_timeout_s": 5},
        "wonderland.process_group_timeout_s",
    ),
    ("unknown-wonderland-key", {"wonderland.save_intervall": 10}, "wonderland.save_intervall"),
    ("keep-last-string", {"wonderland.keep_last": "3"}, "wonderland.keep_last"),
    ("seed-negative", {"wonderland.seed": -1}, "wonderland.seed"),
    ("wonderland-not-object", {"wonderland": [1]}, "wonderland"),
]


def test_bad_configs_are_refused_by_train(capsys, tmp_path, monkeypatch):
    """Every broken config of `check`'s corpus, and malformed files, through `train`."""
    monkeypatch.chdir(tmp_path)
    cases: list[tuple[str, Path, list[str], list[str]]] = []
    for c in CONFIG_CASES:
        path = tmp_path / f"{c.id}.json"
        path.write_text(json.dumps(mutate(c.changes)))
        flags = ["--stage", str(c.stage or 15), "--nproc", str(c.world)]
        cases.append((c.id, path, flags, [f"[{c.rule}]", c.path]))
    for name, changes, where in WONDERLAND_CASES:
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps(mutate(changes)))
        cases.append((name, path, ["--stage", "15"], [where]))
    for name, content, needle in MALFORMED:
        path = tmp_path / f"malformed-{name}.json"
        path.write_bytes(content)
        cases.append((name, path, ["--stage", "15"], ["[config-unreadable]", needle]))
    cases.append(("missing", tmp_path / "nope.json", ["--stage", "15"], ["does not exist"]))
    cases.append(("directory", tmp_path, ["--stage", "15"], ["[config-unreadable]"]))
    assert len(cases) >= 50
    failures = []
    for name, path, flags, needles in cases:
        argv = [*flags, "--config", str(path), "--run-dir", str(tmp_path / "run")]
        try:
            err = refused(capsys, argv, [tmp_path])
        except AssertionError as exc:
            failures.append(f"{name}: {exc}")
            continue
        missing = [n for n in needles if n not in err]
        if missing:
            failures.append(f"{name}: {missing} not in {err[-600:]}")
    assert not failures, "\n".join(failures)
    print(f"bad configs refused by train: {len(cases)}/{len(cases)}")


def test_bad_hostfiles_are_refused_by_train(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert len(BROKEN_HOSTFILES) >= 10
    failures = []
    for case in BROKEN_HOSTFILES:
        path = tmp_path / f"{case.id}.hosts"
        path.write_text(case.text)
        argv = ["--stage", "15", "--config", TINY32, "--hostfile", str(path)]
        err = refused(capsys, [*argv, "--run-dir", str(tmp_path / "run")], [tmp_path])
        line = next((x for x in err.splitlines() if x.startswith("ERROR")), "")
        if case.needle not in line or (case.where and f"{path}: {case.where}:" not in line):
            failures.append(f"{case.id}: {err[-400:]}")
    assert not failures, "\n".join(failures)
    print(f"bad hostfiles refused by train: {len(BROKEN_HOSTFILES)}/{len(BROKEN_HOSTFILES)}")


#: (argv, what stderr must name). No checkpoint needed; each exits 2 before anything starts.
BAD_FLAGS: list[tuple[list[str], str]] = [
    (["--config", TINY32], "the following arguments are required: --stage"),
    (["--stage", "0"], "argument --stage: 0 must be >= 1"),
    (["--stage", "19"], "stage 19 does not exist"),
    (["--stage", "fifteen"], "'fifteen' is not a whole number"),
    (["--stage", "15", "--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["--stage", "15", "--steps", "-5"], "argument --steps"),
    (["--stage", "15", "--grad-acc-steps", "0"], "argument --grad-acc-steps"),
    (["--stage", "15", "--seed", "-1"], "argument --seed: -1 must be >= 0"),
    (["--stage", "16", "--min-warmup-steps", "many"], "argument --min-warmup-steps"),
    (["--stage", "15", "--nproc", "0"], "argument --nproc"),
    (["--stage", "15", "--master-port", "0"], "argument --master-port"),
    (["--stage", "15", "--launcher", "slurm"], "--launcher slurm needs a Slurm allocation"),
    (["--stage", "15", "--launcher", "mpich"], "argument --launcher: invalid choice: 'mpich'"),
    (["--stage", "15", "--fault", "bogus"], "bad fault 'bogus'"),
    (["--stage", "15", "--fault", "kill@step:step=x"], "bad fault option 'step=x'"),
    (["--stage", "15", "--fault", "hang@save-before-meta"], "bad fault 'hang@save-before-meta'"),
    (["--stage", "15", "--fault", "nan@grad"], "bad fault 'nan@grad'"),
    (["--stage", "15", "--resume-from", "x"], "unrecognized arguments: --resume-from"),
    (["--stage", "16", "--resume", "auto"], "--resume auto needs --run-dir"),
    (["--stage", "16", "--run-dir", "{tmp}/r"], "resumes stage 15's checkpoint"),
    (["--stage", "18", "--run-dir", "{tmp}/r"], "resumes stage 16's checkpoint"),
    (["--stage", "15", "--config", "{tmp}/nope.json"], "does not exist"),
    (["--stage", "15", "--hostfile", "{tmp}/nope"], "nope"),
    (["--stage", "16", "--resume", "{tmp}/nowhere", "--run-dir", "{tmp}/r"], "[ckpt-missing]"),
    (["--stage", "15", "--task", "nope"], "unknown task 'nope'"),
    (["--stage", "15", "--task", "nosuchmod:fn"], "No module named 'nosuchmod'"),
    (["--stage", "15", "--task", "os:getcwd"], "returned str, not a Task"),
]


def test_bad_flag_combinations_are_refused(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for key in [k for k in os.environ if k.startswith("SLURM_")]:
        monkeypatch.delenv(key)  # outside any allocation
    failures = []
    for raw, needle in BAD_FLAGS:
        argv = [a.replace("{tmp}", str(tmp_path)) for a in raw]
        if "--config" not in argv:
            argv += ["--config", TINY32]
        if "--run-dir" not in argv and "auto" not in argv:
            argv += ["--run-dir", str(tmp_path / "run")]
        try:
            err = refused(capsys, argv, [tmp_path])
        except AssertionError as exc:
            failures.append(f"{raw}: {exc}")
            continue
        if needle not in err:
            failures.append(f"{raw}: {needle!r} not in {err[-500:]}")
    assert not failures, "\n".join(failures)
    print(f"bad flag combinations refused: {len(BAD_FLAGS)}/{len(BAD_FLAGS)}")


@pytest.mark.slow
def test_bad_flags_against_a_real_run_are_refused(capsys, stage15_fp32):
    """Flag combinations that are only wrong for this run (its seed, warmup, checkpoints)."""
    run = str(stage15_fp32)
    cases = [
        (["--stage", "15", "--run-dir", run], "[stage-complete]"),
        ([*STAGE16, "--resume", "auto", "--run-dir", run, "--seed", "8"], "[data-seed]"),
        (
            [*STAGE16, "--resume", "auto", "--run-dir", run, "--min-warmup-steps", "100"],
            "needs 100",
        ),
        (["--stage", "17", "--resume", "auto", "--run-dir", run], "found no complete checkpoint"),
        (["--stage", "16", "--resume", "auto", "--run-dir", run, "--task", "pylm"], "[data-"),
    ]
    for argv, needle in cases:
        err = refused(capsys, ["--config", TINY32, *argv], [stage15_fp32])
        assert needle in err, (argv, err)


#: name -> (damage to a copy of global_step40, what stderr must name)
DAMAGED: dict[str, tuple[Callable[[Path, Path], Path], str]] = {}


def damaged(name: str, needle: str):
    def register(fn: Callable[[Path, Path], Path]) -> Callable[[Path, Path], Path]:
        DAMAGED[name] = (fn, needle)
        return fn

    return register


@damaged("truncated-model-states", f"shard {MODEL} has")
def _(d: Path, tmp: Path) -> Path:
    truncate(d / MODEL, 5000)
    return d


@damaged("truncated-to-zero", f"shard {OPTIM0} has 0 bytes")
def _(d: Path, tmp: Path) -> Path:
    (d / OPTIM0).write_bytes(b"")
    return d


@damaged("flipped-byte-optim", f"shard {OPTIM1} fails its sha256 check")
def _(d: Path, tmp: Path) -> Path:
    flip_byte(d / OPTIM1)
    return d


@damaged("flipped-byte-rng", f"shard {RNG} fails its sha256 check")
def _(d: Path, tmp: Path) -> Path:
    flip_byte(d / RNG)
    return d


@damaged("missing-model-states", f"shard {MODEL} is missing")
def _(d: Path, tmp: Path) -> Path:
    (d / MODEL).unlink()
    return d


@damaged("metadata-deleted", f"[ckpt-metadata] {{d}}: {ck.META}: no {ck.META}")
def _(d: Path, tmp: Path) -> Path:
    (d / ck.META).unlink()
    return d


@damaged("metadata-garbage", f"{ck.META} is unreadable")
def _(d: Path, tmp: Path) -> Path:
    (d / ck.META).write_text("{not json")
    return d


@damaged("metadata-other-format", "of an unknown format")
def _(d: Path, tmp: Path) -> Path:
    meta = json.loads((d / ck.META).read_text())
    (d / ck.META).write_text(json.dumps({**meta, "format": "someone-else/9"}))
    return d


@damaged("metadata-lists-no-files", "metadata lists no files")
def _(d: Path, tmp: Path) -> Path:
    meta = json.loads((d / ck.META).read_text())
    (d / ck.META).write_text(json.dumps({**meta, "files": {}}))
    return d


@damaged("latest-names-missing-tag", "'latest' names global_step7")
def _(d: Path, tmp: Path) -> Path:
    (d.parent / "latest").write_text("global_step7")
    return d.parent


@damaged("empty-folder", "[ckpt-model-state]")
def _(d: Path, tmp: Path) -> Path:
    for f in d.iterdir():
        f.unlink()
    return d


@damaged("payload-in-optimizer-shard", f"[ckpt-untrusted] {{d}}: {OPTIM1}: calls io.open")
def _(d: Path, tmp: Path) -> Path:
    plant_payload(d, OPTIM1, tmp / "PWNED")
    return d


@damaged("stray-pickle", "evil.pt: calls io.open")
def _(d: Path, tmp: Path) -> Path:
    torch.save({"x": Payload(tmp / "PWNED")}, d / "evil.pt")
    return d


@damaged("protocol-4-pickle", f"{MODEL}: cannot be checked without running it")
def _(d: Path, tmp: Path) -> Path:
    states = torch.load(d / MODEL, weights_only=False)
    torch.save(states, d / MODEL, pickle_protocol=4)
    rehash(d)
    return d


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:Detected pickle protocol 4:UserWarning")
@pytest.mark.parametrize("name", list(DAMAGED))
def test_damaged_checkpoints_are_refused_by_train(capsys, src, tmp_path, name):
    hurt, needle = DAMAGED[name]
    ckpt = hurt(copy_tag(src.parents[2], tmp_path / "ckpts"), tmp_path)
    argv = ["--config", TINY32, *STAGE16, "--resume", str(ckpt), "--run-dir", str(tmp_path / "r")]
    err = refused(capsys, argv, [tmp_path])
    assert needle.replace("{d}", str(ckpt)) in err, err
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.slow
def test_refusals_in_a_real_process_print_no_traceback(stage15_fp32, tmp_path):
    """A few of the sweep through a real `wonderland` process: exit 2 and no traceback."""
    bad_cfg = tmp_path / "typo.json"
    bad_cfg.write_text(json.dumps(mutate({"gradient_acumulation_steps": 8})))
    ckpt = copy_tag(stage15_fp32, tmp_path / "ckpts")
    plant_payload(ckpt, OPTIM1, tmp_path / "PWNED")
    run = str(tmp_path / "run")
    cases = [
        (["--stage", "15", "--config", str(bad_cfg), "--run-dir", run], "[unknown-key]"),
        (["--stage", "15", "--steps", "0"], "must be >= 1"),
        (
            ["--config", TINY32, *STAGE16, "--resume", str(ckpt), "--run-dir", run],
            "[ckpt-untrusted]",
        ),
    ]
    before = snapshot(tmp_path), snapshot(REPO / "runs")
    for argv, needle in cases:
        result = wonderland("train", *argv)
        assert result.returncode == 2, result.stderr[-2000:]
        assert "Traceback" not in result.stdout + result.stderr
        assert needle in result.stderr
    assert (snapshot(tmp_path), snapshot(REPO / "runs")) == before
    assert not (tmp_path / "PWNED").exists()


# ----------------------------------------------------------- row 8: untrusted checkpoint


@pytest.fixture
def poisoned(src, tmp_path) -> tuple[Path, Path]:
    """global_step40 with a payload in rank 1's optimizer shard, checksums rewritten to match:
    only the payload is wrong. Returns (checkpoint, the file the payload would create)."""
    marker = tmp_path / "PWNED"
    ckpt = copy_tag(src.parents[2], tmp_path / "ckpts")
    plant_payload(ckpt, OPTIM1, marker)
    assert ck.verify(ckpt).complete  # the sha256 check cannot see it
    return ckpt, marker


@pytest.mark.slow
def test_inspect_refuses_a_payload_in_any_shard(capsys, poisoned):
    ckpt, marker = poisoned
    rc = cli.main(["inspect", str(ckpt), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert rc == 2
    bad = [f for f in report["findings"] if f["rule"] == "ckpt-untrusted"]
    assert [(f["severity"], f["path"]) for f in bad] == [("error", OPTIM1)]
    assert "io.open" in bad[0]["message"]
    assert not marker.exists()


@pytest.mark.slow
def test_resume_refuses_a_payload_unless_trusted(capsys, poisoned, tmp_path):
    ckpt, marker = poisoned
    new_run = tmp_path / "r"
    argv = ["--config", TINY32, *STAGE16, "--resume", str(ckpt), "--run-dir", str(new_run)]
    err = refused(capsys, argv, [ckpt.parent])
    assert f"[ckpt-untrusted] {ckpt}: {OPTIM1}: calls io.open when unpickled" in err
    assert "--trust-checkpoint" in err
    assert not marker.exists() and not new_run.exists()

    rc, out, err = train(capsys, [*argv, "--trust-checkpoint", "--dry-run", "--json"])
    assert rc == 0, err
    report = json.loads(out)
    trusted = [f for f in report["preflight"]["findings"] if f["rule"] == "ckpt-untrusted"]
    assert [f["severity"] for f in trusted] == ["warn"]
    assert "trusted: --trust-checkpoint" in trusted[0]["message"]
    # The flag reaches every rank (whose preflight would refuse otherwise) and the manifest.
    stage_argv = report["command"][report["command"].index("--stage") :]
    rank_args = build_train_parser().parse_args(stage_argv)
    assert "trust-checkpoint" in overrides(rank_args)
    assert not marker.exists()  # the preflight itself never unpickled the shard
    # The payload is real: loading the shard the way DeepSpeed does runs it.
    torch.load(ckpt / OPTIM1, weights_only=False)
    assert marker.exists()


@pytest.mark.slow
def test_deepspeed_optimizer_files_pass_the_allowlist(src):
    """Our own checkpoints are not refused: DeepSpeed's pickled classes are allowlisted."""
    from wonderland_ds.checkpoint.describe import safe_load, scan_pickles

    assert scan_pickles(src) == []
    states, why = safe_load(src / OPTIM0)
    assert why is None and isinstance(states, dict)


# -------------------------------------------------------------- row 9: version drift


@pytest.mark.slow
def test_version_drift_is_told_and_the_universal_path_offered(capsys, src, tmp_path):
    ckpt = copy_tag(src.parents[2], tmp_path / "ckpts")
    meta = json.loads((ckpt / ck.META).read_text())
    meta["versions"] |= {"torch": "2.4.1", "deepspeed": "0.14.0"}
    (ckpt / ck.META).write_text(json.dumps(meta))
    assert ck.verify(ckpt).complete  # the metadata is not among the hashed files
    rc, out, err = train(
        capsys,
        ["--config", TINY32, *STAGE16, "--resume", str(ckpt), "--run-dir", str(tmp_path / "r")]
        + ["--dry-run"],
    )
    assert rc == 0, err
    installed = manifest.versions()
    line = next(x for x in out.splitlines() if "[version-drift]" in x)
    assert line.startswith("WARN")
    assert f"torch 2.4.1 -> {installed['torch']}" in line
    assert f"deepspeed 0.14.0 -> {installed['deepspeed']}" in line
    fix = out.splitlines()[out.splitlines().index(line) + 1]
    assert "wonderland convert" in fix and "universal" in fix
