"""What rank 0 shows while a training stage runs; every other rank stays quiet.

On a terminal a tqdm bar (step, ETA, rate) with the figures after it; anywhere else (CI logs,
files, ``wonderland pipeline`` capturing a child) one plain line every ``every`` steps, plus the
first and the last step. Both show the step, ETA, samples/s (tokens/s for language models),
loss, LR, the loss scale when there is one and the data-stall share: the time the step loop
waited for the next batch. Rates and the stall share are over the last ``window`` steps (what
the run is doing now); :meth:`close` prints the whole stage's figures. Each checkpoint gets a
one-line summary.

Rows are the trainer's judged steps (:class:`~wonderland_ds.training.rows.StepRow`).
"""

from __future__ import annotations

import sys
import time
from collections import deque
from pathlib import Path
from typing import Any, Literal, TextIO

from wonderland_ds.training.rows import StepRow

PREFIX = "[wonderland]"


def hms(seconds: float | None) -> str:
    """``1:02:03``; ``2d 03:04:05`` past a day; ``?`` when unknown."""
    if seconds is None or seconds != seconds or seconds == float("inf"):
        return "?"
    s = int(round(max(0.0, seconds)))
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    return (f"{d}d {h:02d}:{m:02d}:{s:02d}") if d else f"{h}:{m:02d}:{s:02d}"


def _secs(s: float) -> str:
    return f"{s:.1f} s" if s >= 1 else f"{s:.2f} s"


def _size(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def rate(value: float) -> str:
    """``812``, ``12.3k``, ``4.56M``: per-second figures at a glance."""
    for limit, suffix in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if value >= limit:
            return f"{value / limit:.3g}{suffix}"
    return f"{value:.3g}" if value < 100 else f"{value:.0f}"


class ProgressDisplay:
    """Rank 0's progress display for one training stage.

    ``end_step`` is the global step the stage ends at (``fit``'s ``end``), ``start_step`` the
    global step it starts or resumes from. ``samples_per_step`` is the global batch
    (micro x grad-acc x data-parallel size); ``tokens_per_sample`` turns samples/s into tokens/s
    for language models. ``mode``: ``auto`` (a bar when ``stream`` is a terminal), ``bar`` or
    ``lines``. ``rank`` defaults to this process's rank; any rank but 0 prints nothing.
    """

    def __init__(
        self,
        stage: int,
        end_step: int,
        start_step: int,
        samples_per_step: int,
        tokens_per_sample: int | None = None,
        every: int = 50,
        stream: TextIO | None = None,
        rank: int | None = None,
        mode: Literal["auto", "bar", "lines"] = "auto",
        window: int = 50,
    ) -> None:
        if rank is None:
            from wonderland_ds.core import distributed as dist

            rank = dist.rank()
        self.quiet = rank != 0
        self.stage, self.end, self.start = stage, end_step, start_step
        self.samples_per_step, self.tokens = samples_per_step, tokens_per_sample
        self.every = max(1, every)
        self.stream = stream or sys.stdout
        self.recent: deque[tuple[float, int, float, float, float]] = deque(maxlen=max(2, window))
        self.t0 = time.time()
        self.first_wall: float | None = None
        self.last: StepRow | None = None
        self.step_total = self.wait_total = 0.0
        self.steps_done = 0
        self.saves, self.save_s = 0, 0.0
        self.bar: Any = None
        self.closed = False
        if self.quiet:
            return
        tty = bool(getattr(self.stream, "isatty", lambda: False)())
        if mode == "bar" or (mode == "auto" and tty):
            from tqdm import tqdm

            self.bar = tqdm(
                total=end_step,
                initial=start_step,
                desc=f"stage {stage}",
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
                smoothing=0.05,
            )

    # ------------------------------------------------------------ figures

    def figures(self) -> dict[str, float | None]:
        """The numbers the display shows, for the step last given to :meth:`step`."""
        if not self.recent:
            return {}
        wall, step, samples, _, _ = self.recent[-1]
        w0, s0, n0, _, _ = self.recent[0]
        step_s = sum(r[3] for r in self.recent)
        wait_s = sum(r[4] for r in self.recent)
        if len(self.recent) >= 2 and wall > w0 and step > s0:
            per_step = (wall - w0) / (step - s0)
            sps = (samples - n0) / (wall - w0)
        else:  # one step seen: its own timing
            last_s = self.recent[-1][3]
            per_step = last_s if last_s > 0 else float("nan")
            sps = self.samples_per_step / last_s if last_s > 0 else float("nan")
        return {
            "step": step,
            "eta_s": max(0, self.end - step) * per_step,
            "samples_per_s": sps,
            "tokens_per_s": sps * self.tokens if self.tokens else None,
            "data_stall": wait_s / step_s if step_s > 0 else 0.0,
            "elapsed_s": wall - (self.first_wall if self.first_wall is not None else self.t0),
        }

    def line(self, loss_scale: float | None = None) -> str:
        """The plain progress line for the step last given to :meth:`step`."""
        f, row = self.figures(), self.last
        step = int(f["step"] or 0)
        pct = 100.0 * (step - self.start) / max(1, self.end - self.start)
        parts = [f"{PREFIX} stage {self.stage} step {step}/{self.end} ({pct:.0f}%)"]
        loss, lr, gnorm = (None, None, None) if row is None else (row.loss, row.lr, row.grad_norm)
        figs = []
        if loss is not None:
            figs.append(f"loss {loss:.4g}")
        if lr is not None:
            figs.append(f"lr {lr:.3g}")
        if gnorm is not None:
            figs.append(f"grad-norm {gnorm:.3g}")
        if loss_scale is not None:
            figs.append(f"loss-scale {loss_scale:g}")
        parts.append(" ".join(figs))
        speed = f"{rate(f['samples_per_s'] or 0.0)} samples/s"
        if f.get("tokens_per_s") is not None:
            speed += f" {rate(f['tokens_per_s'] or 0.0)} tokens/s"
        parts.append(speed)
        parts.append(f"data-stall {100 * (f['data_stall'] or 0.0):.1f}%")
        parts.append(f"ETA {hms(f['eta_s'])} elapsed {hms(f['elapsed_s'])}")
        return " | ".join(p for p in parts if p)

    # ------------------------------------------------------------ events

    def step(self, row: StepRow, loss_scale: float | None = None) -> None:
        """One optimizer step done (call it on every rank; only rank 0 shows anything)."""
        if self.quiet:
            return
        step = row.step
        wall = row.wall or time.time()
        samples = (
            float((step - self.start) * self.samples_per_step)
            if row.samples is None
            else float(row.samples)
        )
        step_s, wait_s = row.step_s or 0.0, row.data_wait_s or 0.0
        if self.first_wall is None:
            # The first step's wall time marks its end: count the stage from its start.
            self.first_wall = wall - step_s
        self.recent.append((wall, step, samples, step_s, wait_s))
        self.step_total += step_s
        self.wait_total += wait_s
        self.steps_done += 1
        self.last = row
        if self.bar is not None:
            f = self.figures()
            post = [f"loss {row.loss or 0:.4g}", f"lr {row.lr or 0:.3g}"]
            if loss_scale is not None:
                post.append(f"scale {loss_scale:g}")
            post.append(f"{rate(f['samples_per_s'] or 0.0)} samples/s")
            if f.get("tokens_per_s") is not None:
                post.append(f"{rate(f['tokens_per_s'] or 0.0)} tok/s")
            post.append(f"stall {100 * (f['data_stall'] or 0.0):.1f}%")
            self.bar.set_postfix_str(" ".join(post), refresh=False)
            self.bar.update(step - self.bar.n)
            return
        if self.steps_done == 1 or step % self.every == 0 or step >= self.end:
            print(self.line(loss_scale), file=self.stream, flush=True)

    def rewind(self, step: int) -> None:
        """A rollback reloaded ``step``: forget the rates measured past it."""
        if self.quiet:
            return
        self.recent.clear()
        if self.bar is not None:
            self.bar.n = step
            self.bar.refresh()

    def checkpoint(self, tag_dir: str | Path, seconds: float, background: bool = False) -> None:
        """One line per checkpoint: step, loss, size, time taken, where. ``background``: the
        save goes on after training resumed (``seconds`` is the time training was blocked;
        the size is not final yet, so it is left out)."""
        if self.quiet:
            return
        self.saves += 1
        self.save_s += seconds
        path = Path(tag_dir)
        loss = None if self.last is None else self.last.loss
        what = f"{path.name} complete in {_secs(seconds)}"
        if background:
            what = f"{path.name} saving in the background (training blocked {_secs(seconds)})"
        figs = [f"step {0 if self.last is None else self.last.step}"]
        if loss is not None:
            figs.append(f"loss {loss:.4g}")
        if not background and path.is_dir():
            figs.append(_size(sum(p.stat().st_size for p in path.rglob("*") if p.is_file())))
        self._print(f"{PREFIX} checkpoint {what}: {', '.join(figs)}, {path}")

    def note(self, text: str) -> None:
        """Any other line (a guard's warning...) without breaking the bar."""
        if not self.quiet:
            self._print(f"{PREFIX} {text}")

    def close(self, outcome: str = "done") -> None:
        """End the bar and print the stage's totals (``outcome``: e.g. "stopped" when a guard
        ended the stage). A second call does nothing."""
        if self.quiet or self.closed:
            return
        self.closed = True
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if not self.steps_done:
            return
        f = self.figures()
        took = f.get("elapsed_s") or 0.0
        sps = self.steps_done * self.samples_per_step / took if took > 0 else 0.0
        speed = f"{rate(sps)} samples/s"
        if self.tokens:
            speed += f" {rate(sps * self.tokens)} tokens/s"
        stall = self.wait_total / self.step_total if self.step_total > 0 else 0.0
        print(
            f"{PREFIX} stage {self.stage} {outcome}: steps {self.start}->{int(f.get('step') or 0)}"
            f" in {hms(took)}, {speed}, data-stall {100 * stall:.1f}%,"
            f" {self.saves} checkpoint(s) ({self.save_s:.1f} s blocked saving)",
            file=self.stream,
            flush=True,
        )

    def _print(self, text: str) -> None:
        if self.bar is not None:
            self.bar.write(text, file=self.stream)
        else:
            print(text, file=self.stream, flush=True)
