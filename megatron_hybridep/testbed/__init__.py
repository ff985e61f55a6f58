"""Emulated multi-DC network on one machine (network namespaces + tc) and a rank launcher.

    from megatron_hybridep.testbed import Testbed, TestbedConfig
    with Testbed(TestbedConfig(dcs=2, ranks_per_dc=2, rate_mbit=100)) as tb:
        print(tb.selfcheck().format())
        result = tb.launch([sys.executable, "train.py"], timeout_s=300).raise_for_status()

Needs root, iproute2 (ip, tc) and coreutils (timeout); netem only for delay/jitter.
Modules: sh (commands), netns (namespaces), shaping (tc), network (Testbed), launcher,
selfcheck, cli (`hybridep testbed`). Nothing here imports torch, Megatron or the rest of the
package (tests/test_layering.py); the benchmark that runs on it is bench/.
"""

from megatron_hybridep.testbed.launcher import LaunchResult, RankGroup, RankInfo, launch, start
from megatron_hybridep.testbed.network import LinkCounters, Testbed, TestbedConfig
from megatron_hybridep.testbed.selfcheck import LinkThroughput, SelfCheckReport, measure_throughput, selfcheck
from megatron_hybridep.testbed.sh import TestbedError

__all__ = [
    "LaunchResult",
    "LinkCounters",
    "LinkThroughput",
    "RankGroup",
    "RankInfo",
    "SelfCheckReport",
    "Testbed",
    "TestbedConfig",
    "TestbedError",
    "launch",
    "measure_throughput",
    "selfcheck",
    "start",
]
