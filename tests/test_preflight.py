"""Stage-16 preflight refusals: each exits 2, names the problem, and
writes nothing. Run in-process through `wonderland train`: the front refuses before launch."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.conftest import TINY32
from tests.helpers.util import snapshot
from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.cli import main as cli
from wonderland_ds.run import preflight

pytestmark = pytest.mark.slow


def craft(src_tag: Path, dest_root: Path, *, drop_optim=False, sched=None, meta_update=None):
    """Copy a complete checkpoint and change it the way a real save would have, re-hashing
    so that only the intended defect is left."""
    dest = dest_root / src_tag.name
    shutil.copytree(src_tag, dest)
    old = json.loads((dest / ck.META).read_text())
    if drop_optim:
        for f in dest.glob("*optim_states.pt"):
            f.unlink()
    if sched is not None:
        path = dest / "mp_rank_00_model_states.pt"
        states = torch.load(path, weights_only=False)
        states["lr_scheduler"] = sched(states["lr_scheduler"])
        torch.save(states, path)
    (dest / ck.META).unlink()
    keep = {k: v for k, v in old.items() if k not in ("files", "format", "tag", "completed_at")}
    ck.write_meta(dest, {**keep, **(meta_update or {})})
    ck.set_latest(dest_root, dest.name)
    return dest


def refuse(capsys, args: list[str], watch: list[Path]) -> str:
    before = {str(p): snapshot(p) for p in watch}
    rc = cli.main(["train", "--config", TINY32, *args])
    err = capsys.readouterr().err
    assert rc == 2, err
    assert "Traceback" not in err and "refused" in err
    assert {str(p): snapshot(p) for p in watch} == before  # nothing written, moved or deleted
    return err


@pytest.fixture
def src(stage15_fp32) -> Path:
    return stage15_fp32 / "stage15" / "checkpoints" / "global_step40"


STAGE16 = ["--stage", "16", "--optimizer-state", "--scheduler-state", "--grad-acc-steps", "8"]


def test_weights_only_checkpoint(capsys, src, tmp_path):
    ckpt = craft(
        src, tmp_path / "ckpts", drop_optim=True, meta_update={"has_optimizer_state": False}
    )
    new_run = tmp_path / "new-run"
    err = refuse(
        capsys, [*STAGE16, "--resume", str(ckpt), "--run-dir", str(new_run)], [tmp_path / "ckpts"]
    )
    assert "[ckpt-optimizer-state]" in err and "no optimizer state" in err
    assert not new_run.exists()


def test_scheduler_state_missing(capsys, src, tmp_path):
    ckpt = craft(
        src, tmp_path / "ckpts", sched=lambda s: None, meta_update={"has_scheduler_state": False}
    )
    err = refuse(
        capsys,
        [*STAGE16, "--resume", str(ckpt), "--run-dir", str(tmp_path / "r")],
        [tmp_path / "ckpts"],
    )
    assert "[ckpt-scheduler-state]" in err and "no LR scheduler state" in err
    assert not (tmp_path / "r").exists()


def test_warmup_200_is_under_500(capsys, src, tmp_path):
    ckpt = craft(src, tmp_path / "ckpts", sched=lambda s: {**s, "last_batch_iteration": 199})
    err = refuse(
        capsys,
        [
            *STAGE16,
            "--resume",
            str(ckpt),
            "--run-dir",
            str(tmp_path / "r"),
            "--min-warmup-steps",
            "500",
        ],
        [tmp_path / "ckpts"],
    )
    assert "[warmup-behind]" in err and "only 200 LR-warmup steps" in err and "needs 500" in err


def test_seed_mismatch(capsys, stage15_fp32):
    err = refuse(
        capsys,
        [*STAGE16, "--resume", "auto", "--run-dir", str(stage15_fp32), "--seed", "8"],
        [stage15_fp32],
    )
    assert "[data-seed]" in err and "data seed 8 differs from the checkpoint's 7" in err


def test_seed_override_is_allowed_and_reported(capsys, stage15_fp32, tmp_path):
    rc = cli.main(
        [
            "train",
            "--config",
            TINY32,
            *STAGE16,
            "--resume",
            "auto",
            "--run-dir",
            str(stage15_fp32),
            "--seed",
            "8",
            "--allow-seed-change",
            "--dry-run",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "WARN  [data-seed]" in out and "--allow-seed-change" in out


def test_truncated_shard(capsys, src, tmp_path):
    ckpt = craft(src, tmp_path / "ckpts")
    shard = ckpt / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(shard.read_bytes()[:-100])
    err = refuse(
        capsys,
        [*STAGE16, "--resume", str(ckpt), "--run-dir", str(tmp_path / "r")],
        [tmp_path / "ckpts"],
    )
    assert "[ckpt-checksum]" in err and "zero_pp_rank_1_mp_rank_00_optim_states.pt" in err
    assert "truncated" in err


def test_flipped_byte_fails_sha256(capsys, src, tmp_path):
    ckpt = craft(src, tmp_path / "ckpts")
    shard = ckpt / "mp_rank_00_model_states.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    err = refuse(
        capsys,
        [*STAGE16, "--resume", str(ckpt), "--run-dir", str(tmp_path / "r")],
        [tmp_path / "ckpts"],
    )
    assert "mp_rank_00_model_states.pt fails its sha256 check" in err


def test_latest_points_to_a_missing_folder(capsys, src, tmp_path):
    root = tmp_path / "ckpts"
    craft(src, root)
    (root / "latest").write_text("global_step999")
    err = refuse(
        capsys, [*STAGE16, "--resume", str(root), "--run-dir", str(tmp_path / "r")], [root]
    )
    assert "[ckpt-latest]" in err and "global_step999, which does not exist" in err


def test_stage16_without_resume_is_refused(capsys, tmp_path):
    err = refuse(capsys, ["--stage", "16", "--run-dir", str(tmp_path / "r")], [tmp_path])
    assert "resumes stage 15" in err and "--resume" in err


def test_fresh_stage_over_existing_checkpoints_is_refused(capsys, stage15_fp32, tmp_path):
    err = refuse(capsys, ["--stage", "15", "--run-dir", str(stage15_fp32)], [stage15_fp32])
    assert "[stage-complete]" in err and "--rerun" in err  # a completed stage
    run = tmp_path / "run"  # an interrupted one: its checkpoints are continued, never mixed
    shutil.copytree(stage15_fp32, run)
    manifest = json.loads((run / "run.json").read_text())
    manifest["stages"]["15"]["status"] = "failed"
    (run / "run.json").write_text(json.dumps(manifest))
    err = refuse(capsys, ["--stage", "15", "--run-dir", str(run)], [run])
    assert "already has checkpoints" in err and "--resume auto" in err


def test_resume_auto_falls_back_past_a_damaged_latest(src, tmp_path, stage15_fp32):
    run = tmp_path / "run"
    shutil.copytree(stage15_fp32, run)
    root = run / "stage15" / "checkpoints"
    victim = root / "global_step40" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    victim.write_bytes(victim.read_bytes()[:1000])
    plan = preflight.check(
        16,
        "auto",
        run,
        min_warmup=20,
        seed=7,
        fingerprint=_fingerprint(),
        world_size=2,
        zero_stage=2,
        precision="fp32",
    )
    assert plan.source == root / "global_step30"
    text = " ".join(f.message for f in plan.findings)
    assert "latest names global_step40, which is not complete" in text
    assert "falling back to the newest complete checkpoint" in text


def test_resume_auto_with_nothing_complete_never_starts_fresh(tmp_path):
    plan = preflight.check(
        16,
        "auto",
        tmp_path,
        min_warmup=20,
        seed=7,
        fingerprint="x",
        world_size=2,
        zero_stage=2,
        precision="fp32",
    )
    assert plan.source is None
    assert any(f.rule == "resume-auto" and f.severity == "error" for f in plan.findings)


def _fingerprint() -> str:
    from wonderland_ds.data.builtin import digits

    return digits().materialize().fingerprint
