"""--hybridep-collective-overhead-ms: a fixed cost per collective call (the testbed's gloo ranks:
GLOO_CALL_MS) reaches the planner when asked for and orders the default job's plans
(docs/cost_model.md)."""

from __future__ import annotations

from pathlib import Path

import pytest

from megatron_hybridep.megatron.arguments import parse
from megatron_hybridep.plan.workload import GLOO_CALL_MS
from megatron_hybridep.train.planning import choose, workload_for

PRESET = str(Path(__file__).resolve().parents[2] / "configs" / "presets" / "cpu_demo.yaml")


def test_the_call_cost_reaches_the_planner_and_the_full_domain_saves_the_all_to_alls():
    args = parse(["--hybridep-collective-overhead-ms", str(GLOO_CALL_MS)], default_config=PRESET)
    w = workload_for(args, 4)
    assert w.backend == "gloo" and w.call_seconds == pytest.approx(GLOO_CALL_MS * 1e-3)
    off = parse([], default_config=PRESET)  # the default: not priced
    assert workload_for(off, 4).call_seconds == 0.0
    priced = {c.plan.label: c.cost for c in choose(args, 4).result.candidates}
    free = {c.plan.label: c.cost for c in choose(off, 4).result.candidates}
    # a plan with token all-to-alls pays 4 calls per MoE layer and micro-batch (2 layers, 1 micro-batch)
    # more; the domain spanning the EP group makes none, and so leads once calls cost something
    rails = priced["domains dc2 gpu1"].phases
    assert rails["token_a2a_fwd"] + rails["token_a2a_bwd"] - (
        free["domains dc2 gpu1"].phases["token_a2a_fwd"] + free["domains dc2 gpu1"].phases["token_a2a_bwd"]
    ) == pytest.approx(4 * 2 * GLOO_CALL_MS * 1e-3, rel=1e-6)
    full = priced["domains dc2 gpu2"].phases
    assert full["token_a2a_fwd"] == full["token_a2a_bwd"] == 0.0
    assert choose(args, 4).plan.label == "domains dc2 gpu2"
    assert choose(off, 4).plan.label != "domains dc2 gpu2"


def test_a_negative_call_cost_is_refused_naming_the_field():
    from megatron_hybridep.plan.errors import PlanError

    with pytest.raises(PlanError, match="collective_overhead_ms"):
        workload_for(parse(["--hybridep-collective-overhead-ms", "-1"], default_config=PRESET), 4)
