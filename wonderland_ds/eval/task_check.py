"""``wonderland.eval.tasks`` checked before any launch: what would stop stage 17 hours later.

lm-eval installed; the ``include_path`` folder there and every YAML in it loadable (lm-eval's
index skips a broken one without a word, and the task then looks unknown); every name a task,
group or tag lm-eval knows; every task built by lm-eval itself (its config keys, its data
files); at least one document per rank; and a tokenizer in the model directory. Each refusal
names the task, the file and the fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from wonderland_ds.config.explain import did_you_mean
from wonderland_ds.config.settings import Evaluation, WonderlandSettings
from wonderland_ds.core.findings import Finding, Refused

WHERE = "wonderland.eval.tasks"


def _yaml_error(path: Path) -> str | None:
    """Why ``path`` is not a YAML mapping (lm-eval's ``!function`` tags allowed), or None."""
    import yaml

    class Loader(yaml.SafeLoader):
        pass

    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)
    try:
        body = yaml.load(path.read_text(encoding="utf-8"), Loader=Loader)  # noqa: S506
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        return " ".join(str(exc).split())
    if not isinstance(body, dict):
        return f"it holds a {type(body).__name__}, not a task mapping"
    return None


def _folder_findings(spec: Evaluation, file: str) -> list[Finding]:
    assert spec.include_path is not None
    folder = Path(spec.include_path).expanduser()
    if not folder.is_dir():
        return [
            Finding(
                "eval-include-path",
                "error",
                f"eval.include_path {spec.include_path!r} is not a folder",
                "point it at the folder of your task YAML files",
                file,
                "wonderland.eval.include_path",
            )
        ]
    out = []
    for path in sorted(folder.rglob("*.y*ml")):
        why = _yaml_error(path)
        if why is not None:
            out.append(
                Finding(
                    "eval-task-yaml",
                    "error",
                    f"task file {path} does not load: {why}",
                    "fix the YAML (lm-eval skips a file it cannot read, and its task is unknown)",
                    str(path),
                    "wonderland.eval.include_path",
                )
            )
    return out


def _tokenizer_findings(hf_dir: str) -> list[Finding]:
    try:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(hf_dir)
    except Exception as exc:  # transformers raises many kinds for a missing tokenizer
        return [
            Finding(
                "eval-tokenizer",
                "error",
                f"the model directory {hf_dir} has no tokenizer that loads, and lm-eval's tasks"
                f" are text: {type(exc).__name__}: {' '.join(str(exc).split())[:300]}",
                "save the model's tokenizer there (tokenizer.save_pretrained(DIR))",
                hf_dir,
                "wonderland.model.hf",
            )
        ]
    return []


def _built(manager: Any, name: str, file: str) -> tuple[dict[str, Any], list[Finding]]:
    """lm-eval's own build of one task, group or tag: its leaf tasks by name."""
    entry = manager.task_index.get(name)
    source = str(getattr(entry, "yaml_path", "") or file)
    try:
        loaded = manager.load([name])
    except Exception as exc:  # whatever lm-eval or datasets raise for a task that cannot build
        return {}, [
            Finding(
                "eval-task-build",
                "error",
                f"task {name!r}: lm-eval could not build it: {type(exc).__name__}:"
                f" {' '.join(str(exc).split())[:400]}",
                "fix the task's YAML or its data files (paths are taken from the current"
                " directory)",
                source,
                WHERE,
            )
        ]
    return dict(loaded["tasks"]), []


def task_findings(spec: Evaluation, hf_dir: str | None, world: int, file: str) -> list[Finding]:
    """Every problem of ``spec.tasks`` for a model in ``hf_dir`` scored on ``world`` ranks."""
    if not spec.tasks:
        return []
    from wonderland_ds.eval.lm_eval import quiet_library, require

    try:
        require()
    except Refused as exc:
        return [Finding(f.rule, f.severity, f.message, f.fix, file, f.path) for f in exc.findings]
    with quiet_library():
        return _findings(spec, hf_dir, world, file)


def _findings(spec: Evaluation, hf_dir: str | None, world: int, file: str) -> list[Finding]:
    from wonderland_ds.eval.lm_eval import task_manager

    out = _folder_findings(spec, file) if spec.include_path else []
    if any(f.rule == "eval-include-path" for f in out):
        return out
    manager = task_manager(spec)
    known = list(manager.all_tasks)
    for name in spec.tasks:
        if name not in known:
            out.append(
                Finding(
                    "eval-task-unknown",
                    "error",
                    f"task {name!r} is neither one of lm-eval's nor in eval.include_path"
                    f" ({spec.include_path or 'not set'}); {did_you_mean(name, set(known))}".rstrip(
                        "; "
                    ),
                    "name a task `lm-eval ls tasks` lists, or put its YAML in eval.include_path",
                    file,
                    WHERE,
                )
            )
    if out:
        return out
    leaves: dict[str, Any] = {}
    for name in spec.tasks:
        built, problems = _built(manager, name, file)
        leaves.update(built)
        out += problems
    for name, task in sorted(leaves.items()):
        docs = len(task.eval_docs)
        if spec.limit is not None:
            docs = min(docs, int(spec.limit if spec.limit >= 1 else spec.limit * docs))
        if docs < world:
            out.append(
                Finding(
                    "eval-task-documents",
                    "error",
                    f"task {name!r} has {docs} document(s) to score, fewer than the {world}"
                    " ranks that share them",
                    "give the task more documents (or a larger eval.limit), or evaluate on"
                    " fewer ranks (--nproc)",
                    file,
                    WHERE,
                )
            )
    if hf_dir is not None:
        out += _tokenizer_findings(hf_dir)
    if not out:
        out.append(
            Finding(
                "eval-tasks",
                "ok",
                f"{len(leaves)} lm-eval task(s) build: {', '.join(sorted(leaves))}",
                "",
                file,
                WHERE,
            )
        )
    return out


def settings_findings(settings: WonderlandSettings, world: int, file: str) -> list[Finding]:
    """:func:`task_findings` for a config's settings (its model directory's tokenizer)."""
    hf_dir = str(Path(settings.model.hf).expanduser()) if settings.model else None
    return task_findings(settings.eval, hf_dir, world, file)
