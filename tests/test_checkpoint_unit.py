"""The checkpoint contract's pure parts: verification, `latest`, retention (no processes)."""

from __future__ import annotations

from pathlib import Path

from wonderland_ds.checkpoint import contract as ck


def fake(root: Path, step: int, complete: bool = True) -> Path:
    tag = root / ck.tag_for(step)
    tag.mkdir(parents=True)
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"model" * step)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optim" * step)
    if complete:
        ck.write_meta(tag, {"global_step": step})
        ck.set_latest(root, tag.name)
    return tag


def test_complete_checkpoint_verifies(tmp_path):
    tag = fake(tmp_path, 10)
    v = ck.verify(tag)
    assert v.complete and v.findings == [] and v.meta.global_step == 10
    assert set(v.meta.files) == {
        "mp_rank_00_model_states.pt",
        "zero_pp_rank_0_mp_rank_00_optim_states.pt",
    }
    assert ck.read_latest(tmp_path) == "global_step10"


def test_missing_metadata_is_incomplete(tmp_path):
    v = ck.verify(fake(tmp_path, 10, complete=False))
    assert not v.complete and v.findings[0].rule == "ckpt-incomplete"


def test_each_kind_of_damage_is_named(tmp_path):
    tag = fake(tmp_path, 10)
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"optim" * 9)
    v = ck.verify(tag)
    assert not v.complete and "has 45 bytes, the metadata says 50" in v.findings[0].message
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"OPTIM" * 10)
    assert "fails its sha256 check" in ck.verify(tag).findings[0].message
    assert ck.verify(tag, deep=False).complete  # size-only check cannot see a flipped byte
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").unlink()
    assert "is missing" in ck.verify(tag).findings[0].message


def test_newest_complete_skips_damaged_and_unfinished(tmp_path):
    fake(tmp_path, 10)
    fake(tmp_path, 20)
    (tmp_path / "global_step20" / "mp_rank_00_model_states.pt").write_bytes(b"x")
    fake(tmp_path, 30, complete=False)
    assert ck.newest_complete(tmp_path).tag_dir.name == "global_step10"


def test_retention_keeps_newest_complete_and_drops_stale_partials(tmp_path):
    for step in (10, 20, 30):
        fake(tmp_path, step)
    fake(tmp_path, 25, complete=False)  # an old save that never finished
    fake(tmp_path, 40, complete=False)  # a save in progress: newer than every complete one
    removed = ck.retain(tmp_path, keep_last=1)
    assert sorted(p.name for p in removed) == ["global_step10", "global_step20", "global_step25"]
    assert sorted(p.name for p in tmp_path.iterdir() if p.is_dir()) == [
        "global_step30",
        "global_step40",
    ]
    assert not list(tmp_path.glob(".deleting-*"))


def test_retention_recovers_from_a_crash_mid_delete(tmp_path):
    fake(tmp_path, 10)
    fake(tmp_path, 20)
    trash = tmp_path / ".deleting-global_step5"  # what a crash during rmtree leaves
    trash.mkdir()
    (trash / "half.pt").write_bytes(b"x")
    assert [s for s, _ in ck.tags(tmp_path)] == [10, 20]  # never mistaken for a checkpoint
    ck.retain(tmp_path, keep_last=5)
    assert not trash.exists() and ck.verify(tmp_path / "global_step20").complete


def test_latest_is_replaced_atomically(tmp_path):
    fake(tmp_path, 10)
    fake(tmp_path, 20)
    assert ck.read_latest(tmp_path) == "global_step20"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".latest.tmp")]
