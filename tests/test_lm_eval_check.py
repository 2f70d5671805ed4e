"""``wonderland.eval.tasks`` refused before any launch: each broken task named with the fix,
exit 2, no traceback, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import lm_tasks
from tests.helpers.util import REPO, snapshot
from wonderland_ds.cli import main as cli

pytest.importorskip("lm_eval")


@pytest.fixture(scope="module")
def base(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("eval_check")
    lm_tasks.setup(tmp, ["colors_mc"])
    return tmp


@pytest.fixture
def setup(base, tmp_path, monkeypatch):
    """A copy of the base folder and ``edit(tasks, change)`` writing its config."""
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    tmp = tmp_path / "t"
    shutil.copytree(base, tmp)

    def edit(tasks: list[str], change=None) -> Path:
        path = lm_tasks.config(tmp, tasks)
        body = json.loads(path.read_text())
        if change:
            change(body["wonderland"])
        path.write_text(json.dumps(body))
        return path

    return edit, tmp


def refused(capsys, config: Path, rule: str, *extra: str) -> dict:
    before = snapshot(config.parent)
    rc = cli.main(["check", str(config), "--json", *extra])
    captured = capsys.readouterr()
    found = json.loads(captured.out)
    assert rc == 2, found
    assert "Traceback" not in captured.err
    assert snapshot(config.parent) == before  # nothing written next to the config
    hits = [f for f in found if f["rule"] == rule and f["severity"] == "error"]
    assert hits, found
    return hits[0]


def test_tasks_that_build_pass_check(capsys, setup):
    edit, _ = setup
    rc = cli.main(["check", str(edit(["colors", "colors_ppl"])), "--json"])
    found = json.loads(capsys.readouterr().out)
    assert rc == 0, found
    ok = next(f for f in found if f["rule"] == "eval-tasks")
    assert "3 lm-eval task(s) build: colors_gen, colors_mc, colors_ppl" in ok["message"]


def test_an_unknown_task_is_named_with_the_closest(capsys, setup):
    edit, _ = setup
    hit = refused(capsys, edit(["colours_mc"]), "eval-task-unknown")
    assert "'colours_mc'" in hit["message"] and "did you mean 'colors_mc'" in hit["message"]
    assert hit["path"] == "wonderland.eval.tasks" and "lm-eval ls tasks" in hit["fix"]


def test_a_yaml_that_does_not_load_is_named(capsys, setup):
    edit, tmp = setup
    broken = tmp / "tasks" / "broken.yaml"
    broken.write_text("task: broken\ndataset_path: json\n  bad: [indent\n")
    hit = refused(capsys, edit(["colors_mc"]), "eval-task-yaml")
    assert hit["file"] == str(broken) and "does not load" in hit["message"]


def test_a_missing_data_file_is_named_with_its_task(capsys, setup):
    edit, tmp = setup
    yaml = tmp / "tasks" / "colors_mc.yaml"
    yaml.write_text(yaml.read_text().replace("colors.jsonl", "missing.jsonl"))
    hit = refused(capsys, edit(["colors_mc"]), "eval-task-build")
    assert "task 'colors_mc'" in hit["message"] and "missing.jsonl" in hit["message"]
    assert hit["file"] == str(yaml)


def test_a_key_lm_eval_does_not_know_is_named(capsys, setup):
    edit, tmp = setup
    yaml = tmp / "tasks" / "colors_mc.yaml"
    yaml.write_text(yaml.read_text().replace("output_type:", "output_typo:"))
    hit = refused(capsys, edit(["colors_mc"]), "eval-task-build")
    assert "output_typo" in hit["message"]


def test_a_model_without_a_tokenizer_is_refused(capsys, setup):
    edit, tmp = setup
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp / "model" / name).unlink()
    hit = refused(capsys, edit(["colors_mc"]), "eval-tokenizer")
    assert "save the model's tokenizer" in hit["fix"] and hit["path"] == "wonderland.model.hf"


def test_fewer_documents_than_ranks_is_refused(capsys, setup):
    edit, _ = setup
    hit = refused(
        capsys,
        edit(["colors_mc"], lambda w: w["eval"].update(limit=1)),
        "eval-task-documents",
        "--world-size",
        "2",
    )
    assert "1 document(s)" in hit["message"] and "2 ranks" in hit["message"]


def test_include_path_must_be_a_folder(capsys, setup):
    edit, tmp = setup
    cfg = edit(["colors_mc"], lambda w: w["eval"].update(include_path=str(tmp / "nope")))
    refused(capsys, cfg, "eval-include-path")


def test_tasks_need_the_causal_lm_task(capsys, tmp_path):
    body = json.loads((REPO / "ds_configs" / "cpu_zero2_fp32.json").read_text())
    body["wonderland"]["eval"] = {"tasks": ["hellaswag"]}
    path = tmp_path / "digits.json"
    path.write_text(json.dumps(body))
    rc = cli.main(["check", str(path)])
    assert rc == 2 and "is not causal-lm" in capsys.readouterr().out


def test_without_lm_eval_the_install_line_is_named(setup):
    edit, _ = setup
    code = (
        "import sys; sys.modules['lm_eval'] = None\n"
        "from wonderland_ds.cli.main import main\n"
        f"sys.exit(main(['check', {str(edit(['colors_mc']))!r}]))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "[eval-lm-eval-missing]" in result.stdout and "pip install" in result.stdout
    assert "Traceback" not in result.stderr


def test_the_pipeline_refuses_a_broken_task_before_stage_15(capsys, setup):
    edit, tmp = setup
    cfg = edit(["colours_mc"])
    run = tmp / "run"
    rc = cli.main(
        ["pipeline", "--from", "15", "--to", "17", "--config", str(cfg), "--run-dir", str(run)]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "[eval-task-unknown]" in err and "Traceback" not in err
    assert not run.exists()  # stage 15 never started
