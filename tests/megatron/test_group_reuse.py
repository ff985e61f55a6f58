"""megatron/group_reuse.py: a process that builds Megatron's parallel state again (the bench's rank
workers, one build per system) reuses the groups of a layout it built before, and keeps them
working; another layout gets its own."""

import os

from megatron_hybridep.train.launch import run_ranks


def _rebuild(ctx):  # noqa: ANN001, ANN202
    import torch
    import torch.distributed as dist
    from megatron.core import parallel_state as ps

    from megatron_hybridep.megatron import cpu_runtime
    from megatron_hybridep.megatron.group_reuse import groups_made, reuse_megatron_groups

    cpu_runtime.enable()
    reuse_megatron_groups()
    reuse_megatron_groups()  # idempotent: not wrapped twice

    def build(ep, pp):  # noqa: ANN001, ANN202
        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
        ps.initialize_model_parallel(expert_model_parallel_size=ep, pipeline_model_parallel_size=pp)
        x = torch.ones(1)  # the groups work: an all-reduce on each of the kinds the bench uses
        for group in (ps.get_expert_model_parallel_group(), ps.get_data_parallel_group(),
                      ps.get_data_parallel_group_gloo(), ps.get_pipeline_model_parallel_group()):
            dist.all_reduce(x, group=group)
        return groups_made(), len(os.listdir("/proc/self/task")), ps.get_expert_model_parallel_group()

    ep4 = build(4, 1)
    pp2 = build(2, 2)
    again = [build(4, 1), build(2, 2), build(4, 1)]
    x = torch.ones(1)
    dist.all_reduce(x, group=ps.get_expert_model_parallel_group())
    return {"ep4": ep4[:2], "pp2": pp2[:2], "again": [a[:2] for a in again], "same_group": again[0][2] is ep4[2],
            "x": float(x)}


def test_a_layout_built_again_makes_no_group_and_no_thread():
    for out in run_ranks(_rebuild, 4, timeout=180):
        made_ep4, threads_ep4 = out["ep4"]
        made_both, threads_both = out["pp2"]
        assert made_both > made_ep4 and threads_both > threads_ep4  # another layout: its own groups
        assert all(made == made_both for made, _ in out["again"]), out
        assert all(threads == threads_both for _, threads in out["again"]), out  # gloo's threads did not grow
        assert out["same_group"] and out["x"] == 4.0  # the cached group, still working after two destroys
