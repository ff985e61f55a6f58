"""SLURM hostlist expansion and topology-from-allocation."""

from __future__ import annotations

import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.plan import PlanError
from megatron_hybridep.plan.slurm import expand_nodelist, load_dc_map, parse_tasks_per_node, topology_from_slurm
from megatron_hybridep.plan.topology import Topology


@pytest.mark.parametrize(
    "nodelist, hosts",
    [
        ("gpu-[01-04,07],cpu5", ["gpu-01", "gpu-02", "gpu-03", "gpu-04", "gpu-07", "cpu5"]),
        ("node1", ["node1"]),
        ("n[8-10]", ["n8", "n9", "n10"]),
        ("n[08-10]", ["n08", "n09", "n10"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a[3],b,c[1,3]", ["a3", "b", "c1", "c3"]),
        ("x[009-011].d", ["x009.d", "x010.d", "x011.d"]),
    ],
)
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("bad", ["n[1-", "n1-3]", "n[3-1]", "n[a]", "", "n[1-2]]"])
def test_expand_nodelist_errors(bad):
    with pytest.raises(PlanError, match="SLURM_JOB_NODELIST"):
        expand_nodelist(bad)


@given(st.lists(st.tuples(st.from_regex(r"[a-z][a-z0-9\-]{0,5}", fullmatch=True),
                          st.lists(st.tuples(st.integers(0, 120), st.integers(0, 5), st.integers(1, 3)),
                                   min_size=1, max_size=3)), min_size=1, max_size=3))
@settings(max_examples=80, deadline=None)
def test_expand_nodelist_matches_a_direct_construction(parts):
    text, want = [], []
    for prefix, ranges in parts:
        items = []
        for lo, span, width in ranges:
            hi = lo + span
            w = max(width, len(str(hi)))
            items.append(f"{lo:0{w}d}-{hi:0{w}d}")
            want += [f"{prefix}{i:0{w}d}" for i in range(lo, hi + 1)]
        text.append(f"{prefix}[{','.join(items)}]")
    assert expand_nodelist(",".join(text)) == want


def test_tasks_per_node():
    assert parse_tasks_per_node("8(x2),4") == [8, 8, 4]
    assert parse_tasks_per_node("8") == [8]
    with pytest.raises(PlanError, match="SLURM_TASKS_PER_NODE"):
        parse_tasks_per_node("8x2")


LEVELS = {"dc": {"bandwidth_gbps": 10, "latency_us": 2000, "uplink_gbps": 10},
          "node": {"bandwidth_gbps": 100, "latency_us": 5},
          "gpu": {"bandwidth_gbps": 128, "latency_us": 2, "uplink_gbps": 128}}


def write_map(tmp_path, datacenters, levels=LEVELS):
    p = tmp_path / "dcmap.yaml"
    d = {"datacenters": datacenters}
    if levels is not None:
        d["levels"] = levels
    p.write_text(yaml.safe_dump(d))
    return str(p)


def env(nodelist, per_node="4"):
    return {"SLURM_JOB_NODELIST": nodelist, "SLURM_NTASKS_PER_NODE": per_node}


def test_yaml_map(tmp_path):
    path = write_map(tmp_path, {"east": ["gpu-0[1-2]"], "west": ["gpu-0[3-4]", "w-*"]})
    t = topology_from_slurm(path, env=env("gpu-[01-04]"))
    assert t.level_names == ("dc", "node", "gpu") and t.level_counts == (2, 2, 4)
    assert t.levels[0].bandwidth_gbps == 10 and t.levels[0].uplink_gbps == 10 and t.levels[2].latency_us == 2
    assert t.name == "slurm:east,west"


def test_text_map_with_link_topology(tmp_path):
    p = tmp_path / "dcmap.txt"
    p.write_text("# pattern dc\nnode0[1-4]  a   # first DC\nnode0[5-8] b\n")
    links = Topology.from_dict({"levels": [
        {"name": "dc", "count": 1, "bandwidth_gbps": 10}, {"name": "node", "count": 1, "bandwidth_gbps": 200},
        {"name": "gpu", "count": 1, "bandwidth_gbps": 900}]})
    t = topology_from_slurm(load_dc_map(str(p)), links, env={"SLURM_JOB_NODELIST": "node[01-08]",
                                                            "SLURM_TASKS_PER_NODE": "8(x8)"})
    assert t.level_counts == (2, 4, 8) and t.world_size == 64
    assert [lv.bandwidth_gbps for lv in t.levels] == [10, 200, 900]


def test_slurm_errors(tmp_path):
    path = write_map(tmp_path, {"east": ["e*"], "west": ["w*"]})
    with pytest.raises(PlanError, match="host 'x1' matches no pattern.*fix: add a pattern"):
        topology_from_slurm(path, env=env("e1,x1"))
    with pytest.raises(PlanError, match="not contiguous.*fix: order"):
        topology_from_slurm(path, env=env("e1,w1,e2,w2"))
    with pytest.raises(PlanError, match="different node counts.*east=2, west=1"):
        topology_from_slurm(path, env=env("e[1-2],w1"))
    with pytest.raises(PlanError, match="tasks per node differ"):
        topology_from_slurm(path, env={"SLURM_JOB_NODELIST": "e1,w1", "SLURM_TASKS_PER_NODE": "4,2"})
    with pytest.raises(PlanError, match="SLURM_JOB_NODELIST: not set.*--topology"):
        topology_from_slurm(path, env={})
    with pytest.raises(PlanError, match="SLURM_NTASKS_PER_NODE: not set"):
        topology_from_slurm(path, env={"SLURM_JOB_NODELIST": "e1"})
    nolinks = write_map(tmp_path, {"east": ["e*"]}, levels=None)
    with pytest.raises(PlanError, match="no link parameters"):
        topology_from_slurm(nolinks, env=env("e1"))
    partial = write_map(tmp_path, {"east": ["e*"]}, levels={"dc": LEVELS["dc"]})
    with pytest.raises(PlanError, match=r"levels.node: missing link parameters"):
        topology_from_slurm(partial, env=env("e1"))
    badlevel = write_map(tmp_path, {"east": ["e*"]}, levels={**LEVELS, "rack": LEVELS["dc"]})
    with pytest.raises(PlanError, match="levels.rack: unknown level"):
        topology_from_slurm(badlevel, env=env("e1"))
    badkey = write_map(tmp_path, {"east": ["e*"]}, levels={**LEVELS, "gpu": {"bandwidth_gbps": 1, "speed": 2}})
    with pytest.raises(PlanError, match=r"levels.gpu.speed: unknown key"):
        topology_from_slurm(badkey, env=env("e1"))
