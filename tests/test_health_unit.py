"""The guards' detectors, fed plain numbers (no processes)."""

from __future__ import annotations

import math
import random

import pytest
import torch

from wonderland_ds.config.settings import Guards
from wonderland_ds.training import faults, health

G = Guards()
HOSTS = ["h0", "h1", "h2"]


def test_nan_and_inf_are_caught_at_the_step():
    w = health.LossWatchdog(G)
    assert w.update(1, 2.0, 1e-3) == []
    (e,) = w.update(2, float("nan"), 1e-3)
    assert e.guard == "loss-nan" and e.step == 2 and e.policy == "stop"
    assert w.update(3, math.inf, 1e-3)[0].guard == "loss-nan"


def test_a_4x_spike_is_caught_and_noise_is_not():
    rng = random.Random(0)
    w = health.LossWatchdog(G)
    for step in range(1, 200):
        assert w.update(step, 0.5 + rng.uniform(-0.05, 0.05), 1e-3) == [], step
    (e,) = w.update(200, 2.0, 1e-3)
    assert e.guard == "loss-spike" and "x the rolling median" in e.message


def test_spikes_need_history_and_an_absolute_jump():
    w = health.LossWatchdog(G)
    assert w.update(1, 0.1, 1e-3) == [] and w.update(2, 5.0, 1e-3) == []  # no history yet
    w = health.LossWatchdog(G)
    for step in range(1, 60):
        w.update(step, 0.0002, 1e-3)
    assert w.update(60, 0.002, 1e-3) == []  # 10x, but 0.0018 is below spike_min_delta


def test_plateau_only_when_enabled_and_lr_not_decreasing():
    losses = [1.0] * 40
    w = health.LossWatchdog(G)
    assert all(w.update(i, x, 1e-3) == [] for i, x in enumerate(losses))  # off by default
    w = health.LossWatchdog(Guards(plateau_window=10))
    events = [e for i, x in enumerate(losses) for e in w.update(i, x, 1e-3)]
    assert events and events[0].guard == "loss-plateau" and events[0].step == 19
    w = health.LossWatchdog(Guards(plateau_window=10))
    assert not [e for i, x in enumerate(losses) for e in w.update(i, x, 1e-3 / (i + 1))]


def test_gradient_drop_detection():
    (e,) = health.grad_drops(7, [1.2, 0.0], HOSTS, G)
    assert e.rank == 1 and e.host == "h1" and "dropped" in e.message
    (e,) = health.grad_drops(7, [1.2, float("nan"), 1.1], HOSTS, G)
    assert e.rank == 1
    (e,) = health.grad_drops(7, [1.2, 0.01, 1.1], HOSTS, G)
    assert e.rank == 1 and "peers" in e.message
    assert health.grad_drops(7, [1.2, 0.01], HOSTS, G) == []  # 2 ranks: no one to side with
    assert health.grad_drops(7, [1.0, 1.3, 0.9], HOSTS, G) == []


def test_slow_rank_needs_ratio_and_absolute_gap():
    (e,) = health.slow_ranks(0, [0.010, 0.021, 0.011], HOSTS, G)
    assert e.rank == 1 and "2.0" in e.message
    assert health.slow_ranks(0, [0.0003, 0.0009, 0.0003], HOSTS, G) == []  # sub-ms noise
    assert health.slow_ranks(0, [0.010, 0.012, 0.011], HOSTS, G) == []


def test_divergence_names_the_first_parameter_and_the_odd_rank():
    prints = [[1.0, 2.0, 3.0], [1.0, 2.5, 3.0], [1.0, 2.0, 3.0]]
    (e,) = health.divergence(50, prints, ["a.weight", "b.weight", "c"], HOSTS, G)
    assert e.rank == 1 and "'b.weight'" in e.message and e.guard == "replica-divergence"
    assert health.divergence(50, [[1.0], [1.0]], ["a"], HOSTS, G) == []


def test_two_disagreeing_replicas_name_both_ranks():
    """No majority: blaming rank 1 (the mode's first-value tie break) would be a guess."""
    for prints in ([[1.0, 2.0], [1.0, 2.5]], [[1.0, 2.5], [1.0, 2.0]]):
        events = health.divergence(50, prints, ["a", "b"], HOSTS, G)
        assert [e.rank for e in events] == [0, 1]
        assert all("no majority" in e.message and "'b'" in e.message for e in events)
    split = [[1.0], [2.0], [1.0], [2.0]]  # two against two: no majority either
    assert len(health.divergence(50, split, ["a"], HOSTS * 2, G)) == 4


def test_fault_grammar():
    plan = faults.parse("drop@grad:rank=1:step=10:until=12,spike@step:step=40,slow@comm:rank=2")
    drop, spike, slow = plan.faults
    assert [drop.active(s) for s in (9, 10, 12, 13)] == [False, True, True, False]
    assert spike.factor == 4.0 and spike.active(40) and not spike.active(41)
    assert slow.factor == 2.0 and slow.active(0) and slow.active(10_000)
    for bad in ("drop@step", "boom@step", "nan@step:rank=x", "kill@step:when=3"):
        with pytest.raises(ValueError):
            faults.parse(bad)


def _probe_schedule(
    g,
    step_s: float,
    probe_s: float,
    steps: int,
    world: int = 2,
    first: int = 0,
    hint: float | None = None,
) -> list[int]:
    """Drive StepGuards._probe_due as judge() does with a check every step: a probe's cost
    arrives in the next step's row. The stage starts after global step ``first``; ``hint``:
    the start check's probe time."""
    from wonderland_ds.training.guards import StepGuards
    from wonderland_ds.training.layout import VectorLayout

    sg = StepGuards.__new__(StepGuards)
    sg.g, sg.world, sg.step_ema, sg.probe_intervals = g, world, None, []
    sg.layout = VectorLayout(world)
    sg.probe_hint_s = hint
    sg.start(first)
    due: list[int] = []
    for step in range(first + 1, first + steps + 1):
        sg.step = step
        v = torch.zeros(4 + 2 * world, dtype=torch.float64)
        v[2 + 2 * world] = step_s * world  # summed over ranks
        v[3 + 2 * world] = probe_s * world if due and due[-1] == step - 1 else 0.0
        if sg._probe_due(v):
            due.append(step)
            sg.last_probe, sg.next_probe = step, step + 1000
    return due


def test_adaptive_comm_probe_stays_within_its_budget():
    from wonderland_ds.config.settings import Guards

    # Measured on this machine: a 28 ms probe, 15 ms digits steps; a 1% budget.
    due = _probe_schedule(Guards(comm_probe_budget=0.01), 0.015, 0.028, 2000)
    assert due[0] == 10
    gaps = {b - a for a, b in zip(due, due[1:])}
    assert gaps == {187}, gaps  # ceil(0.028 / (0.01 * 0.015))
    assert len(due) * 0.028 / (2000 * 0.015) <= 0.01 + 0.028 / (2000 * 0.015)
    # The default budget, 0.5%: twice the gap.
    due = _probe_schedule(Guards(), 0.015, 0.028, 2000)
    assert {b - a for a, b in zip(due, due[1:])} == {374}  # ceil(0.028 / (0.005 * 0.015))
    # A 1 s step: the floor of 10 steps; a tiny step: the ceiling of 1,000.
    slow_steps = _probe_schedule(Guards(), 1.0, 0.028, 100)
    assert slow_steps == [10, 20, 30, 40, 50, 60, 70, 80, 90, 100]
    assert _probe_schedule(Guards(), 1e-4, 0.028, 3000) == [10, 1010, 2010]
    # A fixed interval is kept as given; 0 never probes; one rank never probes.
    assert _probe_schedule(Guards(comm_probe_interval=7), 0.015, 0.028, 30) == [7, 14, 21, 28]
    assert _probe_schedule(Guards(comm_probe_interval=0), 0.015, 0.028, 30) == []
    assert _probe_schedule(Guards(), 0.015, 0.028, 30, world=1) == []
    # A resumed stage counts from its first step, not from global step 0.
    assert _probe_schedule(Guards(comm_probe_budget=0.01), 0.015, 0.028, 400, first=500)[:2] == [
        510,
        697,
    ]


def test_first_probe_is_placed_by_the_start_checks_probe_time():
    from wonderland_ds.config.settings import Guards

    # The start check (at the stage's start) timed the probe: it counts as the probe at the
    # first step, so the first in-training probe already keeps to the budget.
    due = _probe_schedule(Guards(comm_probe_budget=0.01), 0.015, 0.028, 2000, hint=0.028)
    assert due[0] == 187 and {b - a for a, b in zip(due, due[1:])} == {187}
    assert (
        _probe_schedule(Guards(comm_probe_budget=0.01), 0.015, 0.028, 400, first=500, hint=0.028)[0]
        == 687
    )
    # Slow steps: the floor, as without a hint; a fixed interval ignores the hint.
    assert _probe_schedule(Guards(), 1.0, 0.028, 30, hint=0.028) == [10, 20, 30]
    fixed = _probe_schedule(Guards(comm_probe_interval=7), 0.015, 0.028, 20, hint=0.028)
    assert fixed == [7, 14]


def test_rollback_forgets_the_losses_after_its_step_even_past_a_nan():
    """A NaN step leaves no loss in the window: forgetting by count would drop one good loss
    too many."""
    w = health.LossWatchdog(G)
    for step in range(1, 11):
        w.update(step, float(step), 1e-3)
    w.update(11, float("nan"), 1e-3)
    w.update(12, 12.0, 1e-3)
    w.forget_after(8)
    assert w.losses == [float(s) for s in range(1, 9)] and w.steps == list(range(1, 9))


def _judge_guards(stage_dir=None, world: int = 2):
    from wonderland_ds.training.guards import StepGuards
    from wonderland_ds.training.layout import VectorLayout

    sg = StepGuards.__new__(StepGuards)
    sg.g = Guards(fingerprint_interval=5, comm_probe_interval=0)
    sg.rank, sg.world, sg.hosts, sg.replicas = 0, world, ["h0", "h1"], True
    sg.fp16, sg.min_loss_scale, sg.skipped, sg.scale_at_min = False, 1.0, 0, 0
    sg.watchdog, sg.events, sg.norms, sg.param_sums = health.LossWatchdog(sg.g), [], [], {}
    sg.low_streak, sg.slow_streak, sg.probe_s, sg.t_begin = {}, {}, 0.0, 0.0
    sg.stage_dir, sg.step = stage_dir, 1
    sg.layout = VectorLayout(world)
    return sg


def test_divergence_is_judged_from_the_step_it_was_seen_at(tmp_path):
    """The check may come steps after the fingerprint step, when ZeRO-1/2 have re-gathered the
    replicas: the odd parameter is named from the sums taken at the fingerprint step."""
    sg = _judge_guards(tmp_path)
    module = torch.nn.Linear(3, 2)
    sg.step = 5
    v, sq = sg.vector(module)
    assert sq is None and 5 in sg.param_sums  # no hooks ran; the sums are kept for the judge
    names, sums = sg.param_sums[5]
    assert names == ["weight", "bias"] and v[2 + 2] == sums[0] * 1 + sums[1] * 2
    with torch.no_grad():
        module.weight.add_(1.0)  # what the module looks like by the check: irrelevant
    v[2 + 2 + 1] = v[2 + 2] + 0.5  # rank 1's fingerprint differed at step 5
    v[2], v[3] = 1.0, 1.0  # both ranks had gradients
    events = sg.judge(v, 1.0, 1e-3, module, 0, None)
    # One process: the gathered sums agree one by one, so the ranks are named by checksum;
    # two ranks that disagree are both named (neither is a majority).
    assert [e.rank for e in events] == [0, 1]
    e = events[1]
    assert e.guard == "replica-divergence" and e.step == 5 and "no majority" in e.message
    assert "checksum" in e.message and (tmp_path / "guards.jsonl").exists()
    assert sg.param_sums == {}  # judged: not kept


def test_fp16_loss_scale_is_read_from_either_optimizer_kind():
    from types import SimpleNamespace

    from wonderland_ds.training.state import loss_scale

    zero = SimpleNamespace(optimizer=SimpleNamespace(cur_scale=512.0))
    plain = SimpleNamespace(
        optimizer=SimpleNamespace(loss_scale_config=SimpleNamespace(cur_scale=64.0))
    )
    assert loss_scale(zero) == 512.0 and loss_scale(plain) == 64.0
    assert loss_scale(SimpleNamespace(optimizer=object())) is None
    sg = _judge_guards()
    sg.fp16 = True
    for _ in range(60):  # an unknown scale is not "stuck at its minimum"
        assert sg._loss_scale(0, None) == []


def test_a_resumed_or_rolled_back_skip_count_is_not_a_new_overflow():
    sg = _judge_guards()
    sg.skipped = 7  # fit() sets it from DeepSpeed's restored count
    assert sg._loss_scale(7, None) == []
    (e,) = sg._loss_scale(8, 256.0)
    assert e.guard == "skipped-step" and "8 so far" in e.message


def test_cuda_hosts_get_gloo_for_cpu_tensors_beside_nccl(monkeypatch):
    """NCCL alone rejects CPU tensors, and the guards' check runs on CPU tensors: on CUDA the
    process group must carry both backends (no GPU here: the choice is what is tested)."""
    from types import SimpleNamespace

    import deepspeed.accelerator

    from wonderland_ds.core import distributed

    for name, want in (("cuda", "cpu:gloo,cuda:nccl"), ("cpu", None)):
        fake = SimpleNamespace(device_name=lambda n=name: n)
        monkeypatch.setattr(deepspeed.accelerator, "get_accelerator", lambda f=fake: f)
        assert distributed.backend() == want


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32"])
def test_hook_norms_match_an_fp64_norm_and_fp16_does_not_overflow(dtype, tmp_path):
    """The hook's norm is taken in the gradient's dtype for bf16 (fp32 accumulation, bf16
    result: within 0.4%) and in fp32 for fp16, whose scaled gradients can pass 65504."""
    import torch

    from wonderland_ds.training import faults
    from wonderland_ds.training.guards import StepGuards

    torch.manual_seed(0)
    dt = getattr(torch, dtype)
    model = torch.nn.Linear(64, 64).to(dt)
    sg = StepGuards(Guards(), faults.FaultPlan(), tmp_path, 2, dtype == "float16", 1.0)
    sg.attach(model)
    sg.begin(0)
    scale = 2e5 if dtype == "float16" else 1.0  # a loss-scaled fp16 backward
    (model(torch.randn(8, 64).to(dt)).float().square().mean() * scale).backward()
    _, sq = sg.vector(model)
    sg.close()
    assert sq is not None and sq.dtype == torch.float64
    want = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    got = math.sqrt(float(sq))
    if dtype == "float16":
        assert want > 65504 and [n.dtype for n in sg.norms] == [torch.float32] * 2
    if dtype == "bfloat16":
        assert [n.dtype for n in sg.norms] == [torch.bfloat16] * 2
    assert math.isfinite(got) and abs(got - want) <= 4e-3 * want, (got, want)


def test_hooks_measure_the_last_micro_batch_and_a_drop_zeroes_every_one(tmp_path):
    """guards.micro: only the step's last micro-batch is measured (one norm per gradient a
    step, not one per micro-batch), while a drop fault still zeroes every micro-batch's
    gradient, so the fault really reaches the reduction."""
    import torch

    from wonderland_ds.training import faults
    from wonderland_ds.training.guards import StepGuards

    torch.manual_seed(0)
    model = torch.nn.Linear(16, 4)
    xs = [torch.randn(8, 16) * (m + 1) for m in range(3)]  # three different micro-batches
    sg = StepGuards(Guards(), faults.FaultPlan(), tmp_path, 2, False, 1.0)
    sg.attach(model)
    sg.begin(0)
    for m, x in enumerate(xs):
        sg.micro(m == len(xs) - 1)
        model(x).square().mean().backward()
    _, sq = sg.vector(model)
    assert len(sg.norms) == 2  # weight and bias, once
    last = torch.autograd.grad(model(xs[-1]).square().mean(), list(model.parameters()))
    want = math.sqrt(sum(float(g.double().square().sum()) for g in last))
    assert sq is not None and abs(math.sqrt(float(sq)) - want) <= 1e-5 * want
    total = math.sqrt(sum(float(p.grad.double().square().sum()) for p in model.parameters()))
    assert total > 1.2 * want  # the accumulated gradient is not what was measured
    model.zero_grad()
    sg.begin(1)
    sg.dropping = True
    for m, x in enumerate(xs):
        sg.micro(m == len(xs) - 1)
        model(x).square().mean().backward()
    sg.close()
    assert all(float(p.grad.abs().sum()) == 0.0 for p in model.parameters())
    assert [float(n) for n in sg.norms] == [0.0, 0.0]
