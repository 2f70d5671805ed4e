"""Before any training step: decide whether the checkpoint to resume may be used.

Every check returns findings (ok / warn / error with message and fix); an error refuses the
stage with exit 2 before anything is written. Never a fresh start when a resume was asked for.
Which checkpoint that is, ``resume_source.py`` finds; :func:`check` verifies it against the
contract, the data, the seed and the topology, into the stage's :class:`Plan`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from wonderland_ds.checkpoint import zero_layout
from wonderland_ds.checkpoint.describe import describe
from wonderland_ds.checkpoint.zero_layout import SourceLayout
from wonderland_ds.config import stages
from wonderland_ds.core.findings import Finding
from wonderland_ds.data.blend import ORDER as BLEND_ORDER
from wonderland_ds.data.sampler import ORDER
from wonderland_ds.run import manifest
from wonderland_ds.run.resume_source import resolve

#: Override flags a user may pass; each is recorded in the manifest when used.
OVERRIDES = ("allow-seed-change", "allow-data-change", "trust-checkpoint")


@dataclass
class Plan:
    stage: int
    source: Path | None = None
    """The checkpoint folder to load (None: fresh start)."""
    source_info: dict[str, Any] = field(default_factory=dict)
    universal: bool = False
    """Load through a universal checkpoint (``ds_to_universal``): a change the load-time
    reshard does not cover, or versions that differ from the checkpoint's."""
    reshard: bool = False
    """World size (or ZeRO-1 <-> 2) changed: every rank reads its share of the saved
    partitions at load time (``checkpoint/reshard.py``)."""
    layout: SourceLayout | None = None
    """The checkpoint's partition layout and reference norms, when the world changed and the
    layout is known: the reshard's map and the check after any changed-layout load."""
    continuing: bool = False
    """The source is this stage's own checkpoint (an interrupted stage resumed)."""
    findings: list[Finding] = field(default_factory=list)
    data_mix: dict[str, str] | None = None
    """A mix the config declares for this stage, in place of the checkpoint's: ``mix``,
    ``sources`` (names and weights) and ``from`` (the checkpoint's mix); None: no change."""

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "source": str(self.source) if self.source else None,
            "universal": self.universal,
            "reshard": self.reshard,
            "source_layout": None
            if self.layout is None
            else {
                "zero_stage": self.layout.zero_stage,
                "world_size": self.layout.world_size,
                "parameters": len(self.layout.norms),
            },
            "continuing": self.continuing,
            "data_mix": self.data_mix,
            "findings": [f.to_dict() for f in self.findings],
        }


def check(
    stage: int,
    resume: str | None,
    run_dir: Path,
    *,
    min_warmup: int,
    seed: int,
    fingerprint: str,
    task: str = "",
    config: str = "",
    world_size: int,
    zero_stage: int,
    precision: str,
    overrides: set[str] = frozenset(),  # type: ignore[assignment]
    own_folder: bool = True,
    reshard_blocker: str | None = None,
    mix: str = "train",
    mix_fingerprint: Callable[[str], str | None] | None = None,
    mix_label: str = "",
) -> Plan:
    """``own_folder=False``: a new attempt of the stage, whose old folder is about to be
    moved aside, never resumes from it. ``reshard_blocker``: why the new config cannot take
    a load-time reshard (offload to NVMe, parameter alignment...), or None. ``mix``: the
    config's training data this stage reads (``train`` or ``stage_train.N``, described by
    ``mix_label``); ``mix_fingerprint(name)``: the fingerprint of another of the config's
    mixes (None: not declared), for a checkpoint trained on another mix."""
    plan = Plan(stage)
    source, continuing, found = resolve(resume, run_dir, stage, own_folder)
    plan.findings += found
    if source is None:
        return plan
    plan.source, plan.continuing = source, continuing
    trust = "trust-checkpoint" in overrides
    info, found = describe(source, deep=True, trust=trust)
    plan.source_info = info
    # A plain DeepSpeed checkpoint (no metadata) cannot be verified: that is a refusal. A file
    # that would run code when DeepSpeed unpickles it is one too, unless the user vouched for
    # the checkpoint (--trust-checkpoint, recorded in the manifest).
    plan.findings += [
        Finding(f.rule, "error", f.message, f.fix, f.file, f.path)
        if f.rule == "ckpt-metadata"
        else Finding(
            f.rule, "warn", f"{f.message} (trusted: --trust-checkpoint)", "", f.file, f.path
        )
        if f.rule == "ckpt-untrusted" and trust and f.severity == "error"
        else f
        for f in found
    ]
    st = stages.get(stage)
    if st.preflight and not continuing:
        progress = info.get("warmup_progress")
        if progress is not None and progress < min_warmup:
            plan.findings.append(
                Finding(
                    "warmup-behind",
                    "error",
                    f"only {progress} LR-warmup steps are behind this checkpoint; stage {stage}"
                    f" needs {min_warmup} (the optimizer oscillates otherwise)",
                    f"train the previous stage for at least {min_warmup} steps with a warmup"
                    " scheduler, then resume its last checkpoint",
                    str(source),
                )
            )
        elif progress is not None:
            plan.findings.append(
                Finding("warmup-behind", "ok", f"{progress} warmup steps behind (>= {min_warmup})")
            )
    data = info.get("data") or {}
    if data:
        if data.get("seed") != seed:
            plan.findings.append(
                Finding(
                    "data-seed",
                    "warn" if "allow-seed-change" in overrides else "error",
                    f"data seed {seed} differs from the checkpoint's {data.get('seed')}: the data"
                    " order shifts and the gradient-accumulation math changes",
                    f"use seed {data.get('seed')} (wonderland.seed), or pass --allow-seed-change"
                    " (recorded in the manifest)",
                    str(source),
                    "data.seed",
                )
            )
        theirs_mix = data.get("mix", "train")
        declared = None
        if theirs_mix != mix and not continuing and mix_fingerprint is not None:
            # A declared mix per stage is not a silent change: the checkpoint must match the
            # config's mix it was trained on, and this stage's mix is recorded.
            declared = mix_fingerprint(theirs_mix)
        if declared is not None and declared == data.get("fingerprint"):
            now = f"data.{mix} ({mix_label})"
            what = (
                f"stage {stage} trains on {now} from its first sample"
                if stages.get(stage).kind == "train"
                else f"stage {stage} reads {now}"
            )
            plan.findings.append(
                Finding(
                    "data-mix",
                    "info",
                    f"{what}; the checkpoint trained on data.{theirs_mix}, unchanged: a mix the"
                    " config declares per stage",
                )
            )
            plan.data_mix = {"mix": mix, "from": theirs_mix, "sources": mix_label}
        elif data.get("fingerprint") != fingerprint:
            theirs = info.get("task")
            plan.findings.append(
                Finding(
                    "data-fingerprint",
                    "warn" if "allow-data-change" in overrides else "error",
                    f"the training data (task {task!r}, from {config or 'the config'}) differs"
                    f" from the data the checkpoint was trained on (task {theirs!r})",
                    "use the same task/dataset (wonderland.task, model and data, or --task), or"
                    " pass --allow-data-change (recorded)",
                    str(source),
                    "data.fingerprint",
                )
            )
        order, ours = data.get("order", "permutation"), ORDER
        if order == ORDER and data.get("blend") and theirs_mix == mix:  # the same mix goes on
            order, ours = data["blend"], BLEND_ORDER
        if order != ours:
            plan.findings.append(
                Finding(
                    "data-order",
                    "warn" if "allow-seed-change" in overrides else "error",
                    f"the checkpoint's data order was computed as {order!r}, this version's as"
                    f" {ours!r}: the stream would not continue where it stopped",
                    "resume with the version that saved it, or pass --allow-seed-change (recorded)",
                    str(source),
                    "data.order",
                )
            )
    changed = [
        f"{k} {info.get(k)} -> {v}"
        for k, v in (
            ("world_size", world_size),
            ("zero_stage", zero_stage),
            ("precision", precision),
        )
        if info.get(k) is not None and info.get(k) != v
    ]
    saved = info.get("versions") or {}
    installed = manifest.versions()
    drift = [
        f"{k} {saved[k]} -> {installed[k]}"
        for k in ("torch", "deepspeed")
        if k in saved and saved[k] != installed.get(k)
    ]
    if drift:
        # DeepSpeed's own checkpoint layout changes between versions; the universal format is
        # the one it promises to read back, so load through it (converted by the installed
        # DeepSpeed) instead of hoping the raw shards still fit.
        plan.findings.append(
            Finding(
                "version-drift",
                "warn",
                f"saved with other versions: {', '.join(drift)}: loading through a universal"
                " checkpoint converted by the installed DeepSpeed",
                "to convert by hand first: wonderland convert CKPT (universal format)",
                str(source),
            )
        )
    if changed or drift:
        _layout_change(
            plan, source, changed, drift, info.get("zero_stage"), zero_stage, reshard_blocker
        )
    return plan


def _layout_change(
    plan: Plan,
    source: Path,
    changed: list[str],
    drift: list[str],
    old_zero: Any,
    zero_stage: int,
    blocker: str | None,
) -> None:
    """Reshard at load time where the layout is known and only the world size (or ZeRO-1 <-> 2)
    changed; else DeepSpeed's universal path. Either way, with a known layout, the source's
    per-parameter norms for the check after the load."""
    try:
        plan.layout = zero_layout.read_source(source)
        unknown = None
    except zero_layout.UnknownLayout as exc:
        unknown = f"layout not known to the reader ({exc})"
    family = {1: "zero12", 2: "zero12", 3: "zero3"}
    if old_zero in family and family.get(old_zero) != family.get(zero_stage):
        # DeepSpeed 0.19's engine looks for the model-states files of its own stage (one per
        # rank under ZeRO-3, one in all under ZeRO-1/2), in a universal folder too.
        plan.findings.append(
            Finding(
                "topology",
                "error",
                f"zero_stage {old_zero} -> {zero_stage}: DeepSpeed cannot load a ZeRO-{old_zero}"
                f" checkpoint into a ZeRO-{zero_stage} engine, not even through a universal"
                " checkpoint (its loader looks for the other stage's model-states files)",
                f"resume with zero_optimization.stage {old_zero}"
                + (" (or 1 and 2: they interchange)" if old_zero != 3 else ""),
                str(source),
                "zero_optimization.stage",
            )
        )
        return
    why = (
        unknown
        or ("versions differ" if drift else None)
        or ("precision changed" if any(c.startswith("precision") for c in changed) else None)
        or blocker
    )
    what = ", ".join(changed) or "versions"
    if why is None:
        plan.reshard = True
        assert plan.layout is not None
        plan.findings.append(
            Finding(
                "topology",
                "info",
                f"{what}: resharding at load time (each rank reads its share of the"
                f" {plan.layout.world_size} saved partitions; no conversion)",
            )
        )
        return
    plan.universal = True
    plan.findings.append(
        Finding(
            "topology",
            "info",
            f"{what}: loading through a universal checkpoint (ds_to_universal): {why}",
        )
    )
