"""``wonderland status RUN_DIR``: each stage's true state (from its processes and heartbeats,
not only run.json), the last step it reached, its newest complete checkpoint, what to run
next, last metrics, restarts and guard events.

One state per stage: the JSON form gives ``state`` and leaves out the ``status`` run.json
recorded (a stage recorded ``running`` whose processes are gone is ``interrupted``).
"""

from __future__ import annotations

import argparse
import json
import shlex
from pathlib import Path
from typing import Any

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK, Finding, Refused

#: States whose stage may be continued from its newest complete checkpoint.
UNFINISHED = ("interrupted", "preempted", "failed", "restarting", "disk-full")


def _live(stage_dir: Path, entry: dict) -> dict:
    """Last metrics row, ETA while running, and guard events, read from the stage folder."""
    import csv

    out: dict = {}
    try:
        with open(stage_dir / "metrics.csv", newline="") as fh:
            rows = list(csv.DictReader(fh))
    except OSError:
        rows = []
    if rows:
        out["last_metrics"] = rows[-1]
        target = entry.get("end_step")
        if entry.get("state") == "running" and target and len(rows) > 1:
            per_step = (float(rows[-1]["wall"]) - float(rows[0]["wall"])) / (len(rows) - 1)
            out["eta_s"] = round(max(0, target - int(rows[-1]["step"])) * per_step, 1)
    try:
        lines = (stage_dir / "guards.jsonl").read_text().splitlines()
    except OSError:
        lines = []
    counts: dict[str, int] = {}
    for line in lines:
        guard = json.loads(line).get("guard", "?")
        counts[guard] = counts.get(guard, 0) + 1
    if counts:
        out["warnings"] = counts
    return out


def _reached(stage_dir: Path, entry: dict) -> int | None:
    """The last step the stage reached: its record's, else the newest of its heartbeats'
    and its metrics' last row."""
    from wonderland_ds.run import liveness

    if entry.get("state") == "preempted" and (entry.get("stop") or {}).get("step") is not None:
        return int(entry["stop"]["step"])
    if entry.get("state") in ("done", "stale") and isinstance(entry.get("global_step"), int):
        return int(entry["global_step"])
    steps = [b.get("step") for b in liveness.heartbeats(stage_dir)]
    last = (entry.get("last_metrics") or {}).get("step")
    steps.append(int(last) if last not in (None, "") else None)
    known = [int(s) for s in steps if isinstance(s, int)]
    return max(known) if known else None


def _next(run_dir: Path, key: str, entry: dict) -> str | None:
    """The command that continues an unfinished stage, or starts it over when it has no
    checkpoint of its own to continue from; None for a running, done or refused one."""
    from wonderland_ds.config import stages

    if entry.get("state") not in UNFINISHED:
        return None
    argv = list(entry.get("argv") or [])
    if not argv:
        return None
    st = stages.get(int(key))
    for flag in ("--resume", "--run-dir"):
        while flag in argv[:-1]:
            i = argv.index(flag)
            del argv[i : i + 2]
    own = entry.get("latest_complete_checkpoint") is not None
    source = entry.get("input_checkpoint") or entry.get("resumed_from")
    if st.kind == "train" and own:
        argv += ["--resume", "auto"]  # its own newest complete checkpoint
    elif source:
        argv += ["--resume", str(source)]  # where this attempt started
    argv += (entry.get("front") or {}).get("launch_flags") or []
    return "wonderland train " + shlex.join([*argv, "--run-dir", str(run_dir)])


def _summary(entry: dict) -> str | None:
    """The stage's state in one line, for an unfinished stage."""
    state, step = entry.get("state"), entry.get("step")
    ckpt = entry.get("latest_complete_checkpoint")
    at = f" at step {step}" if step is not None else ""
    has = f"checkpoint {Path(ckpt).name}" if ckpt else "no checkpoint of this stage"
    nxt = entry.get("next")
    if state == "preempted":
        stop = entry.get("stop") or {}
        why = stop.get("detail") or stop.get("signal") or stop.get("reason") or "a signal"
        head = f"preempted{at} on {why}, {has}"
    elif state == "interrupted":
        age = entry.get("heartbeat_age_s")
        seen = f"last heartbeat {age:.0f} s ago" if age is not None else "no heartbeat"
        head = f"interrupted{at}: no process of it is alive ({seen}); {has}"
    elif state == "disk-full":
        head = f"{state}{at}: {entry.get('error') or 'the checkpoint disk is full'}"
        nxt = nxt and nxt + "   (once there is room)"
    elif state in ("failed", "restarting"):
        code = f"exit code {entry['exit_code']}: " if entry.get("exit_code") is not None else ""
        error = str(entry.get("error") or "no error recorded")[:200]
        head = f"{state}{at}: {code}{error}; {has}"
    else:
        return None
    if nxt is None:
        return head
    verb = "continue with" if ckpt else "start it over with"
    return f"{head}; {verb}: {nxt}"


def stage_views(run_dir: Path, data: dict) -> dict[str, dict[str, Any]]:
    """Per stage: its record with ``state`` in place of ``status``, the step it reached, its
    newest complete checkpoint, metrics and events, what to run next and a summary line."""
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.run import liveness as runstate

    states = runstate.true_states(run_dir, data)
    views: dict[str, dict[str, Any]] = {}
    for key, recorded in data["stages"].items():
        entry = {k: v for k, v in recorded.items() if k != "status"}
        stage_dir = run_dir / f"stage{key}"
        newest = ck.newest_complete(stage_dir / "checkpoints", deep=False)
        entry["latest_complete_checkpoint"] = str(newest.tag_dir) if newest else None
        entry.update(states.get(key, {}))
        entry.update(_live(stage_dir, entry))
        entry["step"] = _reached(stage_dir, entry)
        entry["next"] = _next(run_dir, key, entry)
        entry["summary"] = _summary(entry)
        views[key] = entry
    return views


def cmd_status(args: argparse.Namespace) -> int:
    from wonderland_ds.run import manifest

    given = args.run_dir_flag or args.run_dir
    if given is None:
        raise Refused("no run directory given", "pass RUN_DIR or --run-dir RUN_DIR")
    run_dir = Path(given)
    data = manifest.read(run_dir)
    if data is None:
        raise Refused(
            Finding(
                "status",
                "error",
                f"no readable {manifest.NAME} here",
                "pass a run directory made by wonderland train/pipeline",
                str(run_dir),
            )
        )
    data["stages"] = stage_views(run_dir, data)
    report = run_dir / "stage17" / "report.json"
    if report.exists():
        body = json.loads(report.read_text())
        data["gate"] = body["gate"]["verdict"]
        if body.get("tasks"):
            data["tasks"] = body["tasks"]
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(f"run {data['run_dir']}")
    for key in sorted(data["stages"], key=int):
        e = data["stages"][key]
        extra = f" loss {e['final_loss']:.4f}" if isinstance(e.get("final_loss"), float) else ""
        step = e["step"] if e.get("step") is not None else "-"
        print(
            f"  stage {key:>2} {e.get('name', ''):<24} {e.get('state', '?'):<12} step {step}{extra}"
        )
        if e.get("summary"):
            print(f"           {e['summary']}")
        if e.get("data_mix"):
            print(f"           data: {_mix_line(e)}")
        if e.get("state") == "stale":
            print(f"           stale: {e['stale_because']}")
        for a in e.get("allocations") or []:
            steps = f", {a['steps_done']} step(s)" if a.get("steps_done") is not None else ""
            why = f": {a['why']}" if a.get("why") else ""
            print(
                f"           Slurm job {a['job_id']} (restart {a['restart_count']}):"
                f" {a.get('outcome') or 'running'}{steps}{why}"
            )
        for ev in e.get("elastic") or []:
            print(f"           {_elastic_line(ev)}")
        for r in e.get("restarts") or []:
            print(
                f"           restart {r['attempt']}: {str(r['cause'])[:120]} (resumed from step"
                f" {r['resumed_from_step']}, {r['seconds_lost']} s lost)"
            )
        if e.get("latest_complete_checkpoint") and e.get("state") not in UNFINISHED:
            print(f"           latest complete checkpoint: {e['latest_complete_checkpoint']}")
        if e.get("last_metrics"):
            m = e["last_metrics"]
            eta = f", ETA {e['eta_s']:.0f} s" if e.get("eta_s") is not None else ""
            print(
                f"           last step {m.get('step')}: loss {m.get('loss')} lr {m.get('lr')}{eta}"
            )
        for guard, count in (e.get("warnings") or {}).items():
            print(f"           guard {guard}: {count} event(s)")
    if "gate" in data:
        print(f"  stage-17 gate: {data['gate']}")
    for r in data.get("tasks") or []:
        print(f"           {_task_line(r)}")
    return EXIT_OK


def _mix_line(e: dict[str, Any]) -> str:
    """The training data a stage read: its mix, each source's weight and epochs, and a
    declared change from the checkpoint's mix."""
    line = f"data.{e['data_mix']}"
    sources = e.get("sources") or {}
    if sources:
        line += (
            " ("
            + ", ".join(
                f"{n} {s['weight']:.3g}: {s['epochs']:.2f} epochs" for n, s in sources.items()
            )
            + ")"
        )
    elif (e.get("data_mix_change") or {}).get("sources"):
        line += f" ({e['data_mix_change']['sources']})"
    change = e.get("data_mix_change")
    if change:
        line += f", declared for this stage (the checkpoint's: data.{change['from']})"
    return line


def _task_line(r: dict[str, Any]) -> str:
    """One downstream task's metric: stage 15 -> 16 with lm-eval's standard errors."""

    def one(value: float, err: float | None) -> str:
        return f"{value:.3f}" + (f"±{err:.3f}" if err is not None else "")

    mark = "  FAIL" if r["failed"] else ""
    return (
        f"{r['task']} {r['metric']}: {one(r['stage15'], r['stage15_stderr'])} ->"
        f" {one(r['stage16'], r['stage16_stderr'])} (p {r['p_holm']:.2g}){mark}"
    )


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("status", help="stages, outcomes and checkpoints of a run directory")
    p.add_argument("run_dir", metavar="RUN_DIR", nargs="?")
    p.add_argument("--run-dir", dest="run_dir_flag", metavar="RUN_DIR", help="the run directory")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)


def _elastic_line(ev: dict[str, Any]) -> str:
    """One shrink or grow of a stage's nodes, as status shows it."""
    verb = "shrank" if ev.get("kind") == "shrink" else "grew"
    lost = f", lost {', '.join(ev['lost_hosts'])}" if ev.get("lost_hosts") else ""
    steps = f", {ev['steps_lost']} step(s) lost" if ev.get("steps_lost") is not None else ""
    again = ev.get("training_again_s")
    after = f", training again after {again:.0f} s" if again is not None else ""
    acc = ev.get("grad_acc") or []
    batch = (
        f"; global batch {ev['global_batch']} kept (grad_acc {acc[0]} -> {acc[1]})"
        if len(acc) == 2
        else ""
    )
    return (
        f"{verb} {ev.get('from_world')} -> {ev.get('to_world')} ranks at step"
        f" {ev.get('resumed_from_step')}{lost}{steps}{after}{batch}"
    )
