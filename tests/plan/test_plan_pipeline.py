"""Pipeline parallelism in the cost model: sends between stages, the 1F1B and interleaved schedules,
and the data-parallel reductions overlapped or blocking. Expected values are worked out by hand."""

from __future__ import annotations

import json
import os

import pytest

from megatron_hybridep.cli import main
from megatron_hybridep.plan.cost import CostModel, data_parallel_exposed
from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.phases import PIPELINE, Phase
from megatron_hybridep.plan.pipeline import (
    boundary_sends,
    bubble_fraction,
    interleaved,
    one_f_one_b,
    one_f_one_b_shared,
    schedule_time,
)
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import choose_plan
from megatron_hybridep.plan.topology import GBPS, Level, LinkOverride, Topology
from megatron_hybridep.plan.workload import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPO = os.path.join(ROOT, "configs", "topologies", "4dc_x_8.yaml")
MODEL = os.path.join(ROOT, "configs", "models", "paper-l.yaml")
MB = 1e6


def dcs(n_dc: int, n_gpu: int, wan: float = 10.0, lan: float = 100.0) -> Topology:
    """n_dc DCs of n_gpu ranks: WAN link and DC uplink ``wan`` Gbit/s, GPU links and uplinks ``lan``;
    no latency, so times are bytes over rates."""
    return Topology((Level("dc", n_dc, wan, 0.0, wan), Level("gpu", n_gpu, lan, 0.0, lan)))


# ---- where the sends go ------------------------------------------------------------------------------
def test_stages_inside_a_dc_use_the_intra_dc_rate():
    # 1 DC x 8, PP 4: stage k = ranks 2k, 2k+1; each rank sends 10 MB through its own GPU uplink
    s = boundary_sends(dcs(1, 8), 4, 10 * MB)
    for p in s.fwd + s.bwd:
        assert p.uplink_bytes[0] == 0 and p.pair_bytes[0] == 0
        assert p.seconds == pytest.approx(10 * MB / (100 * GBPS))


def test_stages_across_dcs_share_the_dc_uplink():
    # 4 DCs x 8, PP 4: one stage per DC; 8 ranks x 10 MB leave a DC per send
    s = boundary_sends(dcs(4, 8), 4, 10 * MB)
    for p in s.fwd + s.bwd:
        assert p.uplink_bytes[0] == pytest.approx(80 * MB)
        assert p.seconds == pytest.approx(80 * MB / (10 * GBPS))
    # a middle DC sends activations forward and gradients back: 160 MB out per micro-batch
    assert s.per_micro_batch.uplink_bytes[0] == pytest.approx(160 * MB)
    assert s.per_micro_batch.seconds == pytest.approx(160 * MB / (10 * GBPS))


def test_only_the_stage_pair_that_crosses_a_dc_pays_the_wan():
    # 2 DCs x 8, PP 4: stages 0, 1 in DC 0 and 2, 3 in DC 1; boundary 1 crosses the WAN with 4 ranks
    s = boundary_sends(dcs(2, 8), 4, 10 * MB)
    inside = 10 * MB / (100 * GBPS)
    assert [p.seconds for p in s.fwd] == pytest.approx([inside, 40 * MB / (10 * GBPS), inside])
    assert [p.uplink_bytes[0] for p in s.fwd] == pytest.approx([0, 40 * MB, 0])


def test_a_stage_straddling_a_dc_boundary():
    # 3 DCs x 4, PP 2: stage 0 = ranks 0-5 (DC 0 and half of DC 1); rank r sends to r + 6:
    # 0,1 -> DC 1; 2,3 -> DC 2 (DC 0's uplink carries 4 sends); 4,5 -> DC 2 (DC 1 carries 2)
    s = boundary_sends(dcs(3, 4, wan=10.0, lan=1000.0), 2, 10 * MB)
    p = s.fwd[0]
    assert p.uplink_bytes[0] == pytest.approx(40 * MB)   # DC 0 out (and DC 2 in)
    assert p.pair_bytes[0] == pytest.approx(20 * MB)     # each DC pair link carries two ranks' sends
    assert p.seconds == pytest.approx(40 * MB / (10 * GBPS))


def test_a_slow_dc_pair_slows_only_its_boundary():
    slow_pair = (LinkOverride(1, 2, 1.0, 0.0),)
    topo = Topology((Level("dc", 4, 10.0, 0.0, 10.0, slow_pair), Level("gpu", 8, 100.0, 0.0, 100.0)))
    s = boundary_sends(topo, 4, 10 * MB)
    fast, slow = 80 * MB / (10 * GBPS), 80 * MB / (1 * GBPS)
    assert [p.seconds for p in s.fwd] == pytest.approx([fast, slow, fast])
    assert [p.seconds for p in s.bwd] == pytest.approx([fast, slow, fast])


def test_stages_spanning_several_dcs_send_dc_to_dc():
    # 4 DCs x 2, PP 2: stage 0 = DCs 0, 1; each DC's uplink carries its own 2 ranks only
    p = boundary_sends(dcs(4, 2), 2, 10 * MB).fwd[0]
    assert p.uplink_bytes[0] == pytest.approx(20 * MB)
    assert p.seconds == pytest.approx(20 * MB / (10 * GBPS))


def test_interleaving_sends_each_chunk_and_wraps_around():
    # 4 DCs x 1, PP 4, v 2: per micro-batch boundaries 0-2 carry 2 activations forward and 2 gradients
    # back, the wrap boundary 3 -> 0 one of each: a middle DC sends 2 + 2 = 4 x 10 MB, an end DC 3
    s = boundary_sends(dcs(4, 1), 4, 10 * MB, virtual=2)
    assert s.per_micro_batch.uplink_bytes[0] == pytest.approx(40 * MB)


# ---- the schedules -----------------------------------------------------------------------------------
@pytest.mark.parametrize("pp,m", [(1, 3), (2, 1), (2, 4), (3, 2), (4, 8), (8, 4)])
def test_1f1b_with_free_sends_is_m_plus_p_minus_1_slots(pp, m):
    f, b = 1.0, 2.0
    assert one_f_one_b(pp, m, f, b) == pytest.approx((m + pp - 1) * (f + b))
    t = schedule_time(pp, 1, m, f, b)
    assert t.bubble == pytest.approx((pp - 1) * (f + b))
    assert t.bubble / (m * (f + b)) == pytest.approx(bubble_fraction(pp, m))


def test_1f1b_blocking_sends_by_hand():
    f, b, c = 1.0, 2.0, 0.5
    # one micro-batch through 2 stages: F0, send, F1, B1, send back, B0
    assert one_f_one_b(2, 1, f, b, [c], [c]) == pytest.approx(2 * f + 2 * b + 2 * c)
    # 3 stages: F0 c F1 c F2 B2 c B1 c B0
    assert one_f_one_b(3, 1, f, b, [c, c], [c, c]) == pytest.approx(3 * f + 3 * b + 4 * c)
    # 2 stages, 2 micro-batches: F0(0) c F1(0) B1(0) [grad 0 / act 1 exchanged: c] F1(1) B1(1) c B0(1)
    assert one_f_one_b(2, 2, f, b, [c], [c]) == pytest.approx(3 * f + 3 * b + 3 * c)
    # one micro-batch walks every boundary once each way, whatever each one costs
    assert one_f_one_b(3, 1, f, b, [0.1, 2.0], [0.3, 4.0]) == pytest.approx(3 * f + 3 * b + 0.1 + 2.0 + 0.3 + 4.0)
    # a slow backward link alone: the gradient hops (one per boundary) are on the path
    assert one_f_one_b(2, 1, f, b, [0.0], [5.0]) == pytest.approx(2 * f + 2 * b + 5.0)


def test_1f1b_steady_state_pays_two_blocking_exchanges_per_micro_batch_in_a_middle_stage():
    f, b, c = 1.0, 2.0, 0.5
    step = one_f_one_b(4, 17, f, b, [c] * 3, [c] * 3) - one_f_one_b(4, 16, f, b, [c] * 3, [c] * 3)
    assert step == pytest.approx(f + b + 2 * c)
    # the end stages exchange with one neighbour only
    step2 = one_f_one_b(2, 17, f, b, [c], [c]) - one_f_one_b(2, 16, f, b, [c], [c])
    assert step2 == pytest.approx(f + b + c)


# ---- 1F1B on shared cores (the CPU testbed: bench/predict.py) ----------------------------------------
@pytest.mark.parametrize("pp,m,sends", [(2, 1, [0.5]), (2, 4, [0.3]), (3, 5, [0.1, 2.0]), (4, 8, [0.5, 0.2, 1.0]),
                                        (6, 3, [0.4] * 5)])
def test_shared_cores_with_a_core_per_rank_is_the_plain_replay(pp, m, sends):
    f, b = 1.0, 2.0
    back = [x * 1.5 for x in sends]
    plain = one_f_one_b(pp, m, f, b, sends, back)
    assert one_f_one_b_shared(pp, m, f, b, sends, back) == pytest.approx(plain, rel=1e-12)
    assert one_f_one_b_shared(pp, m, f, b, sends, back, ranks_per_stage=3, cores=3 * pp) == pytest.approx(plain,
                                                                                                        rel=1e-12)


@pytest.mark.parametrize("pp,m,ranks,cores", [(2, 2, 1, 1), (2, 8, 2, 2), (4, 8, 2, 2), (4, 3, 4, 2)])
def test_shared_cores_with_free_sends_are_never_idle(pp, m, ranks, cores):
    # one stage's ranks fill every core, so the cores work through all of it: the bubbles are filled
    f, b = 1.0, 2.0
    work = pp * ranks * m * (f + b)
    assert one_f_one_b_shared(pp, m, f, b, ranks_per_stage=ranks, cores=cores) == pytest.approx(work / cores)


def test_a_stage_blocked_on_a_send_frees_the_cores_for_the_others():
    f, b, c = 1.0, 2.0, 0.5

    def added(pp: int, m: int) -> tuple[float, float]:
        """What the sends add on 2 ranks per stage and 2 cores, and in the plain replay at the
        speed a rank has while every rank computes (the cores idle while a stage waits)."""
        shared = (one_f_one_b_shared(pp, m, f, b, [c] * (pp - 1), [c] * (pp - 1), 2, 2)
                  - one_f_one_b_shared(pp, m, f, b, ranks_per_stage=2, cores=2))
        slow = pp * 2 / 2  # each rank's compute slowed by the ranks per core
        plain = one_f_one_b(pp, m, f * slow, b * slow, [c] * (pp - 1), [c] * (pp - 1)) - one_f_one_b(
            pp, m, f * slow, b * slow)
        return shared, plain

    # two stages: every transfer stops both, so nothing hides it
    shared, plain = added(2, 4)
    assert shared == pytest.approx(plain) == pytest.approx(2.5)
    # four stages: while one boundary's stages wait the other two compute; only the fill and drain show,
    # and they do not grow with the micro-batches (the plain replay pays 2 c per micro-batch)
    for m in (8, 16):
        shared, plain = added(4, m)
        assert 0 < shared < 0.25 * plain, (m, shared, plain)
    assert added(4, 16)[0] == pytest.approx(added(4, 8)[0])
    with pytest.raises(ValueError, match="cores"):
        one_f_one_b_shared(2, 1, f, b, cores=0)


def test_a_waiting_rank_that_keeps_part_of_its_share_hides_less():
    """``hold``: a blocked rank keeps that share of a computing rank's claim on the cores. 0 frees it all,
    1 frees none: the plain replay at the speed a rank has while every rank computes."""
    f, b, c = 1.0, 2.0, 0.5

    def added(pp: int, hold: float) -> float:
        return (one_f_one_b_shared(pp, 8, f, b, [c] * (pp - 1), [c] * (pp - 1), 2, 2, hold=hold)
                - one_f_one_b_shared(pp, 8, f, b, ranks_per_stage=2, cores=2, hold=hold))

    slow = 4 * 2 / 2
    plain = one_f_one_b(4, 8, f * slow, b * slow, [c] * 3, [c] * 3) - one_f_one_b(4, 8, f * slow, b * slow)
    steps = [added(4, h) for h in (0.0, 0.25, 0.5, 1.0)]
    assert steps == sorted(steps) and steps[0] < steps[1] < steps[3]
    assert steps[3] == pytest.approx(plain)
    assert added(4, 0.0) == pytest.approx(one_f_one_b_shared(4, 8, f, b, [c] * 3, [c] * 3, 2, 2)
                                          - one_f_one_b_shared(4, 8, f, b, ranks_per_stage=2, cores=2))
    assert added(2, 0.5) == pytest.approx(added(2, 0.0))  # two stages: every transfer stops both anyway


def test_ranks_that_keep_a_core_busy_part_of_their_compute_contend_less():
    f, b, c = 1.0, 2.0, 0.5
    sends = [c] * 3
    # a duty of half: 4 stages x 2 ranks demand 4 cores' worth, on 8 cores nothing slows
    assert one_f_one_b_shared(4, 8, f, b, sends, sends, 2, 8, duty=0.5) == pytest.approx(
        one_f_one_b(4, 8, f, b, sends, sends), rel=1e-12)
    # on 2 cores they still contend, half as much: the steady state twice as fast as at a duty of 1 (the
    # fill and drain, fewer ranks computing, at a core each: no faster)
    full, half = (one_f_one_b_shared(4, 8, f, b, ranks_per_stage=2, cores=2, duty=d) for d in (1.0, 0.5))
    assert full / 2 < half < 0.6 * full
    # the less the ranks contend, the less of a wait the others' compute fills
    added = [one_f_one_b_shared(4, 8, f, b, sends, sends, 1, 2, duty=d) - one_f_one_b_shared(4, 8, f, b, [0] * 3,
             [0] * 3, 1, 2, duty=d) for d in (1.0, 0.6, 0.3)]
    assert added[0] < added[1] < added[2] <= one_f_one_b(4, 8, f, b, sends, sends) - one_f_one_b(4, 8, f, b) + 1e-9
    with pytest.raises(ValueError, match="duty"):
        one_f_one_b_shared(2, 1, f, b, cores=2, duty=0)


def test_interleaved_bubble_is_v_times_smaller():
    f, b, pp, m = 1.0, 2.0, 4, 8
    for v in (1, 2, 4):
        assert interleaved(pp, v, m, f, b) == pytest.approx(m * (f + b) + (pp - 1) * (f + b) / v)
    assert schedule_time(pp, 2, m, f, b).bubble == pytest.approx(schedule_time(pp, 1, m, f, b).bubble / 2)
    assert bubble_fraction(4, 8, 2) == pytest.approx(3 / 16)


def test_interleaved_sends_overlap_compute_until_the_link_is_the_bound():
    f, b, pp, m, c = 1.0, 2.0, 2, 4, 0.5
    # link per micro-batch below compute: only the fill (one hop forward) and drain (one back) show
    assert interleaved(pp, 2, m, f, b, [c], [c], link_per_micro_batch=2.0) == pytest.approx(
        m * 3.0 + 1 * 3.0 / 2 + 2 * c)
    # above it: the link paces every micro-batch
    assert interleaved(pp, 2, m, f, b, [c], [c], link_per_micro_batch=5.0) == pytest.approx(
        m * 5.0 + 1 * 3.0 / 2 + 2 * c)


# ---- the cost model ------------------------------------------------------------------------------------
def paper_l(**kw) -> Workload:
    return Workload.from_yaml(MODEL).replace(tokens_per_rank=8192, micro_batches=8, **kw)


def test_issue_25_command_prices_the_whole_pipeline():
    topo = Topology.from_yaml(TOPO)
    w = paper_l(pipeline_model_parallel_size=4)
    r = choose_plan(topo, w)
    c = r.chosen.cost
    m, stage_work = 8, sum(v for k, v in c.phases.items() if k not in PIPELINE)
    # a middle DC sends 8 ranks x 8192 tokens x 1024 x 2 B forward and as much back per micro-batch
    act = 8 * 8192 * 1024 * 2
    dc = next(lv for lv in c.levels if lv.name == "dc")
    assert dc.uplink_bytes == pytest.approx(m * 2 * act)
    assert c.total > stage_work + 1.0  # far more than the stage alone
    # each send of 8 ranks through the 10 Gbit/s uplink blocks ~107 ms; a middle stage does two per
    # micro-batch on top of its compute, and the fill and drain add more
    hop = act / (10 * GBPS)
    per_mb = (c.phases[Phase.PRE_COMPUTE] + c.phases[Phase.EXPERT_COMPUTE] + c.phases[Phase.TOKEN_A2A_FWD]
              + c.phases[Phase.TOKEN_A2A_BWD]) / m
    assert c.phases[Phase.PIPELINE_BUBBLE] == pytest.approx(3 * per_mb)
    assert c.total > m * (per_mb + 2 * hop)
    assert c.total < (m + 3) * (per_mb + 2 * hop) + stage_work
    assert 2.0 < c.total < 3.5
    # PP = 1 keeps the phases it had
    flat = CostModel(topo, paper_l()).evaluate(Plan.replicated((4, 8), 32))
    assert not set(PIPELINE) & set(flat.phases)


def test_wan_bytes_count_only_the_stage_pairs_that_cross():
    topo = dcs(2, 8)
    w = Workload(hidden_size=64, ffn_hidden_size=128, num_experts=8, top_k=2, num_moe_layers=4, seq_length=256,
                 micro_batches=4, pipeline_model_parallel_size=2)
    c = choose_plan(topo, w).chosen.cost
    dc = next(lv for lv in c.levels if lv.name == "dc")
    # PP 2 = one stage per DC: per micro-batch 8 ranks' activations leave DC 0 (and their gradients DC 1)
    assert dc.uplink_bytes == pytest.approx(4 * 8 * 256 * 64 * 2)
    w4 = w.replace(pipeline_model_parallel_size=4)
    c4 = choose_plan(topo, w4).chosen.cost
    dc4 = next(lv for lv in c4.levels if lv.name == "dc")
    assert dc4.uplink_bytes == pytest.approx(4 * 4 * 256 * 64 * 2)  # only stage 1 -> 2 crosses: 4 ranks


def test_sequence_parallel_divides_the_sends_by_tp():
    w = paper_l(pipeline_model_parallel_size=4, tensor_model_parallel_size=2)
    assert w.pipeline_send_bytes == 8192 * 1024 * 2
    assert w.replace(sequence_parallel=True).pipeline_send_bytes == 8192 * 1024 * 2 / 2


# ---- data parallelism overlapped ------------------------------------------------------------------------
def test_data_parallel_overlap_by_hand():
    w = paper_l()
    assert data_parallel_exposed(w, 3.0, 1.0, 0.5, 2.0) == (3.0, 1.0)  # blocking: as today
    over = w.replace(overlap_grad_reduce=True)
    # one bucket per buffer is reduced once all its gradients are ready, after the backward: nothing hides
    assert data_parallel_exposed(over, 3.0, 1.0, 0.5, 2.0, buckets=(1, 1)) == (3.0, 1.0)
    # 3 dense buckets, 1 expert: the last ones hold 3/3 + 1/1 = 2 of the 4 s (q = 1/2); behind a 2 s
    # backward 4 - 2 x 1/2 = 3 s are left, split 3:1
    assert data_parallel_exposed(over, 3.0, 1.0, 0.5, 2.0, buckets=(3, 1)) == pytest.approx((2.25, 0.75))
    # a long backward hides all but the last buckets: 2 s
    assert sum(data_parallel_exposed(over, 3.0, 1.0, 0.5, 9.0, buckets=(3, 1))) == pytest.approx(2.0)
    dist = w.replace(distributed_optimizer=True)
    # half is the parameter gather: 2 s, q = (3/3 + 1/1) / 4 = 1/2, behind a 0.5 s forward -> 2 - 0.25 =
    # 1.75 s; the 2 s reduce-scatter stays
    assert sum(data_parallel_exposed(dist.replace(overlap_param_gather=True), 3.0, 1.0, 0.5, 2.0,
                                     buckets=(3, 1))) == pytest.approx(3.75)
    both = dist.replace(overlap_param_gather=True, overlap_grad_reduce=True)
    assert sum(data_parallel_exposed(both, 3.0, 1.0, 0.5, 2.0, buckets=(3, 1))) == pytest.approx(1.0 + 1.75)
    with pytest.raises(PlanError, match="overlap_param_gather"):
        w.replace(overlap_param_gather=True)


def test_overlap_grad_reduce_hides_the_reduction_behind_the_last_backward():
    # replicated experts over 2 DCs at 1 Gbit/s: the expert all-reduce crosses the WAN
    topo = dcs(2, 4, wan=1.0)
    w = Workload(hidden_size=256, ffn_hidden_size=512, num_experts=8, top_k=2, num_moe_layers=2, seq_length=512,
                 micro_batches=2, throughput_tflops=0.5)
    plan = choose_plan(topo, w).candidates
    rep = next(c.plan for c in plan if c.plan.kind == "replicated")
    off = CostModel(topo, w).evaluate(rep)
    # Megatron's default bucket (40M parameters) holds this whole model: reduced after the backward
    assert CostModel(topo, w.replace(overlap_grad_reduce=True)).evaluate(rep).total == pytest.approx(off.total)
    small = w.replace(overlap_grad_reduce=True, ddp_bucket_size=50_000)
    on = CostModel(topo, small).evaluate(rep)
    comm = off.phases[Phase.DENSE_GRAD_ALLREDUCE] + off.phases[Phase.EXPERT_GRAD_ALLREDUCE]
    # the backward's token all-to-alls stay inside a DC (EP per DC): they hide the WAN reduction too
    assert on.raw["dp_shares_a2a_links"] == 0.0
    bwd = (2 / 3 * (off.phases[Phase.PRE_COMPUTE] + off.phases[Phase.EXPERT_COMPUTE])
           + off.phases[Phase.TOKEN_A2A_BWD]) / w.micro_batches
    Bd, Be = int(on.raw["dp_dense_buckets"]), int(on.raw["dp_expert_buckets"])
    assert comm > 0 and bwd > 0 and Bd + Be > 2
    q = (off.phases[Phase.DENSE_GRAD_ALLREDUCE] / Bd + off.phases[Phase.EXPERT_GRAD_ALLREDUCE] / Be) / comm
    hidden = comm - max(q * comm, comm - bwd * (1 - q))
    assert on.total == pytest.approx(off.total - hidden)
    assert on.raw[Phase.EXPERT_GRAD_ALLREDUCE] == off.raw[Phase.EXPERT_GRAD_ALLREDUCE]  # the collective is the same


def test_cli_flags(capsys):
    base = ["plan", "--topology", TOPO, "--model", MODEL, "--tokens-per-rank", "8192", "--micro-batches", "8",
            "--pipeline-model-parallel-size", "4"]
    assert main(base + ["--json"]) == 0
    blocking = json.loads(capsys.readouterr().out)["candidates"][0]["cost"]
    assert main(base + ["--json", "--overlap-grad-reduce"]) == 0
    one_bucket = json.loads(capsys.readouterr().out)["candidates"][0]["cost"]
    assert main(base + ["--json", "--overlap-grad-reduce", "--ddp-bucket-size", "1000000"]) == 0
    overlapped = json.loads(capsys.readouterr().out)["candidates"][0]["cost"]
    assert blocking["phases"]["dense_grad_allreduce"] > 0
    # a stage's dense parameters fit Megatron's default 40M bucket: reduced after the backward
    assert one_bucket["phases"]["dense_grad_allreduce"] == blocking["phases"]["dense_grad_allreduce"]
    assert overlapped["phases"]["dense_grad_allreduce"] < blocking["phases"]["dense_grad_allreduce"]
    assert main(base + ["--overlap-param-gather"]) == 2
    assert "needs distributed_optimizer" in capsys.readouterr().err
    assert main(base + ["--num-virtual-stages-per-pipeline-rank", "2"]) == 0
    out = capsys.readouterr().out
    assert "interleaved (2 chunks per rank" in out and "pp send*" in out


def test_independent_pipelines_in_a_stage_wait_together_in_step_and_hide_sends_out_of_step():
    f, b, sends = 1.0, 2.0, [0.6]
    one = one_f_one_b_shared(2, 8, f, b, sends, sends, 2, 2)
    # two groups of one rank in step: their transfers share the link (each alone takes half), the same replay
    assert one_f_one_b_shared(2, 8, f, b, sends, sends, 2, 2, groups=2) == pytest.approx(one, rel=1e-12)

    def added(stagger: float) -> float:
        return (one_f_one_b_shared(2, 8, f, b, sends, sends, 2, 2, groups=2, stagger=stagger)
                - one_f_one_b_shared(2, 8, f, b, [0.0], [0.0], 2, 2, groups=2, stagger=stagger))

    # two stages: in step every transfer stops both; out of step one group computes while the other waits
    assert added(0.0) == pytest.approx(one - one_f_one_b_shared(2, 8, f, b, ranks_per_stage=2, cores=2))
    assert 0 <= added(0.125) < 0.5 * added(0.0)
    # larger sends: still only part hidden
    big = [3.0]
    assert one_f_one_b_shared(2, 8, f, b, big, big, 2, 2, groups=2, stagger=0.125) > one_f_one_b_shared(
        2, 8, f, b, ranks_per_stage=2, cores=2, groups=2, stagger=0.125) + 8 * 3.0 / 2
    with pytest.raises(ValueError, match="groups"):
        one_f_one_b_shared(2, 1, f, b, ranks_per_stage=3, cores=2, groups=2)
