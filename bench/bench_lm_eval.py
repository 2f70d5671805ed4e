"""What stage 17's downstream tasks cost, against the way teams do it today: export, then
lm-eval's ``hf`` model by hand.

The causal-LM task of the tests, larger: a Llama (``--hidden``, ``--layers``) trained briefly
in stages 15 and 16 under ZeRO-3 on 2 ranks, and three lm-eval tasks over ``--docs`` documents
(multiple choice among four, greedy generation, rolling perplexity; ``--fewshot`` examples per
prompt, so contexts have the length of real benchmarks'), written by
``tests/helpers/lm_tasks.py``. Two measurements, the sides alternating ``--reps`` times:

* requests per second: stage 17's scoring (rank 0's wall time inside lm-eval, per checkpoint,
  2 ranks, every parameter partitioned) against lm-eval's ``hf`` model on the stage-18 export
  in one process (``simple_evaluate`` timed after the model is loaded), same batch size, the
  same machine (both use both cores: 2 ranks of 1 thread, 1 process of 2 threads);
* the whole job, both checkpoints: ``wonderland train --stage 17`` (loss sweep, tasks, gate,
  report), launch to exit (a failing gate, exit 3, costs the same), against exporting both checkpoints (``--stage 18``) and running the
  ``lm_eval`` command on each.

    python bench/bench_lm_eval.py --out R.json            # ~10 min on 2 cores
    python bench/bench_lm_eval.py --quick --out R.json    # seconds of scoring: the smoke test
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.helpers import lm_tasks  # noqa: E402

TASKS = ["colors_mc", "colors_gen", "colors_ppl"]
BIN = Path(sys.executable).parent
ENV = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
ENV.pop("OMP_NUM_THREADS", None)  # each side takes the whole machine its own way

HF_SIDE = """
import json, sys, time
import lm_eval
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager
export, include, batch, fewshot, tasks = sys.argv[1:6]
lm = HFLM(pretrained=export, dtype="float32", device="cpu", batch_size=int(batch))
manager = TaskManager(include_path=include)
t0 = time.perf_counter()
res = lm_eval.simple_evaluate(model=lm, tasks=tasks.split(","), task_manager=manager,
                              num_fewshot=int(fewshot), log_samples=True)
seconds = time.perf_counter() - t0
requests = sum(len(s["arguments"]) for v in res["samples"].values() for s in v)
print(json.dumps({"seconds": seconds, "requests": requests}))
"""


def run(*args: str, timeout: int = 1800, accept: tuple[int, ...] = (0,)) -> float:
    t0 = time.perf_counter()
    r = subprocess.run(args, cwd=REPO, env=ENV, capture_output=True, text=True, timeout=timeout)
    if r.returncode not in accept:
        sys.exit(
            f"{' '.join(args[:4])}... failed ({r.returncode}):\n{(r.stdout + r.stderr)[-3000:]}"
        )
    return time.perf_counter() - t0


def wonderland(*args: str, accept: tuple[int, ...] = (0,)) -> float:
    return run(str(BIN / "wonderland"), *args, accept=accept)


def requests_in(results: Path) -> int:
    body = json.loads(results.read_text())
    return sum(len(s["arguments"]) for v in body["samples"].values() for s in v)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--docs", type=int, default=256, help="documents per task")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--fewshot", type=int, default=5)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--quick", action="store_true", help="16 documents, a tiny model, 1 rep")
    args = ap.parse_args()
    if args.quick:
        args.docs, args.hidden, args.layers, args.fewshot, args.reps = 16, 64, 2, 1, 1
    work = Path(tempfile.mkdtemp(prefix="bench_lm_eval_"))
    try:
        extra = {"num_fewshot": args.fewshot, "batch_size": args.batch_size, "log_samples": True}
        config = lm_tasks.setup(
            work, TASKS, docs=args.docs, hidden=args.hidden, layers=args.layers, **extra
        )
        body = json.loads(config.read_text())
        body["wonderland"]["stage_train_steps"] = {"15": 20, "16": 10}
        config.write_text(json.dumps(body))
        train = work / "trained"
        wonderland("train", "--stage", "15", "--config", str(config), "--run-dir", str(train))
        wonderland(
            "train", "--stage", "16", "--config", str(config), "--run-dir", str(train),
            "--resume", "auto", "--optimizer-state", "--scheduler-state",
        )  # fmt: skip
        ckpt15 = next((train / "stage15" / "checkpoints").glob("global_step*"))
        sides: dict[str, list[float]] = {"stage17": [], "by_hand": []}
        rates: dict[str, list[float]] = {"wonderland": [], "lm_eval_hf": []}
        for rep in range(args.reps):
            order = ["stage17", "by_hand"] if rep % 2 == 0 else ["by_hand", "stage17"]
            for side in order:
                run_dir = work / f"{side}{rep}"
                shutil.copytree(train, run_dir)
                if side == "stage17":
                    flags = ["--config", str(config), "--run-dir", str(run_dir), "--resume", "auto"]
                    sides[side].append(wonderland("train", "--stage", "17", *flags, accept=(0, 3)))
                    report = json.loads((run_dir / "stage17" / "report.json").read_text())
                    for name, seconds in report["lm_eval_seconds"].items():
                        n = requests_in(run_dir / "stage17" / "lm_eval" / f"{name}.json")
                        rates["wonderland"].append(n / seconds)
                    continue
                t0 = time.perf_counter()
                exports = []
                for out, resume in ((run_dir, "auto"), (run_dir / "e15", str(ckpt15))):
                    wonderland(
                        "train", "--stage", "18", "--config", str(config), "--run-dir", str(out),
                        "--resume", resume,
                    )  # fmt: skip
                    exports.append(out / "stage18")
                for export in exports:
                    run(
                        str(BIN / "lm-eval"), "run", "--model", "hf", "--model_args",
                        f"pretrained={export},dtype=float32", "--tasks", ",".join(TASKS),
                        "--include_path", str(work / "tasks"), "--batch_size",
                        str(args.batch_size), "--num_fewshot", str(args.fewshot), "--device",
                        "cpu", "--output_path", str(run_dir / f"lm_eval_{export.parent.name}"),
                    )  # fmt: skip
                sides[side].append(time.perf_counter() - t0)
                r = subprocess.run(
                    [sys.executable, "-c", HF_SIDE, str(exports[0]), str(work / "tasks"),
                     str(args.batch_size), str(args.fewshot), ",".join(TASKS)],
                    cwd=REPO, env=ENV, capture_output=True, text=True, check=True,
                )  # fmt: skip
                got = json.loads(r.stdout.strip().splitlines()[-1])
                rates["lm_eval_hf"].append(got["requests"] / got["seconds"])
        ours, theirs = (
            statistics.median(rates["wonderland"]),
            statistics.median(rates["lm_eval_hf"]),
        )
        whole17, by_hand = statistics.median(sides["stage17"]), statistics.median(sides["by_hand"])
        result = {
            "docs": args.docs,
            "model": {"hidden": args.hidden, "layers": args.layers},
            "fewshot": args.fewshot,
            "batch_size": args.batch_size,
            "requests_per_s": {"wonderland_2_ranks_zero3": ours, "lm_eval_hf_export": theirs},
            "requests_per_s_ratio": ours / theirs,
            "whole_s": {"stage17_both_checkpoints": whole17, "export_and_lm_eval_both": by_hand},
            "whole_ratio": whole17 / by_hand,
            "samples": {"rates": rates, "sides": sides},
        }
        Path(args.out).write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "samples"}, indent=2))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
