"""``doctor`` inside a Slurm allocation: its nodes, the ranks a stage would start on each,
and the time the job has left."""

from __future__ import annotations

import time
from collections.abc import Mapping

from wonderland_ds.core.findings import Finding
from wonderland_ds.core.slurm import Allocation

#: Less time left than this: a stage of the length the field notes report will not fit.
SHORT_S = 30 * 60


def check_slurm(env: Mapping[str, str]) -> list[Finding]:
    alloc = Allocation.from_env(env)
    if alloc is None:
        return []
    try:
        hosts = alloc.hosts()
    except RuntimeError as exc:
        return [Finding("doctor-slurm", "error", str(exc), "put Slurm's client tools on PATH")]
    per_node, why = alloc.ranks_per_node()
    gpus = f"{alloc.gpus_per_node} GPU(s)" if alloc.gpus_per_node else "no GPUs"
    found = [
        Finding(
            "doctor-slurm",
            "ok",
            f"Slurm job {alloc.job_id}: {len(hosts)} node(s) ({', '.join(hosts[:8])}"
            f"{', ...' if len(hosts) > 8 else ''}), {gpus} per node; a stage starts"
            f" {per_node} rank(s) per node through srun ({why})",
        )
    ]
    end = alloc.end_time()
    if end is None:
        found.append(
            Finding("doctor-slurm-time", "info", "the job has no time limit squeue reports")
        )
        return found
    left = end - time.time()
    hms = time.strftime("%H:%M:%S", time.gmtime(max(0.0, left)))
    days = f"{int(left // 86400)}d " if left >= 86400 else ""
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(end))
    if left < SHORT_S:
        found.append(
            Finding(
                "doctor-slurm-time",
                "warn",
                f"{days}{hms} left in the job (ends {when})",
                "a stage stops and saves before the end (wonderland.preemption); submit with"
                " --requeue and pass --requeue to continue in a new run of the job",
            )
        )
    else:
        found.append(
            Finding("doctor-slurm-time", "ok", f"{days}{hms} left in the job (ends {when})")
        )
    if alloc.restart_count:
        found.append(
            Finding(
                "doctor-slurm-restart",
                "info",
                f"this is run {alloc.restart_count + 1} of the job (requeued"
                f" {alloc.restart_count} time(s))",
            )
        )
    return found
