"""A real Slurm cluster for tests: tests/slurm/cluster.sh driven from Python.

The cluster (Debian 12, Slurm 22.05) lives in Linux network namespaces on this one
machine: a controller namespace running slurmctld, N node namespaces with one slurmd each,
munged in the root namespace, and an address for the root namespace on the cluster's
bridge, so the client commands (sbatch, srun, squeue, scontrol, scancel) run right here.
Needs root. All nodes share this machine's filesystem and process table, so a job's
files (tmp_path) are visible to the test and every node.

Typical module fixture::

    from tests.helpers.slurm import cluster_of

    @pytest.fixture(scope="module")
    def slurm():
        yield from cluster_of(2)

    def test_x(slurm, tmp_path):
        job = slurm.sbatch("srun hostname", "--nodes=2", "--ntasks-per-node=1",
                           f"--output={tmp_path}/out")
        info = slurm.wait_state(job, "COMPLETED", timeout=60)

What a test writer must know about this setup (measured, Slurm 22.05.8):

* Time limits and ``--signal`` are checked by slurmctld every 30 s (hard-coded):
  ``--signal=B:USR1@60`` arrives 60..90 s before the end, ``--time`` kills up to 30 s late.
  SIGKILL follows SIGTERM after KillWait (30 s; ``SlurmCluster(killwait=...)``).
  A job stays COMPLETING (and keeps its nodes: new jobs pend with Reason=Resources) until
  all its processes are gone, i.e. up to KillWait after SIGTERM if they ignore it.
* Job steps do not share CPUs by default: a second ``srun`` inside a job waits ("step
  creation temporarily disabled") until the first step ends, unless it has ``--overlap``.
* ``srun`` forwards SIGUSR1/SIGUSR2 it receives to every process of the step
  (grandchildren included). SIGTERM, SIGQUIT, SIGHUP or a second SIGINT make srun SIGKILL
  the step at once (no SIGTERM reaches the tasks; srun exits 137). To SIGTERM the tasks
  use ``scancel --signal=TERM JOB`` (steps only; ``--full``: batch shell too;
  ``--batch``: batch shell only).
* ``scancel JOB``: the batch shell and every process of every step get SIGCONT+SIGTERM,
  SIGKILL after KillWait. proctrack/linuxproc tracks processes by parentage: a process
  that daemonizes (setsid -f, double fork) escapes the kill, and if it still holds the
  step's stdout/stderr the step hangs in COMPLETING until it dies.
* ``srun`` exits with the largest task exit code (a task exiting 4 -> 4; it waits for the
  other tasks unless ``--kill-on-bad-exit``); a task killed by signal N counts as 128+N.
* ``scontrol requeue``: the job is PENDING (Reason=BeginTime) ~11 s (cred_expire=10 + 1),
  then runs again with the same id, ``SLURM_RESTART_COUNT=1`` (unset on the first run),
  ``Restarts=1`` in ``scontrol show job``; ``--open-mode=append`` keeps the first run's
  output.
* A job submitted right after another one ended on the same nodes may pend ~1 s
  (Reason=Resources) while that one is COMPLETING. Job ids restart at 1 after every up().
* A finished job stays visible to scontrol for MinJobAge (60 s; ``min_job_age=``); after
  that :meth:`SlurmCluster.job_info` raises :class:`JobGone`. No accounting (no sacct).
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from .util import REPO

CLUSTER_SH = REPO / "tests" / "slurm" / "cluster.sh"

# Job states after which nothing more happens to the job (unless requeued by hand).
FINISHED_STATES = frozenset(
    {
        "BOOT_FAIL",
        "CANCELLED",
        "COMPLETED",
        "DEADLINE",
        "FAILED",
        "NODE_FAIL",
        "OUT_OF_MEMORY",
        "PREEMPTED",
        "TIMEOUT",
    }
)

_SLURM_BINARIES = ("slurmctld", "slurmd", "munged", "sbatch", "srun", "scontrol", "sinfo")
_NS_TOOLS = ("bash", "ip", "unshare", "nsenter", "flock", "mount")
# Inherited variables that would make client commands act on another allocation/cluster
# (pytest itself running inside a Slurm job, for instance).
_CLIENT_ENV_PREFIXES = ("SLURM_", "SBATCH_", "SRUN_", "SALLOC_", "SQUEUE_", "SINFO_", "SCANCEL_")


class SlurmError(RuntimeError):
    """A cluster.sh or Slurm client command failed."""


class JobGone(LookupError):
    """scontrol no longer knows the job (purged MinJobAge after it finished)."""


def _missing(names: Iterable[str]) -> list[str]:
    return [n for n in names if shutil.which(n) is None and not Path("/usr/sbin", n).exists()]


@functools.cache
def skip_reason() -> str | None:
    """Why the Slurm tests cannot run here, or None.

    Not root; no ip/unshare/nsenter; namespaces not permitted; Slurm/munge missing and
    `cluster.sh deps` (apt-get) cannot install them (set WL_SLURM_NO_INSTALL=1 to not
    try). The result is cached for the session.
    """
    if not sys.platform.startswith("linux"):
        return "the Slurm test cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the Slurm test cluster needs root (network namespaces, daemons)"
    missing = _missing(_NS_TOOLS)
    if missing:
        return f"the Slurm test cluster needs {', '.join(missing)} (iproute2/util-linux)"
    try:
        probe = subprocess.run(
            ["unshare", "--net", "--uts", "--mount", "true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        return f"cannot create namespaces: {exc}"
    if probe.returncode != 0:
        return f"cannot create namespaces: {probe.stderr.strip() or probe.returncode}"
    missing = _missing(_SLURM_BINARIES)
    if missing:
        if os.environ.get("WL_SLURM_NO_INSTALL"):
            return f"Slurm not installed ({', '.join(missing)} missing; WL_SLURM_NO_INSTALL set)"
        if shutil.which("apt-get") is None:
            return f"Slurm not installed ({', '.join(missing)} missing) and no apt-get"
        try:
            r = subprocess.run(
                ["bash", str(CLUSTER_SH), "deps"], capture_output=True, text=True, timeout=900
            )
        except subprocess.TimeoutExpired:
            return "Slurm not installed and `cluster.sh deps` timed out"
        missing = _missing(_SLURM_BINARIES)
        if r.returncode != 0 or missing:
            tail = (r.stdout + r.stderr).strip().splitlines()[-5:]
            return "Slurm packages missing and could not be installed: " + " | ".join(tail)
    return None


def parse_scontrol(line: str) -> dict[str, str]:
    """`scontrol show ... -o` key=value line -> dict. Keys may hold ':' and '/'
    ("AllocNode:Sid", "CPUs/Task"); a value may hold '=' ("TRES=cpu=2,node=2"); a word
    without '=' belongs to the previous value (a value with spaces)."""
    out: dict[str, str] = {}
    key = None
    for word in line.split():
        m = re.match(r"^([A-Za-z][A-Za-z0-9_:/.]*)=(.*)$", word)
        if m:
            key = m.group(1)
            out[key] = m.group(2)
        elif key is not None:
            out[key] += " " + word
    return out


def exit_code(info: dict[str, str]) -> tuple[int, int]:
    """scontrol's ExitCode "code:signal" -> (code, signal)."""
    code, _, sig = info.get("ExitCode", "0:0").partition(":")
    return int(code), int(sig or 0)


class SlurmCluster:
    """Drive tests/slurm/cluster.sh and the Slurm client commands.

    prefix: cluster name prefix (WL_SLURM_PREFIX, default "wls"); nodes are PREFIX-node0..
    killwait / min_job_age: seconds (slurm.conf KillWait, MinJobAge) for the next up().
    subnet: "A.B.C" (default 10.78.0) if another cluster already uses 10.78.0.0/24.
    """

    def __init__(
        self,
        prefix: str | None = None,
        *,
        killwait: int | None = None,
        min_job_age: int | None = None,
        subnet: str | None = None,
    ) -> None:
        self.prefix = prefix or os.environ.get("WL_SLURM_PREFIX", "wls")
        self.killwait = killwait
        self.min_job_age = min_job_age
        self.subnet = subnet
        self.conf = Path(f"/run/{self.prefix}-slurm/slurm.conf")
        self.state_dir = self.conf.parent
        self._tmp: Path | None = None

    # ------------------------------------------------------------------ lifecycle
    def _script_env(self) -> dict[str, str]:
        env = dict(os.environ, WL_SLURM_PREFIX=self.prefix)
        if self.killwait is not None:
            env["WL_SLURM_KILLWAIT"] = str(self.killwait)
        if self.min_job_age is not None:
            env["WL_SLURM_MINJOBAGE"] = str(self.min_job_age)
        if self.subnet is not None:
            env["WL_SLURM_SUBNET"] = self.subnet
        return env

    def cluster_sh(self, *args: str, timeout: float = 120, check: bool = True):
        """Run `bash tests/slurm/cluster.sh ARGS...` for this cluster."""
        r = subprocess.run(
            ["bash", str(CLUSTER_SH), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self._script_env(),
        )
        if check and r.returncode != 0:
            raise SlurmError(
                f"cluster.sh {' '.join(args)} failed (rc={r.returncode}):\n{r.stdout}{r.stderr}"
            )
        return r

    def up(self, nodes: int = 2) -> SlurmCluster:
        """(Re)build the cluster with `nodes` compute nodes (1..4) and wait until all are
        idle. As root this installs Slurm/munge first if they are missing. Returns self."""
        if os.geteuid() != 0:
            raise SlurmError("SlurmCluster.up needs root")
        self.cluster_sh("up", str(nodes), timeout=900)  # 900: may apt-get install first
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-jobs-"))
        return self

    def down(self) -> None:
        """Remove the cluster (idempotent): daemons, job processes, namespaces, veths, state."""
        self.cluster_sh("down", timeout=180)
        if self._tmp is not None:
            shutil.rmtree(self._tmp, ignore_errors=True)
            self._tmp = None

    def __enter__(self) -> SlurmCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    @property
    def tmp(self) -> Path:
        """Scratch directory for batch scripts (default working directory of sbatch)."""
        if self._tmp is None:
            self._tmp = Path(tempfile.mkdtemp(prefix=f"{self.prefix}-jobs-"))
        return self._tmp

    # ------------------------------------------------------------------ clients
    def env(self) -> dict[str, str]:
        """os.environ for client commands: SLURM_CONF set, and inherited SLURM_*/SBATCH_*/
        SRUN_*... dropped (they would point sbatch/srun at another allocation). Jobs
        inherit this environment (sbatch --export=ALL)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith(_CLIENT_ENV_PREFIXES)}
        env["SLURM_CONF"] = str(self.conf)
        return env

    def run(
        self,
        *cmd: str,
        check: bool = True,
        timeout: float = 60,
        cwd: str | os.PathLike | None = None,
        input: str | None = None,
    ) -> subprocess.CompletedProcess:
        """Run a client command (sinfo, squeue, srun, ...) in the root namespace."""
        if not self.conf.exists():
            # Without its slurm.conf a client command tries DNS SRV (configless) and hangs.
            raise SlurmError(f"cluster '{self.prefix}' is not up (no {self.conf})")
        r = subprocess.run(
            list(cmd),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=self.env(),
            cwd=cwd,
            input=input,
        )
        if check and r.returncode != 0:
            raise SlurmError(f"{' '.join(cmd)} failed (rc={r.returncode}):\n{r.stdout}{r.stderr}")
        return r

    def sbatch(self, script_text: str, *args: str, cwd: str | os.PathLike | None = None) -> int:
        """Submit script_text (a "#!/bin/bash" line is added if it has none) with sbatch
        ARGS; returns the job id. The working directory (where slurm-%j.out lands without
        --output) is `cwd`, default self.tmp."""
        if not script_text.startswith("#!"):
            script_text = "#!/bin/bash\n" + script_text
        fd, path = tempfile.mkstemp(prefix="job-", suffix=".sh", dir=self.tmp)
        with os.fdopen(fd, "w") as fh:
            fh.write(script_text)
        os.chmod(path, 0o755)
        r = self.run("sbatch", "--parsable", *args, path, cwd=cwd or self.tmp)
        first = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
        m = re.match(r"^(\d+)", first)
        if not m:
            raise SlurmError(f"sbatch printed no job id: {r.stdout!r} {r.stderr!r}")
        return int(m.group(1))

    def job_info(self, job_id: int) -> dict[str, str]:
        """`scontrol show job -o JOB` as a dict (JobState, Reason, Restarts, ExitCode,
        StartTime, EndTime, NodeList, BatchHost, ...). "RestartCnt" is added as an alias of
        Slurm's "Restarts". Raises JobGone once slurmctld has purged the job."""
        last = ""
        for attempt in range(5):
            r = self.run("scontrol", "show", "job", "-o", str(job_id), check=False, timeout=30)
            if r.returncode == 0:
                for line in r.stdout.splitlines():
                    info = parse_scontrol(line)
                    if info.get("JobId") == str(job_id):
                        if "Restarts" in info:
                            info.setdefault("RestartCnt", info["Restarts"])
                        return info
            last = (r.stdout + r.stderr).strip()
            if "Invalid job id" in last:
                raise JobGone(f"job {job_id}: {last}")
            time.sleep(0.5 * (attempt + 1))  # e.g. "Socket timed out" under load
        raise SlurmError(f"scontrol show job {job_id}: {last}")

    def state(self, job_id: int) -> str:
        """JobState: PENDING, RUNNING, COMPLETING, COMPLETED, CANCELLED, FAILED, TIMEOUT..."""
        return self.job_info(job_id)["JobState"]

    def wait_state(
        self,
        job_id: int,
        states: str | Iterable[str],
        timeout: float = 60,
        poll: float = 0.2,
        fail_fast: bool = True,
    ) -> dict[str, str]:
        """Poll until JobState is one of `states`; returns that job_info. Raises
        TimeoutError (with the last job info and the daemons' log tails) otherwise, and
        (fail_fast) SlurmError as soon as the job is in a finished state not wanted: it
        cannot leave it by itself. Note: after scancel/timeout/requeue the job is
        COMPLETING until all its processes are gone (up to KillWait)."""
        wanted = {states} if isinstance(states, str) else set(states)
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while True:
            info = self.job_info(job_id)
            st = info.get("JobState", "")
            if st in wanted:
                return info
            if fail_fast and st in FINISHED_STATES:
                raise SlurmError(
                    f"job {job_id} finished {st} (ExitCode={info.get('ExitCode')}, "
                    f"Reason={info.get('Reason')}) while waiting for {sorted(wanted)}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"job {job_id} not in {sorted(wanted)} after {timeout}s: "
                    f"JobState={st} Reason={info.get('Reason')}\n{self.log_tails()}"
                )
            time.sleep(poll)

    def wait_finished(self, job_id: int, timeout: float = 120) -> dict[str, str]:
        """Wait until the job reached a finished state (COMPLETED, FAILED, CANCELLED, ...)."""
        return self.wait_state(job_id, FINISHED_STATES, timeout=timeout)

    def scancel(self, job_id: int, *args: str) -> None:
        """scancel ARGS JOB (e.g. "--signal=USR1", "--full", "--batch")."""
        self.run("scancel", *args, str(job_id))

    def requeue(self, job_id: int) -> None:
        """scontrol requeue JOB (the job must have been submitted requeueable: JobRequeue=1
        makes that the default; it runs again after ~11 s with SLURM_RESTART_COUNT=1)."""
        self.run("scontrol", "requeue", str(job_id))

    def nodes(self) -> list[str]:
        """Node names, sorted (PREFIX-node0, PREFIX-node1, ...)."""
        out = self.run("sinfo", "-h", "-N", "-o", "%N").stdout.split()
        return sorted(set(out), key=lambda n: (len(n), n))

    def node_states(self) -> dict[str, str]:
        out = self.run("sinfo", "-h", "-N", "-o", "%N %T").stdout.splitlines()
        return dict(line.split(None, 1) for line in out if line.strip())

    def squeue(self) -> str:
        return self.run("squeue", check=False).stdout

    def exec(self, node: str | int, *cmd: str, timeout: float = 60, check: bool = True):
        """Run CMD inside a node's namespaces ("as the node": its network, hostname and
        hosts file); node is a name, an index, or "ctl"."""
        return self.cluster_sh("exec", str(node), *cmd, timeout=timeout, check=check)

    def log_tails(self, lines: int = 20) -> str:
        """Tails of slurmctld's and every slurmd's log, for failure messages."""
        out = []
        logs = [self.state_dir / "ctl" / "slurmctld.log"]
        logs += sorted((self.state_dir / "node").glob("*/slurmd.log"))
        for log in logs:
            try:
                text = log.read_text(errors="replace").splitlines()[-lines:]
            except OSError:
                continue
            out.append(f"---- {log}\n" + "\n".join(text))
        return "\n".join(out)


def cluster_of(nodes: int) -> Iterator[SlurmCluster]:
    """A fixture's body: a cluster of ``nodes`` up for the tests, down after them (skipped
    where one cannot be had)."""
    import pytest

    reason = skip_reason()
    if reason:
        pytest.skip(reason)
    cluster = SlurmCluster().up(nodes=nodes)
    yield cluster
    cluster.down()
