"""The launcher: rank layout and environment, torch.distributed across namespaces, timeouts,
fail-fast and killing whole process trees."""

from __future__ import annotations

import ast
import io
import json
import signal
import sys
import time
from pathlib import Path

import pytest
from testbed_helpers import leftovers, pid_alive

from megatron_hybridep.testbed.network import Testbed

HERE = Path(__file__).resolve().parent


@pytest.fixture
def tb(prefix):
    with Testbed(dcs=2, ranks_per_dc=2, rate_mbit=200, prefix=prefix) as testbed:
        yield testbed
    assert leftovers(prefix) == []


# cold: `ip netns exec ... timeout ... python`; warm: forked from the warm host (testbed/warm_host.py)
@pytest.fixture(params=["cold", "warm"])
def preload(request):
    return [] if request.param == "cold" else ["torch", "torch.distributed"]


def test_gloo_all_reduce_across_dc_namespaces(tb, tmp_path, preload):
    stream = io.StringIO()
    result = tb.launch([sys.executable, HERE / "gloo_allreduce.py"], timeout_s=90, stream=stream,
                       log_dir=tmp_path, preload=preload)
    assert result.ok, result.outputs
    assert result.returncodes == [0, 0, 0, 0]
    for r in range(4):
        assert f"rank={r} world=4 sum=10" in result.outputs[r]
        assert (tmp_path / f"rank{r}.log").read_text() == result.outputs[r]
    gathered = ast.literal_eval(result.outputs[0].split("gathered=", 1)[1].strip())
    # rank = dc * K + local; each rank routes from its own DC's address; it sees only lo + wan0
    assert gathered == [
        (0, 0, 0, "10.77.0.1", ["lo", "wan0"]),
        (1, 0, 1, "10.77.0.1", ["lo", "wan0"]),
        (2, 1, 0, "10.77.0.2", ["lo", "wan0"]),
        (3, 1, 1, "10.77.0.2", ["lo", "wan0"]),
    ]
    assert "[r2 dc1] rank=2 world=4 sum=10" in stream.getvalue().splitlines()


ENV_DUMP = (
    "import json, os; keys = ['MASTER_ADDR', 'MASTER_PORT', 'RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
    "'LOCAL_WORLD_SIZE', 'GLOO_SOCKET_IFNAME', 'HYBRIDEP_DC', 'HYBRIDEP_NUM_DCS', 'USER_VAR', 'HYBRIDEP_PER_RANK']; "
    "print(json.dumps({k: os.environ.get(k) for k in keys}))"
)


def test_rank_environment_and_user_env(tb, preload):
    result = tb.launch(
        lambda info: [sys.executable, "-c", ENV_DUMP],
        env=lambda info: {"USER_VAR": "x", "HYBRIDEP_PER_RANK": f"p{info.rank}"},
        timeout_s=30, preload=preload,
    ).raise_for_status()
    envs = [json.loads(out) for out in result.outputs]
    ports = {e["MASTER_PORT"] for e in envs}
    assert len(ports) == 1 and int(ports.pop()) > 0
    for r, e in enumerate(envs):
        assert e == {
            "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": e["MASTER_PORT"], "RANK": str(r), "WORLD_SIZE": "4",
            "LOCAL_RANK": str(r % 2), "LOCAL_WORLD_SIZE": "2", "GLOO_SOCKET_IFNAME": "wan0",
            "HYBRIDEP_DC": str(r // 2), "HYBRIDEP_NUM_DCS": "2", "USER_VAR": "x", "HYBRIDEP_PER_RANK": f"p{r}",
        }


# each rank starts a grandchild in the same process group and reports both pids, then hangs
TREE = (
    "import os, subprocess, sys, signal\n"
    "child = subprocess.Popen([sys.executable, '-c', 'import signal; signal.pause()'])\n"
    "print('tree', os.getpid(), child.pid, flush=True)\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)  # stubborn: needs SIGKILL\n"
    "signal.pause()\n"
)


def test_timeout_kills_the_whole_process_tree(tb, preload):
    tb.launch([sys.executable, "-c", "pass"], preload=preload, timeout_s=60)  # the warm host's imports: not timed
    group = tb.start([sys.executable, "-c", TREE], timeout_s=2, preload=preload)
    assert group.wait_output("^tree ", timeout_s=30)
    pids = [int(p) for r in range(4) for p in group.output(r).split()[1:3]]
    assert all(pid_alive(p) for p in pids)
    result = group.wait()
    assert result.timed_out and not result.ok
    assert all(rc < 0 for rc in result.returncodes), result.returncodes
    assert result.elapsed_s < 2 + 10
    # SIGKILL is delivered asynchronously: on a loaded machine a killed process can take a moment
    # to leave the run queue. Poll for the condition (bounded), do not sleep a fixed time.
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not any(pid_alive(p) for p in pids)


def test_fail_fast_ends_the_other_ranks(tb, preload):
    code = "import os, signal, sys\nif os.environ['RANK'] == '1': sys.exit(3)\nsignal.pause()\n"
    result = tb.launch([sys.executable, "-c", code], timeout_s=60, preload=preload)
    assert not result.timed_out
    assert result.returncodes[1] == 3
    assert all(result.returncodes[r] == -signal.SIGTERM for r in (0, 2, 3)), result.returncodes
    assert result.failed_ranks == [0, 1, 2, 3]
    assert result.elapsed_s < 30
    with pytest.raises(Exception, match="failed ranks"):
        result.raise_for_status()


def test_ranks_per_dc_override_and_output_capture(tb):
    result = tb.launch([sys.executable, "-c", "import os; print('hi', os.environ['RANK'])"],
                       ranks_per_dc=1, timeout_s=30)
    assert result.ok
    assert [o.strip() for o in result.outputs] == ["hi 0", "hi 1"]
    assert [(i.rank, i.dc, i.local_rank) for i in result.ranks] == [(0, 0, 0), (1, 1, 0)]
