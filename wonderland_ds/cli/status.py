"""``wonderland status RUN_DIR``: each stage's true state (from its processes and heartbeats,
not only run.json), its newest complete checkpoint, last metrics, restarts and guard events."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from wonderland_ds.cli.common import Commands
from wonderland_ds.core.findings import EXIT_OK, Finding, Refused


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


def cmd_status(args: argparse.Namespace) -> int:
    from wonderland_ds.checkpoint import contract as ck
    from wonderland_ds.run import manifest

    run_dir = Path(args.run_dir)
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
    from wonderland_ds.run import liveness as runstate

    states = runstate.true_states(run_dir, data)
    for key, entry in data["stages"].items():
        root = run_dir / f"stage{key}" / "checkpoints"
        newest = ck.newest_complete(root, deep=False)
        entry["latest_complete_checkpoint"] = str(newest.tag_dir) if newest else None
        entry.update(states.get(key, {}))
        entry.update(_live(run_dir / f"stage{key}", entry))
    report = run_dir / "stage17" / "report.json"
    if report.exists():
        data["gate"] = json.loads(report.read_text())["gate"]["verdict"]
    if args.json:
        print(json.dumps(data, indent=2))
        return EXIT_OK
    print(f"run {data['run_dir']}")
    for key in sorted(data["stages"], key=int):
        e = data["stages"][key]
        extra = f" loss {e['final_loss']:.4f}" if isinstance(e.get("final_loss"), float) else ""
        print(
            f"  stage {key:>2} {e.get('name', ''):<24} {e.get('state', '?'):<12}"
            f" step {e.get('global_step', '-')}{extra}"
        )
        if e.get("state") == "interrupted":
            age = e.get("heartbeat_age_s")
            seen = f"last heartbeat {age:.0f} s ago" if age is not None else "no heartbeat"
            print(f"           no process of it is alive ({seen}); continue with --resume auto")
        if e.get("state") == "stale":
            print(f"           stale: {e['stale_because']}")
        if e.get("state") == "failed" and e.get("error"):
            code = f"exit code {e['exit_code']}: " if e.get("exit_code") is not None else ""
            print(f"           {code}{str(e['error'])[:200]}")
        for r in e.get("restarts") or []:
            print(
                f"           restart {r['attempt']}: {str(r['cause'])[:120]} (resumed from step"
                f" {r['resumed_from_step']}, {r['seconds_lost']} s lost)"
            )
        if e.get("latest_complete_checkpoint"):
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
    return EXIT_OK


def add_parser(sub: Commands) -> None:
    p = sub.add_parser("status", help="stages, outcomes and checkpoints of a run directory")
    p.add_argument("run_dir", metavar="RUN_DIR")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_status)
