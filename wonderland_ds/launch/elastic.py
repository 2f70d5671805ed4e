"""A node lost mid-stage: the stage goes on on the nodes left, with the same global batch, and
grows back when it is next started on more (``--min-nodes``, ``wonderland.elastic``).

The ranks find the loss (``run/liveness.PeerWatch``: a peer's heartbeat stops changing) and
leave at once; the front then asks the lost hosts whether they still answer, leaves out the
ones that do not, and relaunches from the newest complete checkpoint, resharded at load time.
Gradient accumulation is derived so that micro batch x accumulation x ranks is the
checkpoint's global batch again; a world that cannot keep it ends the stage.
"""

from __future__ import annotations

import argparse
import copy
import csv
import socket
import subprocess
import sys
import threading
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict

from wonderland_ds.checkpoint import contract as ck
from wonderland_ds.core.findings import Finding, Refused
from wonderland_ds.run import failures

#: How long a launcher may take to return after its ranks left for a lost peer before the front
#: ends it (pdsh waits for the lost host's ssh session, srun for its step daemon).
LAUNCHER_GRACE_S = 10.0
#: How long a lost host gets to answer before it is left out of the relaunch.
PROBE_TIMEOUT_S = 5


class ElasticEvent(BaseModel):
    """One change of a stage's nodes, as ``run.json``'s ``elastic`` list records it."""

    model_config = ConfigDict(extra="forbid")

    kind: str
    """``shrink`` (a node lost, the stage relaunched on the others) or ``grow`` (started again
    on more nodes than its checkpoint was saved on)."""
    at: str
    hosts: list[str]
    """The hosts the stage runs on from here."""
    lost_hosts: list[str] = []
    """Shrink: the hosts left out (they stopped beating and did not answer)."""
    last_heartbeat: str | None = None
    """Shrink: the lost ranks' last heartbeat."""
    last_heartbeat_step: int | None = None
    from_world: int
    to_world: int
    global_batch: int
    grad_acc: list[int]
    """Gradient accumulation before and after (the micro batch is kept)."""
    resumed_from_step: int | None = None
    steps_lost: int | None = None
    """Shrink: steps trained after the newest complete checkpoint, trained again."""
    detect_s: float | None = None
    """Shrink: from the last heartbeat to the first rank leaving for it."""
    relaunch_s: float | None = None
    """Shrink: from the last heartbeat to the relaunch (the ranks gone, the hosts asked)."""
    load_s: float | None = None
    """The relaunched stage's checkpoint load, resharded (the slowest rank)."""
    training_again_s: float | None = None
    """From the last heartbeat (shrink) or the launch (grow) to the first step trained."""


def min_nodes(args: Any, settings: Any) -> int | None:
    flag = getattr(args, "min_nodes", None)
    return flag if flag is not None else settings.elastic.min_nodes


def answers(host: str, slurm: bool, timeout: int = PROBE_TIMEOUT_S) -> bool:
    """Whether ``host`` still runs a command: ssh for a hostfile's host, a one-task step for a
    Slurm node (``--overlap``: it needs no free resources)."""
    if host in (socket.gethostname(), "localhost", "127.0.0.1"):
        return True
    if slurm:
        cmd = ["srun", "--overlap", "-N1", "-n1", f"--nodelist={host}", "true"]
    else:
        cmd = ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={timeout}", host, "true"]
    try:
        return subprocess.run(cmd, capture_output=True, timeout=timeout + 2).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def grad_acc_for(meta: Any, world: int, config: str) -> int:
    """The accumulation that keeps the checkpoint's global batch on ``world`` ranks (its
    micro batch kept); Refused when none does."""
    tb, micro = meta.train_batch, meta.micro_batch
    if not tb or not micro:
        raise Refused(
            Finding(
                "elastic-batch",
                "error",
                "the checkpoint does not record its global and micro batch: the world size"
                " cannot change with the same recipe",
                "resume it on its own world size",
                config,
            )
        )
    if tb % (micro * world):
        keep = [w for w in range(1, tb // micro + 1) if tb % (micro * w) == 0]
        raise Refused(
            Finding(
                "elastic-batch",
                "error",
                f"the global batch {tb} (micro batch {micro}) cannot be kept on {world} ranks:"
                f" {tb} is not a multiple of {micro} x {world}; continuing would train another"
                " recipe",
                f"run on a world size that keeps it ({', '.join(map(str, keep))} ranks), or"
                " resume by hand with the batch you mean",
                config,
                "train_batch_size",
            )
        )
    return tb // (micro * world)


def newest_meta(run_dir: Path, stage: int) -> tuple[Any, Any] | None:
    """(verdict, metadata) of the stage's newest complete checkpoint, or None."""
    newest = ck.newest_complete(run_dir / f"stage{stage}" / "checkpoints", deep=False)
    if newest is None:
        return None
    meta = ck.read_meta(newest.tag_dir)
    return (newest, meta) if meta is not None else None


def iso(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).isoformat(timespec="seconds")


def first_step_wall(stage_dir: Path, after_step: int) -> float | None:
    """The wall time of the first step after ``after_step`` in the stage's metrics.csv."""
    try:
        with (stage_dir / "metrics.csv").open() as fh:
            for row in csv.DictReader(fh):
                try:
                    if int(row["step"]) > after_step and row.get("wall"):
                        return float(row["wall"])
                except (KeyError, ValueError):
                    continue
    except OSError:
        return None
    return None


class LaunchWatch:
    """While a launcher runs: once a rank left for a lost peer, the launcher gets
    :data:`LAUNCHER_GRACE_S` to return, then the front ends it (its ranks are gone; only the
    wait for the lost host's session is left)."""

    def __init__(self, stage_dir: Path, since: float, sup: Any) -> None:
        self.stage_dir, self.since, self.sup = stage_dir, since, sup
        self.left_at: float | None = None
        self.ended = False
        self._done = threading.Event()
        self._thread = threading.Thread(
            target=self._run, name="wonderland-launch-watch", daemon=True
        )

    def __enter__(self) -> LaunchWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join(5)

    def _run(self) -> None:
        while not self._done.wait(0.5):
            if self.left_at is None:
                got = [r for r in failures.read(self.stage_dir, self.since) if r.lost]
                if got:
                    self.left_at = min(r.time for r in got)
                continue
            proc = self.sup.proc
            if proc is None or proc.poll() is not None:
                continue
            if time.time() - self.left_at > LAUNCHER_GRACE_S:
                self.ended = True
                proc.terminate()
                try:
                    proc.wait(5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                return


class Nodes:
    """The stage's nodes under ``--min-nodes``: a lost one left out of the relaunch, the
    global batch kept on the world that is left (and on a larger one when it grows back),
    each change recorded in run.json's ``elastic`` list and said on the console."""

    def __init__(self, args: argparse.Namespace, run_dir: Path, target: Any, exclude: list[str]):
        from wonderland_ds.launch.stage import load_config

        self.args, self.run_dir, self.target, self.exclude = args, run_dir, target, exclude
        self.stage_dir = run_dir / f"stage{args.stage}"
        try:
            settings = load_config(args.config, args.stage, None)[2]
            self.min_nodes = min_nodes(args, settings)
        except Refused:
            self.min_nodes = None  # the launch refuses the config itself
        self.pending: dict[str, Any] | None = None  # an event waiting for its first step
        self.launched = 0.0

    def hosts(self) -> list[str]:
        t = self.target
        names = list(t.hostfile.hosts) if t.hostfile is not None else list(t.hosts)
        return [h for h in names if h not in self.exclude]

    def before_launch(self, args: argparse.Namespace, world: int) -> argparse.Namespace:
        """The launch's flags: under --min-nodes, a resume onto another world size than its
        checkpoint's gets the accumulation that keeps the checkpoint's global batch (a
        --grad-acc-steps given is the one of the checkpoint's world)."""

        self.launched = time.time()
        if self.min_nodes is None or args.resume is None:
            return args
        got = newest_meta(self.run_dir, args.stage)
        if got is None or got[1].world_size in (None, world):
            return args
        meta = got[1]
        gas = grad_acc_for(meta, world, args.config)  # Refused: the batch cannot be kept
        out = copy.copy(args)
        out.grad_acc_steps = gas
        if self.pending is not None:  # a shrink decided after the last launch
            self.pending["relaunch_s"] = round(time.time() - self.pending["_beat"], 1)
        elif world > meta.world_size:
            self.pending = {
                "kind": "grow",
                "at": iso(self.launched),
                "_beat": self.launched,
                "hosts": self.hosts(),
                "from_world": meta.world_size,
                "to_world": world,
                "global_batch": meta.train_batch,
                "grad_acc": [meta.grad_acc, gas],
                "resumed_from_step": meta.global_step,
            }
            print(
                f"stage {args.stage}: growing back from {meta.world_size} to {world} ranks on"
                f" {len(self.hosts())} node(s); global batch {meta.train_batch} kept:"
                f" gradient accumulation {meta.grad_acc} -> {gas}",
                flush=True,
            )
        if self.pending is not None:
            self._record({k: v for k, v in self.pending.items() if not k.startswith("_")})
        return out

    def after_launch(self) -> None:
        """The first step trained after a change: how long it took from the loss (shrink) or
        the launch (grow)."""

        if self.pending is None:
            return
        wall = first_step_wall(self.stage_dir, self.pending.get("resumed_from_step") or 0)
        if wall is None:
            return  # not trained yet: the next launch measures it
        self.pending["training_again_s"] = round(wall - self.pending["_beat"], 1)
        from wonderland_ds.run import manifest

        resume = manifest.stage_record(self.run_dir, self.args.stage).resume
        if resume is not None and resume.seconds is not None:
            self.pending["load_s"] = round(resume.seconds, 1)
        self._record({k: v for k, v in self.pending.items() if not k.startswith("_")})
        self.pending = None

    def _record(self, event: dict[str, Any]) -> None:
        from wonderland_ds.run import manifest

        event = ElasticEvent(**event).model_dump()
        events = list(manifest.stage_record(self.run_dir, self.args.stage).elastic)
        if events and events[-1].get("at") == event["at"] and events[-1]["kind"] == event["kind"]:
            events[-1] = event
        else:
            events.append(event)
        manifest.update_stage(self.run_dir, self.args.stage, elastic=events)

    def lost(self, entry: Any) -> bool | None:
        """After a failed launch: None when no node was lost or --min-nodes is off (a plain
        restart); True when the lost nodes are left out; False when too few are left."""

        if self.min_nodes is None or not entry.lost:
            return None
        beats = entry.lost
        suspects = sorted({str(b["host"]) for b in beats})
        dead = [h for h in suspects if not answers(h, self.target.srun)]
        if not dead:
            print(
                f"stage {self.args.stage}: {', '.join(suspects)} stopped beating but answer"
                " (a process lost, not the host): restarting on the same nodes",
                file=sys.stderr,
                flush=True,
            )
            return None
        self.exclude[:] = sorted(set(self.exclude) | set(dead))
        if self.target.srun and self.target.alloc is not None:
            now = self.target.alloc.nodes_now()  # the job's nodes after Slurm shrank it
            if now is not None:
                self.exclude[:] = sorted(set(self.exclude) | (set(self.target.hosts) - set(now)))
        left = self.hosts()
        if len(left) < self.min_nodes:
            print(
                f"stage {self.args.stage}: lost {', '.join(dead)}; {len(left)} node(s) left"
                f" ({', '.join(left)}), fewer than --min-nodes {self.min_nodes}: not relaunched",
                file=sys.stderr,
                flush=True,
            )
            return False
        last = max(beats, key=lambda b: b["last_beat"])
        world = self.target.world(self.args.nproc, self.exclude)
        meta = newest_meta(self.run_dir, self.args.stage)
        # How far the stage got: the survivors' heartbeats have the newest step.
        from wonderland_ds.run.liveness import heartbeats

        since = self.launched
        steps = [
            b.get("step") or 0
            for b in [*beats, *heartbeats(self.stage_dir)]
            if float(b.get("time", b.get("last_beat", 0.0))) >= since
        ]
        reached = max(steps, default=0)
        saved = meta[1].global_step if meta else None
        from_world = entry.world_size or world
        event: dict[str, Any] = {
            "kind": "shrink",
            "at": iso(time.time()),
            "_beat": last["last_beat"],
            "hosts": left,
            "lost_hosts": dead,
            "last_heartbeat": iso(last["last_beat"]),
            "last_heartbeat_step": last.get("step"),
            "from_world": from_world,
            "to_world": world,
            "resumed_from_step": saved,
            "steps_lost": max(0, reached - saved) if saved is not None else reached,
            "detect_s": round(
                min(b["last_beat"] + b["silent_s"] for b in beats) - last["last_beat"], 1
            ),
        }
        if meta is not None and meta[1].train_batch:
            m = meta[1]
            gas = grad_acc_for(m, world, self.args.config)
            event |= {"global_batch": m.train_batch, "grad_acc": [m.grad_acc, gas]}
            batch = (
                f"global batch {m.train_batch} kept: {m.micro_batch} x {m.grad_acc} x {from_world}"
                f" becomes {m.micro_batch} x {gas} x {world}"
            )
        else:
            event |= {"global_batch": 0, "grad_acc": []}
            batch = "no checkpoint yet: the stage starts again from its source"
        self.pending = event
        print(
            f"stage {self.args.stage}: lost {', '.join(dead)} (last heartbeat"
            f" {event['last_heartbeat']}, step {last.get('step')}); continuing on {len(left)}"
            f" node(s) ({', '.join(left)}) from step {saved}; {batch}",
            file=sys.stderr,
            flush=True,
        )
        return True
