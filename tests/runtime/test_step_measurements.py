"""What one training step records for the scheduler (issue 18): every MoE layer under its own key
(Megatron sets layer_number only after the layer is built: both layers were keyed 0 and the
scheduler saw twice the tokens), the backward token all-to-alls timed with the bytes they send,
the routing counts kept on the routing map's device until read, and the log's collectives run
before the next iteration's first expert gather starts."""

from megatron_hybridep.plan.phases import Phase
from megatron_hybridep.testing.loop import TINY, train
from megatron_hybridep.train.launch import run_ranks


def _step_stats(ctx, argv):
    """Run 2 iterations; snapshot the runtime's statistics of each at the log's reduction (just
    before they are reset), and whether the next gather had started by then."""
    from megatron_hybridep.runtime.context import process_context
    from megatron_hybridep.train import reporting

    seen = []
    reduce = reporting.Reporter.reduce

    def snapshot(self, loss):
        rt = process_context().runtime
        seen.append({"records": {k: (r.bytes, r.seconds, r.calls) for k, r in rt.stats.records.items()},
                     "routing": {k: v.tolist() for k, v in rt.stats.tokens_per_expert.items()},
                     # counts stay tensors where the routing map lives (on a GPU: no sync per layer call)
                     "kept_as": {type(v).__name__ for v in rt.stats.routing.values()},
                     "gathering": any(getattr(g.gather, "_pending", None) is not None
                                      for layer in rt.layers for g in layer._plan_state if g.gather)})
        return reduce(self, loss)

    reporting.Reporter.reduce = snapshot
    train(ctx, argv)
    return seen


def test_each_moe_layer_keyed_apart_and_backward_all_to_alls_timed():
    argv = ["--train-iters", "2", "--hybridep-plan", "ep", "--global-batch-size", "8"]
    per_rank = run_ranks(_step_stats, 4, argv, timeout=300)
    tokens = 2 * 32 * 2  # micro-batch 2 x seq 32 x top-2, one micro-batch per iteration
    layers = int(TINY[TINY.index("--num-layers") + 1])
    kind = {Phase.TOKEN_DISPATCH: "fwd", Phase.TOKEN_COMBINE: "fwd", Phase.TOKEN_A2A_BWD: "bwd"}
    totals = {}
    for seen in per_rank:
        for i, step in enumerate(seen):
            assert sorted(step["routing"]) == list(range(1, layers + 1)), step["routing"].keys()
            assert all(sum(counts) == tokens for counts in step["routing"].values())
            assert step["kept_as"] == {"Tensor"}, step["kept_as"]
            for (layer, phase, _, level), (nbytes, secs, calls) in step["records"].items():
                if phase not in kind:
                    continue
                t = totals.setdefault((i, layer), {"fwd": 0, "bwd": 0, "bwd_calls": 0, "bwd_s": 0.0})
                if level != "all":
                    t[kind[phase]] += nbytes
                elif kind[phase] == "bwd":
                    t["bwd_calls"] += calls
                    t["bwd_s"] += secs
    assert sorted({layer for _, layer in totals}) == list(range(1, layers + 1))
    for key, t in totals.items():
        # the transposes send what the forward received: summed over the 4 ranks, the same bytes
        assert t["fwd"] > 0 and t["bwd"] == t["fwd"] and t["bwd_calls"] == 2 * 4 and t["bwd_s"] > 0, (key, t)


def test_the_logs_collectives_run_before_the_next_gather_starts():
    """On a slow WAN a blocking collective queues behind an in-flight gather's bytes (~0.1 s per call
    at 20 Mbit/s): outside the step's time and in the scheduler's measured compute."""
    argv = ["--train-iters", "2", "--global-batch-size", "8"]  # the planner's domains: borrowed experts
    for seen in run_ranks(_step_stats, 4, argv, timeout=300):
        assert [s["gathering"] for s in seen] == [False, False]
        assert any(p == Phase.EXPERT_ALLGATHER for s in seen for (_, p, _, _) in s["records"])  # it does gather
