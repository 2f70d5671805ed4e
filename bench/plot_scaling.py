"""Draw bench_scaling.sh's results: step and save time against model size and rank count.

    .venv/bin/python bench/plot_scaling.py RESULTS_DIR bench/scaling.png

Prints the table docs/performance.md quotes (medians over repetitions of each run's mean step time).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(folder: Path) -> list[dict]:
    rows = []
    for path in sorted(folder.glob("pylm_*.json")):
        r = json.loads(path.read_text())
        sides = r["mean_step_s"]
        save = r["save"]
        rows.append(
            {
                "params": save["params"],
                "world": r["world"],
                "raw_s": statistics.median(sides["raw"]),
                "wl_s": statistics.median(sides["wonderland"]),
                "ds_save_s": statistics.median(save["ds_sync_s"]),
                "wl_blocked_s": statistics.median(save["wl_blocked_s"]),
                "wl_complete_s": statistics.median(save["wl_complete_s"]),
                "bytes": save["checkpoint_bytes"],
            }
        )
    return rows


def main() -> None:
    folder, png = Path(sys.argv[1]), Path(sys.argv[2])
    rows = load(folder)
    print(
        "| params | ranks | raw step (s) | wonderland step (s) | ratio | DeepSpeed save (s)"
        " | wonderland blocked (s) | complete (s) | checkpoint MB |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in sorted(rows, key=lambda r: (r["world"], r["params"])):
        print(
            f"| {r['params'] / 1e6:.1f}M | {r['world']} | {r['raw_s']:.3f} | {r['wl_s']:.3f}"
            f" | {r['wl_s'] / r['raw_s']:.2f} | {r['ds_save_s']:.3f} | {r['wl_blocked_s']:.3f}"
            f" | {r['wl_complete_s']:.3f} | {r['bytes'] / 1e6:.0f} |"
        )
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4.2))
    two = sorted((r for r in rows if r["world"] == 2), key=lambda r: r["params"])
    x = [r["params"] / 1e6 for r in two]
    a.plot(x, [r["raw_s"] for r in two], "o-", label="step, plain DeepSpeed")
    a.plot(x, [r["wl_s"] for r in two], "s--", label="step, wonderland (guards on)")
    a.plot(x, [r["ds_save_s"] for r in two], "^-", label="save, DeepSpeed sync")
    a.plot(x, [r["wl_blocked_s"] for r in two], "v--", label="save, wonderland blocked")
    a.plot(x, [r["wl_complete_s"] for r in two], "d:", label="save, wonderland complete")
    a.set(xscale="log", yscale="log", xlabel="parameters (M), 2 ranks", ylabel="seconds")
    a.set_title("cost against model size (ZeRO-2 bf16)")
    a.legend(fontsize=8)
    # The world-size series: the size also run on 1 and 3 ranks (10.9M in the full run).
    wide = {r["params"] for r in rows if r["world"] != 2}
    mid = sorted((r for r in rows if r["params"] in wide), key=lambda r: r["world"])
    w = [r["world"] for r in mid]
    b.plot(w, [r["raw_s"] for r in mid], "o-", label="step, plain DeepSpeed")
    b.plot(w, [r["wl_s"] for r in mid], "s--", label="step, wonderland")
    b.plot(w, [r["ds_save_s"] for r in mid], "^-", label="save, DeepSpeed sync")
    b.plot(w, [r["wl_blocked_s"] for r in mid], "v--", label="save, wonderland blocked")
    b.set(xlabel="ranks (2 cores: 3 ranks oversubscribe)", ylabel="seconds", xticks=w)
    b.set_title(f"{min(wide, default=0) / 1e6:.1f}M parameters, 1 -> 2 -> 3 ranks")
    b.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
