"""Soak in miniature (issue 28, item 3; benchmarks/soak.py runs 3,000 iterations): the scheduler forced
to switch plans every 10 iterations, hot replicas on. Every rank switches at the same iterations, no
process group is created after start-up, plans with the same ranks share one group and a runtime
rebuilt in the same process (the bench builds one per system) creates none (gloo never frees a
group's threads), and threads, fds and memory stay flat once every plan has run."""

from megatron_hybridep.testing import soak
from megatron_hybridep.testing.loop import TINY
from megatron_hybridep.train.launch import run_ranks

ITERS, EVERY, SAMPLE = 150, 10, 5


def _warm(labels, prebuilt_labels):
    """The first iteration after every prebuilt plan has run once, plus one switch interval."""
    seen = set()
    for i, label in enumerate(labels, start=1):
        seen.add(label)
        if prebuilt_labels <= seen:
            return i + EVERY
    raise AssertionError(f"not every prebuilt plan ran: {sorted(prebuilt_labels - seen)}")


def test_plan_switches_reuse_groups_and_leak_nothing(tmp_path):
    from megatron_hybridep.plan.plan import Plan

    topology = soak.slow_wan_topology(str(tmp_path / "slow.yaml"))
    argv = [*TINY, "--train-iters", str(ITERS), "--hybridep-replan-interval", str(EVERY),
            "--hybridep-replan-replicas", "2", "--hybridep-topology", topology]
    per_rank = run_ranks(soak.rank, 4, argv, EVERY, SAMPLE, timeout=400)

    first = per_rank[0]
    # decisions from iteration 2 x EVERY (the statistics all-reduce overlaps one interval): each one switches
    assert [it for it, _, _ in first["switches"]] == list(range(2 * EVERY, ITERS + 1, EVERY)), first["switches"]
    assert any("hot" in label for label in first["labels"]), "premise: hot-replica variants join the cycle"
    prebuilt = {Plan.from_json(p).label for p in first["prebuilt"]}
    warm = _warm(first["labels"], prebuilt)
    for r, out in enumerate(per_rank):
        assert out["labels"] == first["labels"], f"rank {r} ran other plans than rank 0"
        assert [s[:2] for s in out["switches"]] == [s[:2] for s in first["switches"]], r
        groups = {s["groups"] for s in out["samples"]}
        assert len(groups) == 1, f"rank {r}: process groups alive over the run {sorted(groups)}"
        assert out["rebuild_groups"] == 0, f"rank {r}: a rebuilt runtime created {out['rebuild_groups']} groups"
        assert out["groups_per_ranks"] == 1, f"rank {r}: plans with the same ranks hold different groups"
        after = [s for s in out["samples"] if s["iteration"] >= warm]
        assert len(after) >= 4, (warm, out["samples"])
        for key, slack in (("threads", 2), ("fds", 2)):
            grew = max(s[key] for s in after) - after[0][key]
            assert grew <= slack, f"rank {r}: {key} grew by {grew} after iteration {warm}: {after}"
        rss = max(s["rss_kb"] for s in after) / after[0]["rss_kb"] - 1
        assert rss <= 0.10, f"rank {r}: RSS grew {rss:.1%} after iteration {warm}"
