"""Which checkpoint a stage resumes: ``--resume`` (none, ``auto`` or a path) resolved to one
tag folder, with findings.

:func:`resolve` finds the source that the preflight (``preflight.py``) then checks. ``auto``
looks in this stage's own checkpoints (an interrupted stage) and then in the previous training
stage's, and takes the one ``latest`` names when it is complete, else the newest complete one;
a path is taken as given, or through its ``latest``; no ``--resume`` is a fresh start only
where the stage starts fresh and has no checkpoints yet. Nothing is loaded here, and a fresh
start is never implied when a resume was asked for. :func:`stage_ckpt_root` is where a stage
of a run directory keeps its checkpoints.
"""

from __future__ import annotations

from pathlib import Path

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.checkpoint.describe import resolve_tag_dir
from wonderland_ds.config import stages
from wonderland_ds.core.findings import Finding


def stage_ckpt_root(run_dir: Path, stage: int) -> Path:
    return run_dir / f"stage{stage}" / "checkpoints"


def _auto(
    run_dir: Path, stage: int, own_folder: bool = True
) -> tuple[Path | None, bool, list[Finding]]:
    """Newest complete checkpoint of this stage (interrupted) or else the previous one;
    ``own_folder=False``: the previous one (a new attempt of a stage)."""
    prev = stages.previous_training_stage(stage)
    roots = [(stage_ckpt_root(run_dir, stage), True)] if own_folder else []
    if prev is not None:
        roots.append((stage_ckpt_root(run_dir, prev), False))
    out: list[Finding] = []
    for root, own in roots:
        if not ck.tags(root):
            continue
        latest = ck.read_latest(root)
        latest_step = None if latest is None else ck.step_of(latest)
        if latest is not None and latest_step is None:
            # Only a tag name may be joined to the root: an edited latest must not lead outside.
            out.append(
                Finding(
                    "resume-auto",
                    "warn",
                    f"latest holds {latest[:80]!r}, not a checkpoint tag (global_stepN)",
                    "",
                    str(root / ck.LATEST),
                )
            )
        elif latest is not None and latest_step is not None:
            v = ck.verify(root / latest)
            if v.complete:
                found = [
                    Finding("resume-auto", "ok", f"resuming from {v.tag_dir} (named by latest)")
                ]
                newer = [p for s, p in ck.tags(root) if s > latest_step and ck.read_meta(p)]
                if newer:
                    found.append(
                        Finding(
                            "resume-auto",
                            "warn",
                            f"latest names {latest}, but {newer[-1].name} is newer and has"
                            f" metadata (latest was edited, or a save stopped before updating"
                            f" it): resuming from {latest}, as latest says",
                            f"to resume the newer one, pass --resume {newer[-1]}",
                            str(root / ck.LATEST),
                        )
                    )
                return v.tag_dir, own, found
            why = "; ".join(f.message for f in v.findings)
            out.append(
                Finding(
                    "resume-auto",
                    "warn",
                    f"latest names {latest}, which is not complete ({why})",
                    "",
                    str(root / ck.LATEST),
                )
            )
        newest = ck.newest_complete(root)
        if newest is not None:
            return (
                newest.tag_dir,
                own,
                out
                + [
                    Finding(
                        "resume-auto",
                        "warn",
                        f"falling back to the newest complete checkpoint {newest.tag_dir}",
                        "",
                    )
                ],
            )
    where = ", ".join(str(r) for r, _ in roots)
    return (
        None,
        False,
        out
        + [
            Finding(
                "resume-auto",
                "error",
                f"--resume auto found no complete checkpoint in {where}",
                "run the previous stage first, or pass --resume PATH (a fresh start is never implied)",
                str(run_dir),
            )
        ],
    )


def resolve(
    resume: str | None, run_dir: Path, stage: int, own_folder: bool = True
) -> tuple[Path | None, bool, list[Finding]]:
    st = stages.get(stage)
    if resume is None:
        own = stage_ckpt_root(run_dir, stage)
        if own_folder and ck.tags(own):
            return (
                None,
                False,
                [
                    Finding(
                        "resume-missing",
                        "error",
                        f"stage {stage} already has checkpoints in {own}; starting over would mix runs",
                        "pass --resume auto to continue it, or use a new --run-dir",
                        str(own),
                    )
                ],
            )
        if st.resumes:
            prev = stages.previous_training_stage(stage)
            return (
                None,
                False,
                [
                    Finding(
                        "resume-missing",
                        "error",
                        f"stage {stage} ({st.name}) resumes stage {prev}'s checkpoint",
                        "pass --resume /path/to/checkpoint or --resume auto",
                    )
                ],
            )
        return None, False, [Finding("resume", "ok", "fresh start (no --resume)")]
    if resume == "auto":
        return _auto(run_dir, stage, own_folder)
    path = Path(resume)
    if not path.exists():
        return (
            None,
            False,
            [
                Finding(
                    "ckpt-missing",
                    "error",
                    "checkpoint path does not exist",
                    "pass an existing checkpoint folder",
                    resume,
                )
            ],
        )
    tag_dir = resolve_tag_dir(path)
    if tag_dir != path and not tag_dir.is_dir():
        latest = path / ck.LATEST if (path / ck.LATEST).exists() else path
        return (
            None,
            False,
            [
                Finding(
                    "ckpt-latest",
                    "error",
                    f"'latest' names {tag_dir.name}, which does not exist",
                    "pass a complete global_stepN folder, or --resume auto to fall back to the newest"
                    " complete checkpoint",
                    str(latest),
                )
            ],
        )
    own = stage_ckpt_root(run_dir, stage).resolve()
    return (
        tag_dir,
        tag_dir.resolve().parent == own,
        [Finding("resume", "ok", f"resuming from {tag_dir}")],
    )
