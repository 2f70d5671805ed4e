"""Where a same-topology resume spends its time, wonderland against plain DeepSpeed.

    OMP_NUM_THREADS=1 .venv/bin/python bench/resume_timeline.py --reps 2 --out R.json

The checkpoint and both commands are bench_resume.py's (25.5M-parameter GPT, ZeRO-2 bf16, 2
ranks, each side resuming from a fresh copy). Each output line is stamped with the seconds
since the command started, and these milestones are read from it:

* wonderland: ``front_done`` (the front printed its launch line), ``spawned`` (the first
  rank's interpreter started, read from the ``sitecustomize`` below), ``resumed`` (the
  checkpoint is loaded and checked), ``start_check_done`` (the all-reduce verification table), ``first_step`` (metrics.csv);
* DeepSpeed: ``spawned``, ``imported`` (torch, DeepSpeed and the model built), ``loaded``
  (initialize and load_checkpoint), ``first_step``.

Each process of either side also times Python's garbage collector (a ``gc.callbacks`` timer
installed by a ``sitecustomize`` module put on PYTHONPATH for both sides alike): ``gc_s`` is
the seconds each process spent collecting before the first step ended, by role (``front``:
wonderland's command, ``runner``: DeepSpeed's ``deepspeed`` runner, ``launcher``: its
per-node ``deepspeed.launcher.launch``, ``rank0``, ``rank1``).

Sides alternate; one repetition of each is a timeline, not a benchmark of the total (that is
bench_resume.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "bench"))

from bench_resume import BIN, config, env, first_step_wall  # noqa: E402

from wonderland_ds.launch.command import free_port  # noqa: E402

#: Installed as ``sitecustomize`` for both sides: every collection's end (wall clock) and
#: duration, one line each, to GCLOG_DIR/<pid>.log, whose first line names the process and
#: when its interpreter started.
GC_TIMER = """
import gc, os, sys, time
_dir = os.environ.get("GCLOG_DIR")
if _dir:
    _fd = os.open(f"{_dir}/{os.getpid()}.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    _argv0 = (getattr(sys, "argv", None) or [""])[0]
    os.write(_fd, f"{os.environ.get('RANK', '-')} {time.time():.4f} {_argv0}\\n".encode())
    _t = [0.0]
    def _timer(phase, info):
        if phase == "start":
            _t[0] = time.perf_counter()
        else:
            os.write(_fd, f"{time.time():.4f} {time.perf_counter() - _t[0]:.6f}\\n".encode())
    gc.callbacks.append(_timer)
"""


def processes(folder: Path) -> list[tuple[str, float, list[str]]]:
    """Each logged process: its role, when it started (wall clock) and its collection lines."""
    out = []
    for log in sorted(folder.glob("*.log")):
        head, *lines = log.read_text().splitlines()
        rank, started, argv0 = head.split(" ", 2)
        if rank != "-":  # DeepSpeed's launcher sets RANK for its ranks only (`-m` or a script)
            role = f"rank{rank}"
        elif argv0 == "-m" or argv0.endswith("launch.py"):  # python -m deepspeed.launcher.launch
            role = "launcher"
        elif argv0 == "-c" or argv0.endswith("/deepspeed"):
            role = "runner"
        elif argv0.endswith("/wonderland"):
            role = "front"
        else:
            continue  # the benchmark's own helpers (none expected)
        out.append((role, float(started), lines))
    return out


def gc_seconds(folder: Path, until: float) -> dict[str, float]:
    """Seconds each process spent collecting before ``until`` (wall clock), by role."""
    out: dict[str, float] = {}
    for role, _, lines in processes(folder):
        spent = sum(float(d) for w, d in (x.split() for x in lines) if float(w) <= until)
        out[role] = round(out.get(role, 0.0) + spent, 3)
    return out


def spawned(folder: Path) -> float:
    """When the first rank's interpreter started (wall clock), the same on both sides."""
    return min(t for role, t, _ in processes(folder) if role.startswith("rank"))


def stamped(
    cmd: list[str], log: Path, marks: dict[str, str], extra_env: dict[str, str] | None = None
) -> tuple[float, dict[str, float]]:
    """Run ``cmd``; the first time a line contains a mark's text, that mark gets the line's
    time since the start. ``PHASE name wall`` lines give ``name`` their own wall clock."""
    got: dict[str, float] = {}
    t0 = time.time()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=dict(env(), PYTHONUNBUFFERED="1", **(extra_env or {})),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    assert proc.stdout is not None
    with open(log, "w") as fh:
        for line in proc.stdout:
            now = time.time() - t0
            fh.write(f"{now:8.3f} {line}")
            if line.startswith("PHASE "):
                _, name, wall = line.split()
                got.setdefault(name, float(wall) - t0)
            for name, text in marks.items():
                if name not in got and text in line:
                    got[name] = now
    if proc.wait() != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    return t0, got


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--dim", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    os.environ["WL_BENCH_DIM"], os.environ["WL_BENCH_LAYERS"] = str(args.dim), str(args.layers)
    work = Path(tempfile.mkdtemp(prefix="wl-bench-timeline-"))
    try:
        cfg = config(work, args.dim, args.layers)
        src = work / "stage15"
        subprocess.run(
            [str(BIN / "wonderland"), "train", "--stage", "15", "--config", str(cfg)]
            + ["--run-dir", str(src), "--hostfile", "hostfiles/localhost"],
            cwd=REPO,
            env=env(),
            check=True,
            capture_output=True,
        )
        tag = (src / "stage15" / "checkpoints" / "latest").read_text().strip()
        site = work / "gcsite"
        site.mkdir()
        (site / "sitecustomize.py").write_text(GC_TIMER)

        def gc_env(name: str) -> dict[str, str]:
            folder = work / f"gc-{name}"
            folder.mkdir()
            return {"GCLOG_DIR": str(folder), "PYTHONPATH": f"{site}{os.pathsep}{REPO}"}

        out: dict[str, list[dict]] = {"wonderland": [], "deepspeed": []}
        for rep in range(args.reps):
            run_dir = work / "wl"
            shutil.rmtree(run_dir, ignore_errors=True)
            shutil.copytree(src, run_dir, symlinks=True)
            os.sync()
            cmd = [str(BIN / "wonderland"), "train", "--stage", "16", "--config", str(cfg)]
            cmd += ["--run-dir", str(run_dir), "--resume", "auto"]
            cmd += ["--hostfile", "hostfiles/localhost"]
            marks = {
                "front_done": "launch: ",
                "resumed": "stage 16: resumed",
                "start_check_done": "all-reduce verification",
            }
            t0, got = stamped(cmd, work / f"wl{rep}.log", marks, gc_env(f"wl{rep}"))
            got["first_step"] = first_step_wall(run_dir, 16) - t0
            got["spawned"] = spawned(work / f"gc-wl{rep}") - t0
            row: dict = {k: round(v, 2) for k, v in got.items()}
            row["gc_s"] = gc_seconds(work / f"gc-wl{rep}", t0 + got["first_step"])
            out["wonderland"].append(row)

            fresh = work / "ds" / tag
            shutil.rmtree(fresh.parent, ignore_errors=True)
            shutil.copytree(src / "stage15" / "checkpoints" / tag, fresh, symlinks=True)
            os.sync()
            port = str(free_port())  # outside the ephemeral range and free, as the engine picks
            done = work / "ds.json"
            cmd = [str(BIN / "deepspeed"), "--num_gpus", "2", "--no_ssh_check"]
            cmd += ["--master_addr", "127.0.0.1", "--master_port", port, "bench/ds_resume.py"]
            cmd += ["--config", str(cfg), "--load-dir", str(fresh.parent), "--tag", tag]
            cmd += ["--out", str(done)]
            t0, got = stamped(cmd, work / f"ds{rep}.log", {}, gc_env(f"ds{rep}"))
            got["first_step"] = json.loads(done.read_text())["first_step_end"] - t0
            got["spawned"] = spawned(work / f"gc-ds{rep}") - t0
            row = {k: round(v, 2) for k, v in got.items()}
            row["gc_s"] = gc_seconds(work / f"gc-ds{rep}", t0 + got["first_step"])
            out["deepspeed"].append(row)
            from wonderland_ds.core.distributed import shm_buffers

            for path in shm_buffers(port):  # plain DeepSpeed leaves its /dev/shm buffers behind
                Path(path).unlink(missing_ok=True)
        Path(args.out).write_text(json.dumps(out, indent=2))
        print(json.dumps(out, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
