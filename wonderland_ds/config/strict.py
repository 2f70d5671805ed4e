"""The base of every settings model: strict types, no unknown key, docstrings as descriptions."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class _Strict(BaseModel):
    # Each field's docstring is its description: docs/configuration.md is generated from them.
    model_config = ConfigDict(
        extra="forbid", strict=True, frozen=True, use_attribute_docstrings=True
    )
