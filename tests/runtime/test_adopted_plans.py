"""Hot-replica variants adopted over a long run (runtime.adopt) stay bounded: beyond MAX_ADOPTED the
oldest one not running is forgotten by the runtime and every layer, and indices stay consistent
(issue 28's soak: routing drifts, and every adopted plan keeps machinery in every layer)."""

import itertools

from megatron_hybridep.train.launch import run_ranks

PAIRS = [(0, 1), (0, 3), (1, 1), (1, 3)]  # experts of rank 0 (domain (0, 2)) on the other domain's ranks


class _Layer:
    """Records the plans a layer holds machinery for, in the runtime's order."""

    def __init__(self, plans):
        self.plans = list(plans)

    def add_plan(self, groups):
        self.plans.append(groups.plan)

    def remove_plan(self, index):
        del self.plans[index]

    def drop_gather(self):
        pass


def _adopt_all(ctx):
    import torch.distributed as dist

    from megatron_hybridep.plan.plan import Plan
    from megatron_hybridep.runtime import context

    base, other = Plan.grid((2, 2), (2, 1), 8, ("dc", "gpu")), Plan.grid((2, 2), (1, 1), 8, ("dc", "gpu"))
    runtime = context.HybridEPRuntime([base, other], dist.group.WORLD)
    layer = _Layer(runtime.plans)
    runtime.register_layer(layer)
    variants = [base.with_replicas(list(c), max_per_rank=2)
                for n in range(1, 5) for c in itertools.combinations(PAIRS, n)]
    held = []
    for plan in [*variants, variants[-1], variants[0]]:  # the running one is re-adopted, an old one again
        runtime.switch(runtime.adopt(plan))
        assert runtime.plan == plan and layer.plans == runtime.plans
        held.append(len(runtime.plans))
    return held, getattr(context, "MAX_ADOPTED", 8), runtime.plans[:2] == [base, other]


def test_adopted_variants_are_bounded_and_consistent():
    results = run_ranks(_adopt_all, 4, timeout=120)
    held, cap, prebuilt_kept = results[0]
    assert all(r == results[0] for r in results)
    assert prebuilt_kept
    assert max(held) == 2 + cap, held  # 15 variants: the cap is reached, never exceeded
