"""Health guards: pure detectors (tested with plain numbers) and the transfer checks.

The field notes' worst failure was a node whose network degraded so that all-reduces completed
slowly instead of failing, while stage 16 silently dropped its gradients. Nothing was logged.
Every detector here returns :class:`Event` objects; the engine applies each guard's policy
(warn / stop / rollback) to them, identically on every rank (their inputs are all-reduced).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass
from typing import Any

from wonderland_ds.config.settings import Guards
from wonderland_ds.core import distributed as dist
from wonderland_ds.training import faults


@dataclass(frozen=True)
class Event:
    guard: str
    step: int
    policy: str
    message: str
    rank: int | None = None
    host: str | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def line(self) -> str:
        who = f" rank {self.rank} ({self.host})" if self.rank is not None else ""
        return f"{self.policy.upper():8} [{self.guard}] step {self.step}{who}: {self.message}"


def _median_others(values: list[float], i: int) -> float:
    others = [v for j, v in enumerate(values) if j != i]
    return statistics.median(others) if others else values[i]


class LossWatchdog:
    """NaN/Inf, spikes above ``spike_factor`` x the rolling median, and (optionally) a plateau
    while the LR does not decrease. A small stateful detector fed one number per step."""

    def __init__(self, g: Guards) -> None:
        self.g = g
        self.losses: list[float] = []
        self.lrs: list[float] = []
        self.steps: list[int] = []  # the step of each loss (a NaN step has none)

    def update(self, step: int, loss: float, lr: float) -> list[Event]:
        g, out = self.g, []
        if loss != loss or loss in (float("inf"), float("-inf")):
            return [Event("loss-nan", step, g.nan_policy, f"loss is {loss}")]
        window = self.losses[-g.spike_window :]
        if len(window) >= g.spike_warmup:
            med = statistics.median(window)
            # Robust spread: small batches have heavy-tailed losses; a spike must stand out
            # from the window's own noise as well as exceed the multiple of its median.
            mad = 1.4826 * statistics.median(abs(x - med) for x in window)
            if (
                med > 0
                and loss > g.spike_factor * med
                and loss - med > g.spike_mad * mad
                and loss - med > g.spike_min_delta
            ):
                out.append(
                    Event(
                        "loss-spike",
                        step,
                        g.spike_policy,
                        f"loss {loss:.4g} is {loss / med:.1f}x the rolling median"
                        f" {med:.4g} (threshold {g.spike_factor:g}x)",
                    )
                )
        self.losses.append(loss)
        self.lrs.append(lr)
        self.steps.append(step)
        n = g.plateau_window
        if n and len(self.losses) >= 2 * n and self.lrs[-1] >= self.lrs[-n]:
            before = statistics.fmean(self.losses[-2 * n : -n])
            now = statistics.fmean(self.losses[-n:])
            if before > 0 and abs(before - now) / before < g.plateau_tolerance:
                out.append(
                    Event(
                        "loss-plateau",
                        step,
                        g.plateau_policy,
                        f"loss flat at {now:.4g} over {n} steps while the LR did not decrease",
                    )
                )
        return out

    def forget_after(self, step: int) -> None:
        """Drop the losses of the steps after ``step`` (a rollback to it)."""
        keep = sum(1 for s in self.steps if s <= step)
        del self.losses[keep:], self.lrs[keep:], self.steps[keep:]


def grad_drops(step: int, norms: list[float], hosts: list[str], g: Guards) -> list[Event]:
    """A rank whose local gradient (measured before the reduction) is zero, non-finite, or
    (with 3+ ranks) far below its peers contributed nothing real to the reduction."""
    out = []
    for r, norm in enumerate(norms):
        why = None
        if norm != norm or norm == float("inf"):
            why = f"local gradient norm is {norm}"
        elif norm == 0.0:
            why = "local gradient norm is 0: its gradients were dropped before the reduction"
        elif len(norms) >= 3:
            med = _median_others(norms, r)
            if med > 0 and norm < g.grad_drop_ratio * med:
                why = f"local gradient norm {norm:.3g} < {g.grad_drop_ratio:g} x peers' {med:.3g}"
        if why:
            out.append(Event("grad-drop", step, g.grad_drop_policy, why, r, hosts[r]))
    return out


def slow_ranks(
    step: int, seconds: list[float], hosts: list[str], g: Guards, guard: str = "slow-rank"
) -> list[Event]:
    out = []
    for r, t in enumerate(seconds):
        med = _median_others(seconds, r)
        if (
            len(seconds) > 1
            and med > 0
            and t > g.slow_factor * med
            and (t - med) * 1e3 > g.slow_min_ms
        ):
            out.append(
                Event(
                    guard,
                    step,
                    g.slow_policy,
                    f"transfers took {t * 1e3:.1f} ms, {t / med:.2f}x the median of the"
                    f" others ({med * 1e3:.1f} ms; threshold {g.slow_factor:g}x)",
                    r,
                    hosts[r],
                )
            )
    return out


def divergence(
    step: int, prints: list[list[float]], names: list[str], hosts: list[str], g: Guards
) -> list[Event]:
    """``prints[r][i]``: rank r's checksum of parameter i. Names the first parameter whose
    replicas differ and the ranks that disagree with the majority; every rank when no value
    is held by more than half of them (two ranks that disagree: which one is wrong is not
    known)."""
    for i, name in enumerate(names):
        values = [p[i] for p in prints]
        majority = statistics.mode(values)
        odd = [r for r, v in enumerate(values) if v != majority]
        if odd and 2 * values.count(majority) <= len(values):
            return [
                Event(
                    "replica-divergence",
                    step,
                    g.divergence_policy,
                    f"parameter {name!r} differs between replicas and no majority agrees"
                    f" (rank {r}: {v!r})",
                    r,
                    hosts[r],
                )
                for r, v in enumerate(values)
            ]
        if odd:
            return [
                Event(
                    "replica-divergence",
                    step,
                    g.divergence_policy,
                    f"parameter {name!r} differs from the other replicas"
                    f" ({values[odd[0]]!r} vs {majority!r})",
                    r,
                    hosts[r],
                )
                for r in odd
            ]
    return []


# ---------------------------------------------------------------- transfer checks (collective)


#: The transfer probe's sizes (float32 elements): 4 MB in training; 4 and 16 MB at the start.
PROBE_SIZES = (1 << 20,)
START_SIZES = (1 << 20, 1 << 22)


def send_times(plan: faults.FaultPlan, step: int, sizes: tuple[int, ...]) -> list[float]:
    """Per-rank transfer times. Each rank in turn sends to its neighbour, one pair at a time so
    that pairs do not contend; the receiver times the transfer (a send may return before the
    data has left) and the time is charged to the sender. A transfer needs both ends (the
    receiver's acknowledgements too), so one degraded host also slows the neighbour that sends
    to it: with 3 or more ranks the ring runs both ways and a rank's time is the faster of its
    two directions. Only the host that is slow both ways stands out (measured: a host whose
    packets were delayed 50 ms, tests/test_multinode.py). With 2 ranks both directions are the
    same pair of hosts and a slow network cannot be pinned to one end. Min of 3 rounds per
    size. Returns every rank's time, on every rank."""
    import torch

    world = dist.world_size()
    if world == 1:
        return [0.0]
    per_direction = []
    for step_dir in (1, -1) if world > 2 else (1,):
        mine = 0.0
        for n in sizes:
            buf = torch.ones(n, dtype=torch.float32, device=dist.device())
            mine += min(_ring_once(plan, step, buf, step_dir) for _ in range(3))
        received = dist.gather_all(mine)  # rank r measured the transfer from rank r - step_dir
        per_direction.append([float(received[(s + step_dir) % world]) for s in range(world)])
    return [min(times) for times in zip(*per_direction)]


def _ring_once(plan: faults.FaultPlan, step: int, buf: Any, direction: int = 1) -> float:
    rank, world = dist.rank(), dist.world_size()
    took = 0.0
    for sender in range(world):
        receiver = (sender + direction) % world
        dist.barrier()
        t0 = time.perf_counter()
        if rank == sender:
            factor = faults.slow_factor(plan, step, rank)
            if factor != 1.0:  # a slow link: the transfer takes factor x as long
                plan.announce(plan.at("comm", step, rank, "slow")[0], step, rank)
                time.sleep((factor - 1.0) * plan.base_transfer_s)
            dist.send(buf, receiver)
        elif rank == receiver:
            dist.recv(buf, sender)
            dist.sync(buf.device)
            took = time.perf_counter() - t0
            plan.base_transfer_s = max(took, 1e-3)  # the slow fault scales this
    return took


def verify_allreduce(
    dtype: Any,
    plan: faults.FaultPlan,
    hosts: list[str],
    g: Guards,
    sizes: tuple[int, ...] = (1024, 65536, 1 << 20),
) -> tuple[dict, list[Event]]:
    """Every rank contributes a one-hot pattern (1 at positions k % world == rank): the exact
    sum is all ones in any dtype, and a wrong slot names the rank whose contribution is wrong.
    Also gathers per-rank transfer times. Runs before the first step."""
    import torch

    rank, world = dist.rank(), dist.world_size()
    dtypes = [torch.float32] + ([dtype] if dtype != torch.float32 else [])
    wrong: set[int] = set()
    t0 = time.perf_counter()
    dev = dist.device()  # on CUDA the check runs through NCCL, as training does
    for dt in dtypes:
        for n in sizes:
            k = torch.arange(n, device=dev)
            t = (k % world == rank).to(dt)
            dist.all_reduce_sum(t)
            bad = (t.float() != 1.0).nonzero().flatten()
            wrong |= {int(b) % world for b in bad[:1000]}
    seen = dist.gather_all(sorted(wrong))
    allreduce_s = dist.gather_all(time.perf_counter() - t0)
    # Two rounds; a rank counts as slow only if both say so (a busy host makes one noisy). The
    # 16 MB size makes a slow link stand out by more than slow_min_ms on a fast one.
    first = {e.rank for e in slow_ranks(0, send_times(plan, 0, START_SIZES), hosts, g)}
    sends = send_times(plan, 0, START_SIZES)
    # What the in-training probe will cost: that probe, run once and timed (the slowest rank's
    # wall time: the same number on every rank, as probe placement needs). It places the first
    # probe in training (guards.StepGuards.probe_hint_s). Scaling the round above by its bytes
    # (4 MB of 20) missed the probe's fixed costs (barriers, the gather): 7-11 ms against the
    # 16-25 ms the probe then took in training on digits, which placed it 2x too early.
    t1 = time.perf_counter()
    send_times(plan, 0, PROBE_SIZES)
    probe_s = max(dist.gather_all(time.perf_counter() - t1))
    events = [
        Event(
            "allreduce-wrong",
            0,
            "stop",
            f"its contribution to the all-reduce arrived wrong (seen by ranks"
            f" {[s for s, w in enumerate(seen) if r in w]})",
            r,
            hosts[r],
        )
        for r in range(world)
        if any(r in w for w in seen)
    ]
    events += [e for e in slow_ranks(0, sends, hosts, g) if e.rank in first]
    report = {
        "world_size": world,
        "dtypes": [str(d).removeprefix("torch.") for d in dtypes],
        "sizes": list(sizes),
        "probe_s": round(probe_s, 6),
        "ranks": [
            {
                "rank": r,
                "host": hosts[r],
                "allreduce_ok": not any(r in w for w in seen),
                "allreduce_s": round(allreduce_s[r], 6),
                "send_s": round(sends[r], 6),
                "send_ratio": round(sends[r] / (_median_others(sends, r) or 1e-12), 3),
            }
            for r in range(world)
        ],
        "events": [e.to_dict() for e in events],
    }
    return report, events


def report_table(report: dict) -> str:
    lines = [f"{'rank':>4} {'host':<20} {'all-reduce':<10} {'send ms':>9} {'x median':>9}"]
    for row in report["ranks"]:
        lines.append(
            f"{row['rank']:>4} {row['host']:<20} "
            f"{'ok' if row['allreduce_ok'] else 'WRONG':<10} "
            f"{row['send_s'] * 1e3:9.2f} {row['send_ratio']:9.2f}"
        )
    return "\n".join(lines)
