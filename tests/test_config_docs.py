"""docs/configuration.md is generated from the config's models, and every field has a meaning."""

from __future__ import annotations

import inspect
import re
import subprocess
import sys

import pytest
from pydantic import BaseModel

from tests.conftest import REPO
from wonderland_ds.config import ds_models, reference, settings

DOC = REPO / "docs" / "configuration.md"


def _models_defined_in(module: object) -> list[type[BaseModel]]:
    return [
        c
        for c in vars(module).values()
        if inspect.isclass(c)
        and issubclass(c, BaseModel)
        and c.__module__ == getattr(module, "__name__", None)
        and not c.__name__.startswith("_")
    ]


def test_committed_reference_is_the_generated_one() -> None:
    assert DOC.read_text(encoding="utf-8") == reference.markdown(), (
        f"docs/configuration.md is out of date with the models: run `{reference.COMMAND}`"
    )


def test_the_module_prints_the_reference() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "wonderland_ds.config.reference"],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == reference.markdown()


def test_every_model_has_a_table() -> None:
    documented = set(reference.documented_models())
    for model in _models_defined_in(settings) + _models_defined_in(ds_models):
        assert model in documented, f"{model.__name__} is reachable from no documented section"


@pytest.mark.parametrize(
    "model",
    _models_defined_in(settings) + _models_defined_in(ds_models),
    ids=lambda m: m.__name__,
)
def test_every_field_has_a_description(model: type[BaseModel]) -> None:
    assert (model.__doc__ or "").strip(), f"{model.__name__} has no class docstring"
    missing = [n for n, f in model.model_fields.items() if not (f.description or "").strip()]
    assert not missing, (
        f"{model.__module__}.{model.__name__}: give {', '.join(missing)} a docstring (the"
        f" string under the field), then run `{reference.COMMAND}`"
    )


def test_every_field_is_a_row_of_its_section_and_links_resolve() -> None:
    text = reference.markdown()
    sections = reference.wonderland_sections() + reference.deepspeed_sections()
    for section in sections:
        head = f"### {section.title}\n"
        assert head in text, head
        table = text.split(head, 1)[1].split("\n### ", 1)[0]
        rows = re.findall(r"^\| `(\w+)` \|", table, flags=re.M)
        assert rows == list(section.model.model_fields), section.title
    anchors = {s.anchor for s in sections}
    for link in re.findall(r"\]\(#([^)]+)\)", text):
        assert link in anchors, link
