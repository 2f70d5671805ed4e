"""What `wonderland train` hands DeepSpeed's multi-node launcher: .deepspeed_env and the command."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.helpers.util import REPO
from wonderland_ds.config.hostfile import parse
from wonderland_ds.launch import command as launch


def test_env_file_carries_gloo_torch_and_wonderland_vars_and_skips_unquotable(tmp_path):
    env = {
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": "1",
        "OMP_NUM_THREADS": "4",
        "GLOO_SOCKET_IFNAME": "eth0",
        "TORCH_DISTRIBUTED_DEBUG": "DETAIL",
        "WONDERLAND_FAULT": "kill@step:step=3:rank=1",
        "TORCH_NCCL_BLOCKING_WAIT": "needs quoting; rm -rf /",
        "HOME": "/root",  # not carried: DeepSpeed's runner would export it to every node
    }
    path, notes = launch.write_env_file(tmp_path, env)
    lines = path.read_text().splitlines()
    assert lines == [
        "GLOO_SOCKET_IFNAME=eth0",
        "OMP_NUM_THREADS=4",
        "TORCH_DISTRIBUTED_DEBUG=DETAIL",
        "TORCH_NCCL_ASYNC_ERROR_HANDLING=1",
        "WONDERLAND_FAULT=kill@step:step=3:rank=1",
    ]
    assert len(notes) == 1 and "TORCH_NCCL_BLOCKING_WAIT not carried" in notes[0]
    assert not list(tmp_path.glob("*.tmp"))  # written whole, then renamed


def test_openmpi_launcher_is_passed_with_mpirun_on_path(tmp_path):
    hf, found = parse(REPO / "hostfiles" / "netns3")
    assert hf is not None, found
    cmd, env, _ = launch.build(hf, None, ["--stage", "15"], tmp_path, 29500, "openmpi")
    assert cmd[cmd.index("--launcher") + 1] == "openmpi"
    assert "--no_ssh_check" not in cmd  # other hosts: DeepSpeed checks ssh and asks hostname -I
    assert env["PATH"].split(":")[0] == str(Path(sys.executable).parent)
    local, _ = parse(REPO / "hostfiles" / "localhost")
    assert local is not None
    cmd, _, _ = launch.build(local, None, ["--stage", "15"], tmp_path, 29500)
    assert "--launcher" not in cmd and "--no_ssh_check" in cmd


def _launch_cmd(tmp_path: Path, marker: Path) -> tuple[list[str], dict[str, str]]:
    script = tmp_path / "job.py"
    script.write_text(f"open({str(marker)!r}, 'a').write('ran\\n')\n")
    cmd = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", "1", "--no_ssh_check"]
    cmd += ["--master_addr", "127.0.0.1", "--master_port", str(launch.free_port()), str(script)]
    return cmd, dict(os.environ, OMP_NUM_THREADS="1")


@pytest.mark.nightly  # the preload is opt-in (--preload-launcher)
def test_the_early_launcher_launches_nothing_until_released(tmp_path):
    """`wonderland train --preload-launcher` starts DeepSpeed's launcher while its preflight
    runs (the launcher's import overlaps the checks): refused or abandoned, it has launched
    nothing; released, it runs the command exactly as the `deepspeed` script would."""
    marker = tmp_path / "ran.txt"
    cmd, env = _launch_cmd(tmp_path, marker)
    refused = launch.Launch(cmd, env, preload=True)
    assert refused.proc is not None  # preloading DeepSpeed's runner
    time.sleep(1.0)
    refused.cancel()  # the preflight refused
    assert refused.proc.returncode is not None and not marker.exists()

    abandoned = launch.Launch(cmd, env, preload=True)
    os.close(abandoned._w)  # the front died: end of file, no "go"
    abandoned._w = None
    assert abandoned.proc.wait(timeout=60) == 0 and not marker.exists()

    released = launch.Launch(cmd, env, preload=True)
    assert released.go() == 0
    assert marker.read_text() == "ran\n"  # one rank ran the job, once


def test_the_launcher_is_not_preloaded_unless_asked(tmp_path):
    """By default nothing starts before the preflight passed; :meth:`go` runs the command."""
    marker = tmp_path / "ran.txt"
    cmd, env = _launch_cmd(tmp_path, marker)
    waiting = launch.Launch(cmd, env)
    assert waiting.proc is None
    waiting.cancel()  # a refusal: nothing to stop
    assert not marker.exists()
    assert launch.Launch(cmd, env).go() == 0
    assert marker.read_text() == "ran\n"


def test_the_ranks_run_the_entry_as_a_module(tmp_path):
    """The launch names ``wonderland_ds.train`` as a module, not a file of this checkout: it
    runs wherever the package is installed."""
    local, _ = parse(REPO / "hostfiles" / "localhost")
    assert local is not None
    cmd, _, _ = launch.build(local, None, ["--stage", "15"], tmp_path, 29500)
    at = cmd.index("--module")
    assert cmd[at + 1 : at + 4] == ["wonderland_ds.train", "--stage", "15"]
    assert not [c for c in cmd if c.endswith(".py")]
