"""The configuration reference (docs/configuration.md), generated from the config's models.

Every field of the ``"wonderland"`` section and of the DeepSpeed keys the engine types gets a
row (key, type, default, meaning); the meaning is the field's docstring, which pydantic keeps
as its description (``use_attribute_docstrings``). Regenerate the page with::

    python -m wonderland_ds.config.reference > docs/configuration.md
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Iterator
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
from pydantic import BaseModel
from pydantic.fields import FieldInfo

from wonderland_ds.config.ds_models import SCHEDULER_PARAMS, WONDERLAND_KEY, DSConfig
from wonderland_ds.config.settings import WonderlandSettings

COMMAND = "python -m wonderland_ds.config.reference > docs/configuration.md"

INTRO = f"""\
# Configuration reference

A wonderland config is a DeepSpeed JSON config with one more top-level object,
`"wonderland"`: the run's own settings, which DeepSpeed has no key for. `wonderland check
CONFIG` validates the whole file without a GPU and reports every problem at once, each with
its fix (exit 2 on an error); `wonderland train` refuses a config that does not pass.

- **The `wonderland` section** is validated against the tables below: an unknown key, a value
  of the wrong type (`"8"` for `8`, `1` for `true`) or out of range is refused. The section
  may be left out: every field of it has a default.
- **DeepSpeed's keys** are handed to `deepspeed.initialize` unchanged (the `wonderland` section
  stripped, the batch sizes closed for the world size). The keys the engine depends on are
  typed in the tables of the second part; every other key passes through, but it must be one
  the installed DeepSpeed knows, because DeepSpeed silently ignores unknown top-level keys and
  typos in several sections. `"auto"` values (Hugging Face templates) are filled where the
  model, the world size or the stage plan gives the value, and refused by key where nothing
  does ([models-and-data.md](models-and-data.md#models-bigger-than-a-rank)).
- The shipped configs in `ds_configs/` are complete examples, each passing `check`.

Types are JSON types; a range is written `[low, high]` (`(` or `)` where the bound itself is
excluded). This page is generated from the models' field docstrings
(`wonderland_ds/config/settings.py`, `lm_settings.py` and `ds_models.py` beside it): edit those, then
run `{COMMAND}`.
"""

_JSON_NAMES: dict[Any, str] = {
    bool: "boolean",
    int: "integer",
    float: "number",
    str: "string",
    type(None): "null",
    Any: "any",
}


def _anchor(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to '-'."""
    return re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")


def _text(doc: str | None) -> str:
    """One table cell from a docstring: reST literals as Markdown, one line, pipes escaped."""
    text = " ".join(inspect.cleandoc(doc or "").split())
    return text.replace("``", "`").replace("|", "\\|")


def _paragraphs(doc: str | None) -> str:
    parts = re.split(r"\n\s*\n", inspect.cleandoc(doc or ""))
    return "\n\n".join(_text(p) for p in parts if p.strip())


def _models_in(annotation: Any) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in get_args(annotation) for m in _models_in(arg)]


class Section:
    """One table: a model, the dotted key(s) it sits at, and its heading."""

    def __init__(self, model: type[BaseModel], paths: list[str], title: str = "") -> None:
        self.model, self.paths = model, paths
        self.title = title or ", ".join(f"`{p}`" for p in paths)

    @property
    def anchor(self) -> str:
        return _anchor(self.title)


def _walk(model: type[BaseModel], path: str, found: dict[type[BaseModel], Section]) -> None:
    if model in found:
        found[model].paths.append(path)
        found[model].title = ", ".join(f"`{p}`" for p in found[model].paths)
        return
    found[model] = Section(model, [path])
    for name, field in model.model_fields.items():
        for sub in _models_in(field.annotation):
            _walk(sub, f"{path}.{name}" if path else name, found)


def wonderland_sections() -> list[Section]:
    found: dict[type[BaseModel], Section] = {}
    _walk(WonderlandSettings, WONDERLAND_KEY, found)
    return list(found.values())


def deepspeed_sections() -> list[Section]:
    found: dict[type[BaseModel], Section] = {}
    _walk(DSConfig, "", found)
    out = list(found.values())
    out[0].title = "top level"
    scheduler = next(i for i, s in enumerate(out) if s.paths == ["scheduler"])
    params = [
        Section(model, ["scheduler.params"], f"`scheduler.params` of `{name}`")
        for name, model in SCHEDULER_PARAMS.items()
    ]
    return out[: scheduler + 1] + params + out[scheduler + 1 :]


def documented_models() -> list[type[BaseModel]]:
    """Every model with a table on the page."""
    return [s.model for s in (*wonderland_sections(), *deepspeed_sections())]


def _number(value: object) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _bounds(field: FieldInfo) -> str:
    low = high = ""
    out = []
    for m in field.metadata:
        if isinstance(m, at.Ge):
            low = f"[{_number(m.ge)}"
        elif isinstance(m, at.Gt):
            low = f"({_number(m.gt)}"
        elif isinstance(m, at.Le):
            high = f"{_number(m.le)}]"
        elif isinstance(m, at.Lt):
            high = f"{_number(m.lt)})"
        elif isinstance(m, at.MinLen) and m.min_length == 1:
            out.append("not empty")
    if low and high:
        out.insert(0, f"{low}, {high}")
    elif low:
        out.insert(0, f"{'>=' if low[0] == '[' else '>'} {low[1:]}")
    elif high:
        out.insert(0, f"{'<=' if high[-1] == ']' else '<'} {high[:-1]}")
    return ", ".join(out)


def _type(annotation: Any, links: dict[type[BaseModel], Section]) -> str:
    origin = get_origin(annotation)
    if origin is Literal:
        return " or ".join(f"`{json.dumps(a)}`" for a in get_args(annotation))
    if origin in (Union, types.UnionType):
        return " or ".join(_type(a, links) for a in get_args(annotation))
    if origin is list:
        return f"array of {_type(get_args(annotation)[0], links)}"
    if origin is dict:
        value = get_args(annotation)[1]
        return "object" if value is Any else f"object of {_type(value, links)}"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        section = links.get(annotation)
        return f"[object](#{section.anchor})" if section else "object"
    return _JSON_NAMES.get(annotation, getattr(annotation, "__name__", str(annotation)))


def _default(field: FieldInfo) -> str:
    if field.is_required():
        return "required"
    value = field.get_default(call_default_factory=True, validated_data={})
    return "its defaults" if isinstance(value, BaseModel) else f"`{json.dumps(value)}`"


def _table(section: Section, links: dict[type[BaseModel], Section]) -> Iterator[str]:
    yield f"### {section.title}"
    yield ""
    doc = section.model.__doc__
    if doc and doc is not BaseModel.__doc__:
        yield _paragraphs(doc)
        yield ""
    yield "| key | type | default | meaning |"
    yield "|---|---|---|---|"
    for name, field in section.model.model_fields.items():
        kind = _type(field.annotation, links)
        bounds = _bounds(field)
        kind = f"{kind}, {bounds}" if bounds else kind
        yield f"| `{name}` | {kind} | {_default(field)} | {_text(field.description)} |"
    yield ""


def markdown() -> str:
    """The whole of docs/configuration.md."""
    lines = [INTRO]
    for heading, sections, note in (
        (
            'The `"wonderland"` section',
            wonderland_sections(),
            "Settings of the run and its stages; DeepSpeed never sees them.",
        ),
        (
            "DeepSpeed keys the engine reads",
            deepspeed_sections(),
            "The DeepSpeed keys wonderland types and checks; any other key DeepSpeed knows"
            " passes through unchanged. Unknown keys are refused at the top level, in `fp16`,"
            " `bf16`, `zero_optimization` and its offload sections (against the installed"
            " DeepSpeed's own keys, more than the rows here), in `checkpoint` and in the params"
            " of the three warmup schedules.",
        ),
    ):
        links = {s.model: s for s in sections}
        lines += [f"## {heading}", "", note, ""]
        for section in sections:
            lines += _table(section, links)
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    print(markdown(), end="")
