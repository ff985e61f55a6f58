"""Skew-aware plans: hot-expert replicas in the Plan (JSON, checks), their placement (plan/hot.py),
their price, and the planner choosing them under skew only."""

from __future__ import annotations

import doctest
import json
import os

import numpy as np
import pytest

from megatron_hybridep.cli import main
from megatron_hybridep.plan import hot
from megatron_hybridep.plan.cost import CostModel
from megatron_hybridep.plan.plan import Plan, PlanError
from megatron_hybridep.plan.planner import choose_plan, replan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPO = os.path.join(ROOT, "configs", "topologies", "2dc_x_2.yaml")
MODEL = os.path.join(ROOT, "configs", "models", "tiny-cpu.yaml")


WAN = {"levels": [{"name": "dc", "count": 2, "bandwidth_gbps": 0.05, "latency_us": 1000, "uplink_gbps": 0.05},
                  {"name": "gpu", "count": 2, "bandwidth_gbps": 10, "latency_us": 10}]}  # the testbed's 50 Mbit/s


def tiny(**kw):
    return Workload.from_yaml(MODEL).replace(**kw)


def hot_routing(tokens=2048, hot=(0,), share=0.8, G=4, E=8, top_k=2):
    """Every rank sends `share` of its token copies to the hot experts, the rest evenly."""
    counts = np.full((G, E), tokens * top_k * (1 - share) / (E - len(hot)))
    counts[:, list(hot)] = tokens * top_k * share / len(hot)
    return counts


def test_placement_example_is_right():
    assert doctest.testmod(hot, raise_on_error=False).failed == 0


def test_placement_respects_budget_holds_and_order():
    loads = np.array([[0., 100, 0, 0], [500, 0, 0, 0], [400, 50, 0, 0]])
    holds = np.zeros((3, 4), bool)
    holds[1, 0] = True  # rank 1 owns expert 0
    tok, rep = np.full((3, 4), 1e-3), np.full((3, 4), 0.06)
    assert hot.place_replicas(loads, holds, tok, rep, 1) == [(0, 2), (1, 0)]
    assert hot.place_replicas(loads, holds, tok, rep, 0) == []
    assert hot.place_replicas(loads, holds, tok, rep * 100, 4) == []  # nothing pays


def test_replicas_json_round_trip_and_old_files_unchanged():
    base = Plan.grid((2, 2), (1, 1), 8)
    assert "replicas" not in base.to_dict()  # plans without replicas serialise as before
    plan = base.with_replicas([(1, 3), (0, 2), (0, 3)], max_per_rank=2)
    assert plan.replicas.pairs == ((0, 2), (0, 3), (1, 3)) and plan.label == "ep (S=1) +3 hot"
    back = Plan.from_json(plan.to_json())
    assert back == plan and back != base and back.base == base
    assert plan.compute_rank(3, 0) == 3 and plan.compute_rank(1, 0) == 0  # rank 1 has no replica
    cr = plan.compute_ranks()
    assert cr[2, 0] == 2 and cr[3, 1] == 3 and cr[1, 0] == 0
    assert plan.held_experts(3) == (0, 1, 6, 7)


@pytest.mark.parametrize("pairs,budget,words", [
    ([(8, 2)], None, ["pair [8, 2]", "expert 8 out of range", "fix"]),
    ([(0, 4)], None, ["rank 4 out of range", "fix"]),
    ([(2, 1)], None, ["its owner", "fix"]),
    ([(0, 1), (4, 1), (6, 1)], 2, ["rank 1 holds 3 replicas", "max_per_rank=2", "fix"]),
])
def test_bad_replicas_are_explained(pairs, budget, words):
    with pytest.raises(PlanError) as err:
        Plan.grid((2, 2), (1, 1), 8).with_replicas(pairs, budget)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_replica_inside_the_domain_or_on_replicated_plans_is_rejected():
    with pytest.raises(PlanError, match="domain already holds it"):
        Plan.grid((2, 2), (2, 1), 8).with_replicas([(0, 2)])  # rank 2 gathers rank 0's experts
    with pytest.raises(PlanError, match="need a 'domains' plan"):
        Plan("replicated", ("dc", "gpu"), (2, 2), (2, 1), 8, replicas=((0, 1),))
    d = Plan.grid((2, 2), (1, 1), 8).to_dict()
    d["replicas"] = {"pairs": [[0, 2]], "budget": 1}
    with pytest.raises(PlanError, match=r"replicas.budget: unknown key"):
        Plan.from_dict(d)


def test_price_of_replicas_counts_weights_and_removes_tokens():
    t = Topology.from_yaml(TOPO)
    w = tiny(routing_counts=hot_routing())
    model = CostModel(t, w)
    base = Plan.grid((2, 2), (1, 1), 8)
    plan = base.with_replicas([(0, 1), (0, 2), (0, 3)])
    c, b = model.evaluate(plan), model.evaluate(base)  # the one costing entry prices replicas too
    assert c.phases["replica_weights"] > 0 and c.phases["replica_grad_return"] > 0
    assert c.total == pytest.approx(sum(c.phases.values()))
    assert (c.borrowed_copies, c.borrowed_reason) == (b.borrowed_copies, b.borrowed_reason)  # the mode priced
    assert c.phases["token_a2a_fwd"] < b.phases["token_a2a_fwd"] / 2
    dc_b, dc_c = (next(lv for lv in x.levels if lv.name == "dc") for x in (b, c))
    assert dc_c.uplink_bytes < dc_b.uplink_bytes
    one = w.expert_params * w.num_moe_layers * (w.weight_bytes + w.grad_bytes)
    assert c.memory.total == pytest.approx(b.memory.total + one)  # one replica per rank at most


def skewed_tiny(tokens=1024):
    """Experts of 256 KB, a slow WAN, 80% of the traffic to expert 0: the hot-replica regime."""
    return tiny(tokens_per_rank=tokens, ffn_hidden_size=512, routing_counts=hot_routing(tokens))


def test_planner_picks_hot_replicas_under_skew_only():
    t = Topology.from_dict(WAN)
    skewed = choose_plan(t, skewed_tiny())
    assert skewed.best.replicas, [c.plan.label for c in skewed.candidates]
    equal = [c for c in skewed.candidates if not c.plan.replicas and c.plan.kind == "domains"]
    assert skewed.chosen.cost.total < min(c.cost.total for c in equal)
    assert skewed.plain_ep.plan == Plan.grid((2, 2), (1, 1), 8)
    assert Plan.from_dict(json.loads(json.dumps(skewed.to_dict()))["best"]) == skewed.best
    assert all(0 in (e,) for e, _ in skewed.best.replicas.pairs)  # only the hot expert is copied
    balanced = choose_plan(t, skewed_tiny().replace(routing_counts=None))
    assert not any(c.plan.replicas for c in balanced.candidates)
    off = choose_plan(t, skewed_tiny(), replica_budget=0)
    assert not any(c.plan.replicas for c in off.candidates)


def test_replan_moves_to_hot_replicas_when_routing_skews():
    r = replan(Topology.from_dict(WAN), skewed_tiny(), Plan.grid((2, 2), (1, 1), 8), horizon_iterations=100)
    assert r.switch and r.plan.replicas and r.best_seconds < r.current_seconds


def test_explain_lists_the_replicas(tmp_path, capsys):
    import yaml

    np.save(tmp_path / "counts.npy", hot_routing(1024))
    (tmp_path / "wan.yaml").write_text(yaml.safe_dump(WAN))
    (tmp_path / "model.yaml").write_text(yaml.safe_dump({**yaml.safe_load(open(MODEL)), "ffn_hidden_size": 512}))
    rc = main(["plan", "--topology", str(tmp_path / "wan.yaml"), "--model", str(tmp_path / "model.yaml"),
               "--tokens-per-rank", "1024", "--routing-counts", str(tmp_path / "counts.npy"), "--explain",
               "--out", str(tmp_path / "plan.json")])
    out = capsys.readouterr().out
    assert rc == 0 and "hot-expert replicas (budget" in out and "expert 0 -> rank" in out
    assert "stop crossing dc" in out and "saves" in out and "pays" in out
    assert Plan.load(str(tmp_path / "plan.json")).replicas
