"""Progress display and metrics sink: plain numbers in-process, then a real 2-rank DeepSpeed
run whose progress output, CSV and TensorBoard files are read back."""

from __future__ import annotations

import csv
import io
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from wonderland_ds.training import metrics as monitor
from wonderland_ds.training.progress import ProgressDisplay, hms, rate
from wonderland_ds.training.rows import StepRow

REPO = Path(__file__).resolve().parents[1]


def rows(n: int, start: int = 0, per_step: int = 64, dt: float = 0.02, wait: float = 0.001):
    """The trainer's rows (parsed from metrics.csv-shaped strings): a step every ``dt`` s."""
    out = []
    for i in range(1, n + 1):
        s = start + i
        out.append(
            {
                "step": s,
                "loss": f"{2.0 / s:.8g}",
                "lr": f"{1e-3 * s / 100:.8g}",
                "grad_norm": "0.5",
                "samples": per_step * s,
                "sample_digest": 0,
                "step_s": f"{dt * 0.9:.5f}",
                "data_wait_s": f"{wait:.6f}",
                "wall": f"{1000.0 + dt * s:.3f}",
            }
        )
    return [StepRow.parse(r) for r in out]


def test_hms_and_rate():
    assert hms(3723) == "1:02:03"
    assert hms(2 * 86400 + 5) == "2d 00:00:05"
    assert hms(None) == "?"
    assert rate(812) == "812"
    assert rate(12_345) == "12.3k"
    assert rate(4_560_000) == "4.56M"


def test_plain_lines_every_n_steps_with_their_fields():
    out = io.StringIO()  # not a terminal: line mode
    p = ProgressDisplay(15, 100, 0, 64, every=25, stream=out, rank=0)
    for r in rows(100):
        p.step(r, loss_scale=1024.0 if r.step == 100 else None)
    p.close()
    p.close()  # once only
    lines = out.getvalue().splitlines()
    steps = [int(m.group(1)) for ln in lines if (m := re.search(r" step (\d+)/100 ", ln))]
    assert steps == [1, 25, 50, 75, 100]  # the first step, every 25th and the last
    at50 = next(ln for ln in lines if " step 50/100 " in ln)
    assert "stage 15" in at50 and "(50%)" in at50
    assert "loss 0.04 " in at50 and "lr 0.0005 " in at50 and "grad-norm 0.5" in at50
    # a step every 0.02 s of 64 samples: 3200 samples/s; 50 steps left: ETA 1 s
    assert "3.2k samples/s" in at50 and "ETA 0:00:01" in at50
    # waited 0.001 s of each 0.018 s step
    assert "data-stall 5.6%" in at50
    assert "tokens/s" not in at50
    assert "loss-scale 1024" in lines[-2]
    assert lines[-1].startswith("[wonderland] stage 15 done: steps 0->100")
    assert "data-stall 5.6%" in lines[-1]


def test_language_model_shows_tokens_per_second_and_resume_counts_from_start():
    out = io.StringIO()
    p = ProgressDisplay(16, 600, 500, 8, tokens_per_sample=128, every=50, stream=out, rank=0)
    for r in rows(100, start=500, per_step=8, dt=0.1):
        p.step(r)
    p.close()
    at550 = next(ln for ln in out.getvalue().splitlines() if " step 550/600 " in ln)
    assert "(50%)" in at550  # of this stage's 100 steps, not of 600
    assert "80 samples/s" in at550 and "10.2k tokens/s" in at550  # 80 x 128 = 10240
    assert "ETA 0:00:05" in at550


def test_checkpoint_line_and_quiet_ranks(tmp_path):
    tag = tmp_path / "global_step20"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"x" * 2_500_000)
    out, other = io.StringIO(), io.StringIO()
    shown = ProgressDisplay(15, 40, 0, 64, every=10, stream=out, rank=0)
    quiet = ProgressDisplay(15, 40, 0, 64, every=10, stream=other, rank=1)
    for p in (shown, quiet):
        for r in rows(20):
            p.step(r)
        p.checkpoint(tag, 1.25)
        p.note("anything")
        p.close()
    text = out.getvalue()
    assert (
        f"[wonderland] checkpoint global_step20 complete in 1.2 s: step 20, loss 0.1, 2.5 MB, {tag}"
        in text
    )
    assert "1 checkpoint(s) (1.2 s blocked saving)" in text
    bg = io.StringIO()
    p = ProgressDisplay(15, 40, 0, 64, stream=bg, rank=0)
    p.step(rows(1)[0])
    p.checkpoint(tag, 0.031, background=True)
    assert (
        "checkpoint global_step20 saving in the background (training blocked 0.03 s): step 1,"
        f" loss 2, {tag}" in bg.getvalue()
    )
    assert other.getvalue() == ""


def test_monitor_sections_default_and_the_configs_own(tmp_path):
    mine = monitor.monitor_sections({}, tmp_path, tensorboard=True)
    assert mine["csv_monitor"] == {
        "enabled": True,
        "output_path": str(tmp_path / "monitor"),
        "job_name": "csv",
    }
    assert mine["tensorboard"]["enabled"] and mine["tensorboard"]["job_name"] == "tensorboard"
    theirs = monitor.monitor_sections(
        {"tensorboard": {"enabled": False}, "csv_monitor": {"enabled": True, "output_path": "/x"}},
        tmp_path,
        tensorboard=True,
    )
    assert theirs == {
        "tensorboard": {"enabled": False},
        "csv_monitor": {"enabled": True, "output_path": "/x"},
    }
    assert not monitor.monitor_sections({}, tmp_path, tensorboard=False)["tensorboard"]["enabled"]


def test_guard_figures():
    figs = monitor.guard_figures([1.3, 0.0, 1.1], loss_median=0.42, skipped_steps=2, events=1)
    assert figs["Guards/grad_norm_min"] == 0.0 and figs["Guards/grad_norm_max"] == 1.3
    assert figs["Guards/grad_norm_median"] == 1.1
    assert figs["Guards/grad_norm_min_over_median"] == 0.0  # a rank dropped its gradients
    assert figs["Guards/grad_norm_min_rank"] == 1.0  # ...and it is rank 1
    many = monitor.guard_figures([1.0] * 64)
    assert len(many) == 5  # summarized: the tag count does not grow with the world size
    assert figs["Guards/loss_median"] == 0.42
    assert figs["Guards/skipped_steps"] == 2.0 and figs["Guards/events"] == 1.0


def _ds_master(folder: Path, monkeypatch):
    """A DeepSpeed MonitorMaster with CSV and TensorBoard under ``folder``, as rank 0 of a
    process group that is not there (DeepSpeed's writers ask deepspeed.comm for the rank)."""
    import deepspeed.comm
    from deepspeed.monitor.config import get_monitor_config
    from deepspeed.monitor.monitor import MonitorMaster

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    return MonitorMaster(get_monitor_config(monitor.monitor_sections({}, folder, tensorboard=True)))


def test_batched_writes_equal_deepspeeds_own_write_events(tmp_path, monkeypatch):
    """write_batch (one open per CSV file, one TensorBoard event per step) writes what
    DeepSpeed's MonitorMaster.write_events writes event by event: the same CSV bytes, the same
    scalars read back from TensorBoard."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    theirs = _ds_master(tmp_path / "ds", monkeypatch)
    ours = _ds_master(tmp_path / "ours", monkeypatch)
    kept = _ds_master(tmp_path / "kept", monkeypatch)  # CSV files kept open, as the sink does
    files: dict = {}
    sink = monitor.MetricsSink({}, tmp_path / "unused", rank=1)  # only for .events()
    batches: list[list[tuple[str, float, int]]] = [[], []]
    for r in rows(12):
        extra = monitor.guard_figures([0.5, 0.25 * (r.step % 3)], loss_median=1.5)
        extra["Odd tag/with space"] = r.step / 7  # DeepSpeed turns spaces into _ too
        batches[r.step > 5] += sink.events(r, loss_scale=2.0**r.step, extra=extra)
    for batch in batches:  # two batches: the header is written once, rows append
        theirs.write_events(batch)
        monitor.write_batch(ours, batch)
        monitor.write_batch(kept, batch, files)
        assert len(files) == 14 and all(not fh.closed for fh in files.values())
    handles = list(files.values())
    monitor.close_files(files)
    assert files == {} and all(fh.closed for fh in handles)
    for master in (theirs, ours, kept):
        master.tb_monitor.summary_writer.close()

    ds_csv = sorted((tmp_path / "ds" / "monitor" / "csv").glob("*.csv"))
    our_csv = tmp_path / "ours" / "monitor" / "csv"
    assert len(ds_csv) == 14 and (our_csv / "Odd_tag_with_space.csv").exists()
    assert sorted(p.name for p in our_csv.glob("*.csv")) == [p.name for p in ds_csv]
    for path in ds_csv:
        assert (our_csv / path.name).read_bytes() == path.read_bytes(), path.name
        kept_csv = tmp_path / "kept" / "monitor" / "csv" / path.name
        assert kept_csv.read_bytes() == path.read_bytes(), path.name

    def scalars(folder: Path) -> dict[str, list[tuple[int, float]]]:
        acc = EventAccumulator(str(folder / "monitor" / "tensorboard"))
        acc.Reload()
        return {t: [(e.step, e.value) for e in acc.Scalars(t)] for t in acc.Tags()["scalars"]}

    expected = scalars(tmp_path / "ds")
    assert len(expected) == 14 and len(expected[monitor.LOSS]) == 12
    assert scalars(tmp_path / "ours") == expected


def test_batched_writes_hand_wandb_comet_and_other_monitors_the_events_as_they_are():
    class Recorder:
        def __init__(self) -> None:
            self.got: list[list[tuple[str, float, int]]] = []

        def write_events(self, events):
            self.got.append(list(events))

    class Master:  # MonitorMaster's shape with only wandb and comet enabled
        tb_monitor = csv_monitor = None
        wandb_monitor, comet_monitor = Recorder(), Recorder()

    events = [("Train/Steps/loss", 1.5, 3), ("Train/Steps/lr", 0.1, 3)]
    master = Master()
    monitor.write_batch(master, events)
    assert master.wandb_monitor.got == [events] and master.comet_monitor.got == [events]
    other = Recorder()  # not a MonitorMaster: its own write_events
    monitor.write_batch(other, events)
    assert other.got == [events]


def test_sink_keeps_csv_files_open_and_a_rewind_cuts_and_reopens_them(tmp_path, monkeypatch):
    """Rank 0's sink keeps its CSV files open between batches (flushed each batch, so a
    batch is in the file before the next one); a rollback's rewind closes them, cuts the
    rows past the restored step and the next batches append after it."""
    import deepspeed.comm

    monkeypatch.setattr(deepspeed.comm, "get_rank", lambda *a, **k: 0)
    sink = monitor.MetricsSink({}, tmp_path, rank=0, flush_every=5)
    loss_csv = tmp_path / "monitor" / "csv" / "Train_Steps_loss.csv"

    def steps_in_file() -> list[int]:
        with open(loss_csv, newline="") as fh:
            body = list(csv.reader(fh))
        assert body[0] == ["step", "loss"] and ["step", "loss"] not in body[1:]
        return [int(r[0]) for r in body[1:]]

    for r in rows(10):
        sink.write(r)
    sink._queue.join()
    assert steps_in_file() == list(range(1, 11))  # two batches, in the file while open
    open_files = dict(sink._files)
    assert open_files and not any(fh.closed for fh in open_files.values())
    sink.rewind(7)
    assert all(fh.closed for fh in open_files.values()) and sink._files == {}
    assert steps_in_file() == list(range(1, 8))
    for r in rows(5, start=7):
        sink.write(r)
    sink.close()
    assert steps_in_file() == list(range(1, 13))
    assert sink.error is None and sink._files == {}


def test_sink_on_other_ranks_writes_nothing(tmp_path):
    sink = monitor.MetricsSink({}, tmp_path, rank=1)
    for r in rows(3):
        sink.write(r)
    sink.close()
    assert not (tmp_path / "monitor").exists()


# ---------------------------------------------------------------- a real 2-rank run

RANK_SCRIPT = textwrap.dedent(
    """
    import json, sys, time
    from pathlib import Path
    import deepspeed, torch
    from wonderland_ds.core import distributed as dist
    from wonderland_ds.training.metrics import MetricsSink, guard_figures
    from wonderland_ds.training.progress import ProgressDisplay
    from wonderland_ds.training.rows import StepRow

    out = Path(sys.argv[1])
    dist.init(60)
    rank, world = dist.rank(), dist.world_size()
    cfg = {
        "train_micro_batch_size_per_gpu": 4,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 2},
        "optimizer": {"type": "AdamW", "params": {"lr": 0.01, "torch_adam": True}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 10,
                      "warmup_max_lr": 0.01, "warmup_type": "linear"}},
        "steps_per_print": 10**6,
    }
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    local_sq = torch.zeros((), dtype=torch.float64)
    def hook(g):
        local_sq.add_(g.detach().double().pow(2).sum())
        return g
    for p in engine.module.parameters():
        p.register_hook(hook)
    stage_dir = out / "stage15"
    end, batch = 12, 4 * world
    progress = ProgressDisplay(15, end, 0, batch, every=5)
    sink = MetricsSink(cfg, stage_dir, engine=engine, keep_upto=0, samples_per_step=batch)
    g = torch.Generator().manual_seed(100 + rank)
    written, samples = [], 0
    while engine.global_steps < end:
        t0 = time.perf_counter()
        local_sq.zero_()
        x, y = torch.randn(4, 8, generator=g), torch.randint(0, 4, (4,), generator=g)
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        samples += batch
        vec = torch.tensor([float(loss)], dtype=torch.float64)
        dist.all_reduce_sum(vec)
        norms = dist.gather_all(float(local_sq.sqrt()))
        step = int(engine.global_steps)
        row = {
            "step": step,
            "loss": f"{float(vec[0]) / world:.8g}",
            "lr": f"{engine.get_lr()[0]:.8g}",
            "grad_norm": f"{float(engine.get_global_grad_norm()):.6g}",
            "samples": samples,
            "sample_digest": 0,
            "step_s": f"{time.perf_counter() - t0:.5f}",
            "data_wait_s": "0.000100",
            "wall": f"{time.time():.3f}",
        }
        written.append({**row, "norms": norms})
        progress.step(StepRow.parse(row))
        sink.write(StepRow.parse(row), extra=guard_figures(norms, skipped_steps=int(engine.skipped_steps)))
        if step == 6:
            t1 = time.perf_counter()
            engine.save_checkpoint(str(out / "ckpt"), tag="global_step6")
            progress.checkpoint(out / "ckpt" / "global_step6", time.perf_counter() - t1)
    progress.close()
    sink.close()
    if rank == 0:
        # A resume from the step-6 checkpoint: rows past it go, new ones follow.
        again = MetricsSink(cfg, stage_dir, keep_upto=6, samples_per_step=batch)
        for s in (7, 8, 9):
            again.write(StepRow(s, loss=10.0 + s, lr=0.001))
        again.close()
        (out / "rows.json").write_text(json.dumps(written))
    dist.teardown()  # a barrier, then the group destroyed
    dist.leave(0)  # no interpreter finalization left to meet a gloo thread
    """
)


@pytest.fixture(scope="module")
def two_rank_run(tmp_path_factory):
    from wonderland_ds.launch.command import free_port

    out = tmp_path_factory.mktemp("progress_run")
    script = out / "ranks.py"
    script.write_text(RANK_SCRIPT)
    port = str(free_port())
    procs = []
    for rank in (0, 1):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            OMP_NUM_THREADS="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(script), str(out)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
                env=env,
                cwd=REPO,
            )
        )
    results = [p.communicate(timeout=180) for p in procs]
    for p, (o, e) in zip(procs, results):
        assert p.returncode == 0, (o + e)[-4000:]
    return out, results[0][0], results[1][0]


@pytest.mark.slow
def test_two_rank_progress_output(two_rank_run):
    _, rank0, rank1 = two_rank_run
    lines = [ln for ln in rank0.splitlines() if ln.startswith("[wonderland]")]
    steps = [int(m.group(1)) for ln in lines if (m := re.search(r" step (\d+)/12 ", ln))]
    assert steps == [1, 5, 10, 12]
    for ln in (ln for ln in lines if re.search(r" step \d+/12 ", ln)):
        for field in ("stage 15", "loss ", "lr ", "samples/s", "data-stall ", "ETA ", "elapsed "):
            assert field in ln, (field, ln)
    assert any(
        ln.startswith("[wonderland] checkpoint global_step6 complete in ") for ln in lines
    ), rank0
    assert lines[-1].startswith("[wonderland] stage 15 done: steps 0->12")
    assert "[wonderland]" not in rank1  # other ranks stay quiet


@pytest.mark.slow
def test_two_rank_metrics_read_back_from_csv_and_tensorboard(two_rank_run):
    out, _, _ = two_rank_run
    written = json.loads((out / "rows.json").read_text())
    assert [r["step"] for r in written] == list(range(1, 13))
    csv_dir = out / "stage15" / "monitor" / "csv"

    def read(tag: str) -> dict[int, float]:
        with open(csv_dir / (tag.replace("/", "_") + ".csv"), newline="") as fh:
            body = list(csv.reader(fh))
        assert body[0] == ["step", tag.split("/")[-1]]
        assert all(r[0] != "step" for r in body[1:]), "header written twice"
        return {int(r[0]): float(r[1]) for r in body[1:]}

    by_step = {r["step"]: r for r in written}
    # resumed at 6: steps 1..6 from the run, 7..9 from the resume, nothing past it
    loss = read(monitor.LOSS)
    assert sorted(loss) == list(range(1, 10))
    for s in range(1, 7):
        assert loss[s] == pytest.approx(float(by_step[s]["loss"]), rel=1e-9)
    assert [loss[s] for s in (7, 8, 9)] == [17.0, 18.0, 19.0]
    lr = read(monitor.LR)
    assert lr[3] == pytest.approx(float(by_step[3]["lr"]), rel=1e-9) and lr[3] > 0
    grad = read(monitor.GRAD_NORM)
    assert grad[2] == pytest.approx(float(by_step[2]["grad_norm"]), rel=1e-5)
    gmax, gmin = read("Guards/grad_norm_max"), read("Guards/grad_norm_min")
    assert gmax[4] == pytest.approx(max(by_step[4]["norms"]), rel=1e-9)
    assert 0 < gmin[4] == pytest.approx(min(by_step[4]["norms"]), rel=1e-9)
    assert sorted(read(monitor.DATA_WAIT_S)) == list(range(1, 7))  # past 6: truncated

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(out / "stage15" / "monitor" / "tensorboard"))
    acc.Reload()
    tags = acc.Tags()["scalars"]
    for tag in (monitor.LOSS, monitor.LR, monitor.GRAD_NORM, monitor.SAMPLES_PER_S):
        assert tag in tags, tags
    tb_loss = {e.step: e.value for e in acc.Scalars(monitor.LOSS)}
    # TensorBoard drops the orphaned steps 7..12 when the resumed writer goes back to 7
    assert sorted(tb_loss) == list(range(1, 10))
    for s in range(1, 7):
        assert tb_loss[s] == pytest.approx(float(by_step[s]["loss"]), rel=1e-6)
    assert tb_loss[8] == pytest.approx(18.0)
    sps = {e.step: e.value for e in acc.Scalars(monitor.SAMPLES_PER_S)}
    assert all(v > 0 for v in sps.values())
