"""The DeepSpeed internals seam: every non-public name is declared in one module, present in
the installed release, and used nowhere else."""

import ast
from pathlib import Path

import pytest

from wonderland_ds.core import ds_internals

PACKAGE = Path(__file__).resolve().parents[1] / "wonderland_ds"
#: DeepSpeed modules any file may import: its public API.
PUBLIC = (
    "deepspeed",
    "deepspeed.comm",
    "deepspeed.accelerator",
    "deepspeed.monitor.config",
    "deepspeed.monitor.monitor",
    "deepspeed.utils.zero_to_fp32",
)


def test_the_installed_deepspeed_is_the_release_the_internals_were_checked_against():
    assert ds_internals.version() == ds_internals.CHECKED_RELEASE, (
        f"DeepSpeed {ds_internals.version()} is installed; the internals in "
        "wonderland_ds/core/ds_internals.py were checked against "
        f"{ds_internals.CHECKED_RELEASE}: re-read each entry against the new release, run "
        "the tests that use them, then bump CHECKED_RELEASE"
    )


def test_every_declared_internal_exists():
    assert ds_internals.problems() == []


def test_an_undeclared_name_is_refused():
    with pytest.raises(KeyError, match="not declared"):
        ds_internals.attr("deepspeed.checkpoint.ds_to_universal", "convert_everything")
    with pytest.raises(KeyError, match="not declared"):
        ds_internals.module("deepspeed.runtime.engine")


def test_patched_globals_are_restored_also_when_the_block_raises():
    mod = ds_internals.module("deepspeed.checkpoint.zero_checkpoint")
    real = mod.torch
    with (
        pytest.raises(RuntimeError),
        ds_internals.patched([("deepspeed.checkpoint.zero_checkpoint", "torch", "stand-in")]),
    ):
        assert mod.torch == "stand-in"
        raise RuntimeError
    assert mod.torch is real


def _deepspeed_imports(path: Path) -> list[str]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
            mods = [f"{node.module}.{a.name}" for a in node.names]
            out += [m for m in mods if node.module not in PUBLIC and m not in PUBLIC]
        elif isinstance(node, ast.Import):
            out += [a.name for a in node.names if a.name.startswith("deepspeed")]
            out = [m for m in out if m not in PUBLIC]
    return out


def test_no_module_but_the_seam_imports_a_deepspeed_internal():
    found = {
        str(p.relative_to(PACKAGE)): names
        for p in sorted(PACKAGE.rglob("*.py"))
        if p.name != "ds_internals.py" and (names := _deepspeed_imports(p))
    }
    assert found == {}, f"import these through wonderland_ds.core.ds_internals: {found}"
