"""Topology YAML loading, validation errors and the EP group's sub-topology."""

from __future__ import annotations

import glob
import math
import os

import pytest
import yaml
from hypothesis import given, settings

from megatron_hybridep.plan.grid import coords_of
from megatron_hybridep.plan.plan import PlanError
from megatron_hybridep.plan.topology import Topology

from .strategies import topologies

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PRESETS = sorted(glob.glob(os.path.join(ROOT, "configs", "topologies", "*.yaml")))

BASE = {
    "name": "t",
    "levels": [
        {"name": "dc", "count": 2, "bandwidth_gbps": 10, "latency_us": 100, "uplink_gbps": 10},
        {"name": "gpu", "count": 8, "bandwidth_gbps": 128, "latency_us": 5},
    ],
}


def load(d):
    return Topology.from_dict(d, source="t.yaml")


def test_presets_load_and_match_the_paper():
    names = {os.path.basename(p)[:-5]: Topology.from_yaml(p) for p in PRESETS}
    assert {"1dc_x_8", "2dc_x_8", "4dc_x_8", "1000dc_x_8", "2dc_x_2"} <= set(names)
    for dcs in (1, 2, 4):
        t = names[f"{dcs}dc_x_8"]
        assert t.level_counts == (dcs, 8) and t.world_size == 8 * dcs
        assert t.levels[1].bandwidth_gbps == 128  # PCIe 3.0 inside
        if dcs > 1:
            assert t.levels[0].bandwidth_gbps == 10  # 10 Gbit/s between DCs
    assert names["1000dc_x_8"].world_size == 8000
    assert names["2dc_x_2"].level_counts == (2, 2)


def test_round_trip_through_dict():
    t = Topology.from_yaml(os.path.join(ROOT, "configs", "topologies", "1000dc_x_8.yaml"))
    assert Topology.from_dict(yaml.safe_load(yaml.safe_dump(t.to_dict()))) == t


@pytest.mark.parametrize(
    "mutate, match",
    [
        (lambda d: d["levels"][0].update(bandwith_gbps=5),
         r"levels\[0\]\.bandwith_gbps: unknown key.*did you mean 'bandwidth_gbps'"),
        (lambda d: d["levels"][1].update(bandwidth_gbps=0),
         r"levels\[1\]\.bandwidth_gbps: must be > 0.*fix: give the link speed"),
        (lambda d: d["levels"][1].update(bandwidth_gbps=-3), r"bandwidth_gbps: must be > 0"),
        (lambda d: d["levels"][0].update(uplink_gbps=0), r"uplink_gbps: must be > 0"),
        (lambda d: d["levels"][0].update(latency_us=-1), r"latency_us: must be >= 0"),
        (lambda d: d["levels"][0].update(count=0), r"levels\[0\]\.count: must be >= 1"),
        (lambda d: d["levels"][0].update(count=2.5), r"count: expected an integer"),
        (lambda d: d.update(world_size=32), r"world_size: 32 but the level counts multiply to 16.*fix"),
        (lambda d: d.update(level=[]), r"t.yaml.level: unknown key.*did you mean 'levels'"),
        (lambda d: d.update(levels=[]), r"levels: expected a non-empty list"),
        (lambda d: d["levels"][1].update(name="dc"), r"duplicate level name"),
        (lambda d: d["levels"][1].pop("bandwidth_gbps"), r"levels\[1\]\.bandwidth_gbps: required field is missing"),
        (lambda d: d["levels"][0].update(overrides=[{"between": [0, 2], "bandwidth_gbps": 1}]),
         r"overrides\[0\]\.between: \[0, 2\] must be two different units in 0..1"),
        (lambda d: d["levels"][0].update(overrides=[{"between": [0, 1]}, {"between": [1, 0]}]), r"given twice"),
        (lambda d: d["levels"][0].update(overrides=[{"between": [0, 1], "bandwidth": 1}]),
         r"overrides\[0\]\.bandwidth: unknown key"),
    ],
)
def test_validation_errors_name_field_and_fix(mutate, match):
    d = yaml.safe_load(yaml.safe_dump(BASE))
    mutate(d)
    with pytest.raises(PlanError, match=match):
        load(d)


def test_file_errors(tmp_path):
    with pytest.raises(PlanError, match="file not found"):
        Topology.from_yaml(str(tmp_path / "nope.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("levels: [\n")
    with pytest.raises(PlanError, match="not valid YAML"):
        Topology.from_yaml(str(bad))


def test_overrides_default_to_the_level_values():
    d = yaml.safe_load(yaml.safe_dump(BASE))
    d["levels"][0]["overrides"] = [{"between": [1, 0], "bandwidth_gbps": 2.5}]
    o = load(d).levels[0].overrides[0]
    assert (o.a, o.b, o.bandwidth_gbps, o.latency_us) == (1, 0, 2.5, 100)


def test_ep_layouts():
    t = Topology.from_dict({"levels": [{"name": "dc", "count": 4, "bandwidth_gbps": 10},
                                       {"name": "gpu", "count": 8, "bandwidth_gbps": 128}]})
    lay = t.ep_layout(16)
    assert (lay.names, lay.counts, lay.extent, lay.outer, lay.num_groups) == (("dc", "gpu"), (2, 8), (2, 8), 0, 2)
    assert t.ep_layout(32).counts == (4, 8) and t.ep_layout(32).spans_dcs
    lay8 = t.ep_layout(8)
    assert (lay8.names, lay8.counts, lay8.spans_dcs, lay8.num_groups) == (("gpu",), (8,), False, 4)
    assert t.ep_layout(4).counts == (4,)
    assert t.feasible_ep_sizes() == (1, 2, 4, 8, 16, 32)
    assert t.feasible_ep_sizes(num_experts=24) == (1, 2, 4, 8)
    assert t.default_ep_size(64) == 32
    with pytest.raises(PlanError, match=r"ep_size: 3 does not divide the world size 32.*\[1, 2, 4, 8, 16, 32\]"):
        t.ep_layout(3)
    t3 = Topology.from_dict({"levels": [{"name": "dc", "count": 3, "bandwidth_gbps": 10},
                                        {"name": "gpu", "count": 8, "bandwidth_gbps": 128}]})
    with pytest.raises(PlanError, match=r"ep_size: 12 ranks do not fit the levels.*contiguous"):
        t3.ep_layout(12)
    with pytest.raises(PlanError, match=r"model.num_experts: 20 experts.*--ep-size one of \[1, 2, 4\]"):
        t.check_experts(20, 8)


@given(topologies(max_ranks=72, overrides=False))
@settings(max_examples=60, deadline=None)
def test_feasible_ep_sizes_are_exactly_the_product_blocks(topo):
    counts = topo.level_counts
    feasible = set(topo.feasible_ep_sizes())
    for s in range(1, topo.world_size + 1):
        if topo.world_size % s:
            continue
        # feasible <=> every EP group (contiguous block of s ranks) is a product of coordinate ranges
        is_product = True
        for start in range(0, topo.world_size, s):
            block = [coords_of(r, counts) for r in range(start, start + s)]
            spans = [sorted({c[lvl] for c in block}) for lvl in range(len(counts))]
            is_product &= math.prod(len(x) for x in spans) == s
        spans = [sorted({coords_of(r, counts)[lvl] for r in range(s)}) for lvl in range(len(counts))]
        assert (s in feasible) == is_product
        if is_product:
            lay = topo.ep_layout(s)
            assert lay.extent == tuple(len(x) for x in spans)
            assert math.prod(lay.counts) == s
        else:
            with pytest.raises(PlanError, match="do not fit"):
                topo.ep_layout(s)
