"""Small builders shared by the simulator tests."""

from __future__ import annotations

from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim.engine import BLOCK, Engine, Instr
from megatron_hybridep.sim.simulate import _build, _ep_space, ep_collectives, group_classes


def one_level(G: int, gbps: float, latency_us: float = 0.0) -> Topology:
    """G ranks behind per-rank links of `gbps` (the paper's model: one bandwidth B per rank)."""
    return Topology((Level("gpu", G, gbps, latency_us, gbps),), name=f"1x{G}")


def two_level(dcs: int, per_dc: int, wan: float = 10.0, lan: float = 100.0, wan_lat: float = 0.0,
              overrides: tuple = ()) -> Topology:
    return Topology((Level("dc", dcs, wan, wan_lat, wan, overrides), Level("gpu", per_dc, lan, 0.0, lan)),
                    name=f"{dcs}x{per_dc}")


def workload(E: int, **kw) -> Workload:
    base = dict(hidden_size=256, ffn_hidden_size=512, num_experts=E, top_k=min(2, E), num_moe_layers=2,
                tokens_per_rank=1024, t_pre_ms=1.0, throughput_tflops=100.0, dense_params=0)
    base.update(kw)
    return Workload(**base)


def domains(topo: Topology, ep: int, sizes: tuple[int, ...], E: int) -> Plan:
    lay = topo.ep_layout(ep)
    return Plan("domains", lay.names, lay.counts, sizes, E)


def block_time(topo: Topology, work: Workload, plan: Plan, name: str, symmetry: bool = True) -> float:
    """Seconds of one collective of the plan's EP group (first group class), running alone."""
    lay = topo.ep_layout(plan.ep_size)
    colls = ep_collectives(topo, work, plan, lay)[0]
    colls = [c for c in colls if c.name == name and not c.empty]
    if not colls:
        return 0.0
    _, over = group_classes(topo, lay)[0]
    space = _ep_space(topo, lay, over, colls, symmetry)
    sets = _build(space, colls)
    return Engine(sets, space.link_cap).run([Instr(BLOCK, name, op=name)]).total
