"""Plan semantics: domains, rails, compute ranks, serialisation, validation."""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.grid import coords_of, divisors, rank_of
from megatron_hybridep.plan.plan import Plan, PlanError

from .strategies import grids, plans


def test_four_dcs_of_eight_domain_is_same_gpu_index_and_tokens_stay_in_dc():
    plan = Plan.grid((4, 8), (4, 1), 32)
    assert plan.domain_of(0) == (0, 8, 16, 24)
    assert plan.domain_of(13) == (5, 13, 21, 29)
    assert plan.rail_of(0) == tuple(range(8))
    assert plan.rail_of(20) == tuple(range(16, 24))
    for src in range(32):
        for e in range(32):
            assert plan.compute_rank(src, e) // 8 == src // 8  # no token crosses a DC link


def test_one_level_plan():
    plan = Plan.grid((4,), (2,), 8)
    assert plan.domains == ((0, 1), (2, 3))
    assert plan.rails == ((0, 2), (1, 3))
    assert plan.owner_of_expert(5) == 2
    assert plan.compute_rank(1, 5) == 3  # expert 5 lives in domain (2, 3); rank 1's rail is (1, 3)
    assert plan.compute_rank(1, 2) == 1  # expert 2 is in rank 1's own domain: stays local
    assert plan.held_experts(0) == (0, 1, 2, 3)
    assert plan.owned_experts(0) == (0, 1)


def test_two_level_plan_coordinates():
    plan = Plan.grid((2, 2), (2, 1), 8)
    assert [plan.coords(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert plan.domain_of(0) == (0, 2)
    assert plan.rail_of(0) == (0, 1)
    assert plan.offset_of(2) == (1, 0)
    assert plan.level_names == ("dc", "gpu")


@given(grids())
@settings(max_examples=60, deadline=None)
def test_domains_and_rails_partition_and_meet_in_one_rank(grid):
    counts, sizes = grid
    plan = Plan.grid(counts, sizes, math.prod(counts))
    G, S = plan.ep_size, plan.domain_size
    for groups, size in ((plan.domains, S), (plan.rails, G // S)):
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(G))
        assert all(len(g) == size and list(g) == sorted(g) for g in groups)
    for d in plan.domains:
        for r in plan.rails:
            assert len(set(d) & set(r)) == 1
    for rank in range(G):
        assert rank in plan.domain_of(rank) and rank in plan.rail_of(rank)
        assert plan.domain_of(rank) == plan.domains[plan.domain_index(rank)]
        assert rank_of(plan.coords(rank), counts) == rank


@given(plans())
@settings(max_examples=60, deadline=None)
def test_every_expert_reachable_through_exactly_one_copy_per_rail(plan):
    G, E = plan.ep_size, plan.num_experts
    matrix = plan.compute_ranks()
    assert matrix.shape == (G, E)
    held = {r: set(plan.held_experts(r)) for r in range(G)}
    owned = sorted(e for r in range(G) for e in plan.owned_experts(r))
    assert owned == list(range(E))  # every expert has exactly one owner
    for src in range(G):
        rail = plan.rail_of(src)
        for e in range(E):
            c = plan.compute_rank(src, e)
            assert matrix[src, e] == c
            owner = plan.owner_of_expert(e)
            assert c in set(plan.domain_of(owner)) & set(rail)
            holders = [r for r in rail if e in held[r]]
            assert holders == [c]  # exactly one rank on the sender's rail holds e (owner or borrowed copy)


@given(grids())
@settings(max_examples=30, deadline=None)
def test_s1_is_plain_ep_and_s_equal_g_is_local(grid):
    counts, _ = grid
    G = math.prod(counts)
    ep = Plan.grid(counts, (1,) * len(counts), 2 * G)
    full = Plan.grid(counts, counts, 2 * G)
    for src in range(G):
        for e in range(2 * G):
            assert ep.compute_rank(src, e) == e // 2
            assert full.compute_rank(src, e) == src


def test_replicated_plan_is_megatron_ep_inside_each_dc():
    plan = Plan.replicated((3, 4), 8)
    assert plan.kind == "replicated" and plan.domain_sizes == (3, 1)
    assert plan.megatron_ep_size == 4 and plan.experts_per_rank == 2
    for src in range(12):
        dc = src // 4
        for e in range(8):
            c = plan.compute_rank(src, e)
            assert c // 4 == dc and c % 4 == e // 2  # Megatron's contiguous layout for EP=4
        assert plan.owned_experts(src) == plan.held_experts(src) == (2 * (src % 4), 2 * (src % 4) + 1)
    plan.validate(4, 8)
    with pytest.raises(PlanError, match="expert_model_parallel_size=12"):
        plan.validate(12, 8)


@given(plans(), st.booleans())
@settings(max_examples=40, deadline=None)
def test_json_round_trip(plan, with_predictions):
    if with_predictions:
        plan = Plan(plan.kind, plan.level_names, plan.level_counts, plan.domain_sizes, plan.num_experts,
                    {"total": 1.5, "token_a2a_fwd": 0.25}, {"dc.link": 1e9})
    back = Plan.from_json(plan.to_json())
    assert back == plan
    assert back.predicted == plan.predicted and back.link_bytes == plan.link_bytes
    d = json.loads(plan.to_json())
    assert [tuple(x) for x in d["domains"]] == list(plan.domains)
    assert [r["domain"] for r in d["ranks"]] == [plan.domain_index(r) for r in range(plan.ep_size)]


def test_save_load_and_tampering(tmp_path):
    plan = Plan.grid((2, 4), (2, 2), 16)
    path = tmp_path / "plan.json"
    plan.save(str(path))
    assert Plan.load(str(path)) == plan
    d = json.loads(path.read_text())
    d["domains"][0], d["domains"][1] = d["domains"][1], d["domains"][0]
    with pytest.raises(PlanError, match="domains.*regenerate"):
        Plan.from_json(json.dumps(d))
    d = json.loads(path.read_text())
    d["format"] = "something-else"
    with pytest.raises(PlanError, match="format"):
        Plan.from_json(json.dumps(d))
    with pytest.raises(PlanError, match="not found"):
        Plan.load(str(tmp_path / "missing.json"))
    with pytest.raises(PlanError, match="not valid JSON"):
        Plan.from_json("{")


@pytest.mark.parametrize(
    "args, match",
    [
        (("domains", ("dc", "gpu"), (2, 4), (2, 3), 8), r"domain_sizes\[1\].*divisor.*\[1, 2, 4\]"),
        (("domains", ("dc", "gpu"), (2, 4), (1, 1), 12), r"num_experts.*12 experts.*ep_size=8"),
        (("hybrid", ("gpu",), (4,), (1,), 4), r"plan.kind"),
        (("domains", ("dc",), (2, 4), (1, 1), 8), r"one entry per level"),
        (("replicated", ("dc", "gpu"), (2, 4), (1, 1), 8), r"replicated.*Plan.replicated"),
        (("domains", ("gpu", "gpu"), (2, 2), (1, 1), 4), r"duplicate"),
    ],
)
def test_invalid_plans_name_the_field_and_fix(args, match):
    with pytest.raises(PlanError, match=match):
        Plan(*args)


def test_validate_and_ranges():
    plan = Plan.grid((2, 8), (2, 1), 32)
    plan.validate(16, 32)
    with pytest.raises(PlanError, match=r"expert_model_parallel_size=8.*--ep-size 8"):
        plan.validate(8, 32)
    with pytest.raises(PlanError, match=r"num_experts.*64"):
        plan.validate(16, 64)
    with pytest.raises(PlanError, match="rank 16"):
        plan.domain_of(16)
    with pytest.raises(PlanError, match="expert 32"):
        plan.owner_of_expert(32)


def test_grid_helpers():
    assert divisors(12) == (1, 2, 3, 4, 6, 12)
    assert divisors(1) == (1,)
    for r in range(60):
        assert rank_of(coords_of(r, (3, 4, 5)), (3, 4, 5)) == r
