"""Sweeps: DC count x WAN bandwidth x domain policy, each point simulated against plain EP.

    rows = run_sweep(SweepSpec(base=topo, workload=work, dcs=(2, 10, 100, 1000), wan_gbps=(1, 10, 100),
                               policies=("fixed-domain:4", "fixed-p:0.5", "planner")))

Policies (domains at the coarsest level, the DC; finer levels keep S = 1 as in the paper's 4-DC run):
- ``ep``               plain EP (the baseline of every speed-up);
- ``fixed-domain:K``   S_dc = K DCs per domain at every DC count (the largest divisor of the DC count <= K);
- ``fixed-p:P``        the DC-level all-to-all fraction p = 1 - S_dc / N held at P (S_dc rounded to the
                       divisor of N nearest (1 - P) N);
- ``planner``          the planner's choice (tier-b cost model, every S combination + replicated);
- ``paper``            the paper's closed-form p* per level, rounded to a feasible S (tier a);
- ``replicated``       EP inside each DC, experts replicated across DCs;
- ``best``             the fastest plan by simulation among every candidate (slow for large worlds);
- ``pp:K``             K pipeline stages (a stage = N / K DCs, or a part of one DC), the planner's plan for
                       the EP group of one stage; the same global batch, so M x K micro-batches;
- ``layout``           the fastest of ``planner`` and every feasible ``pp:K`` by the cost model (K divides
                       the layers and the world, stages aligned with DCs: plan/layout.py's rules, TP = 1);
- ``megatron``         the same over plans without hybridep only (plain EP and replicated experts): the
                       best Megatron layout, the baseline hybridep must beat.

Scaling the world: ``base`` gives the level structure and link speeds; the DC level gets N units and the
swept WAN speed (link and uplink). With ``ep_span="all"`` one EP group spans every DC and the model gets
``experts_per_rank`` x world experts (the expert count grows with the group, as in the paper's scale
simulation; T_pre stays the model's, so the router's cost does not grow with it); ``ep_span="default"``
keeps the model and uses the largest EP group that fits.
"""

from __future__ import annotations

import csv
import dataclasses
import math
import os
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.grid import divisors
from megatron_hybridep.plan.layout import is_hybridep, layout_workload
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.planner import choose_plan, enumerate_plans, within_quality_cap
from megatron_hybridep.plan.topology import Level, Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim.schedule import PHASES, SimOptions
from megatron_hybridep.sim.simulate import simulate

POLICIES = ("ep", "fixed-domain", "fixed-p", "planner", "paper", "replicated", "best", "pp", "layout", "megatron")
LAYOUT_POLICIES = ("pp", "layout", "megatron")  # policies that choose the pipeline layout too


# ---- topology and workload at a sweep point -------------------------------------------------------------------
def scaled_topology(base: Topology, dcs: int, wan_gbps: float | None = None,
                    wan_latency_us: float | None = None) -> Topology:
    """``base`` with N units at its coarsest level; overrides that name units >= N are dropped."""
    if len(base.levels) < 2:
        raise PlanError(f"{base.source}.levels: a sweep over DCs needs >= 2 levels (dc and what is inside); "
                        "fix: use e.g. configs/topologies/1000dc_x_8.yaml")
    if dcs < 1:
        raise PlanError(f"dcs: must be >= 1, got {dcs}; fix: pass DC counts like 2,10,100,1000")
    lv = base.levels[0]
    bw = lv.bandwidth_gbps if wan_gbps is None else float(wan_gbps)
    up = lv.uplink_gbps if (wan_gbps is None or lv.uplink_gbps is None) else float(wan_gbps)
    lat = lv.latency_us if wan_latency_us is None else float(wan_latency_us)
    over = tuple(o for o in lv.overrides if o.a < dcs and o.b < dcs)
    dc = Level(lv.name, int(dcs), bw, lat, up, over)
    return Topology((dc,) + tuple(base.levels[1:]), base.name, base.description, base.source, base.memory_gb_per_gpu)


def point_workload(work: Workload, topo: Topology, ep_span: str, experts_per_rank: int) -> tuple[Workload, int]:
    """The model at a sweep point and its EP size."""
    if ep_span == "all":
        G = topo.world_size
        if work.num_experts != experts_per_rank * G:
            # keep the compute before the experts of the model as given: only the expert count scales
            t_pre_ms = work.t_pre_ms if work.t_pre_ms is not None else work.t_pre * 1e3
            work = work.replace(num_experts=experts_per_rank * G, top_k=min(work.top_k, experts_per_rank * G),
                                routing_counts=None, t_pre_ms=t_pre_ms)
        return work, G
    if ep_span != "default":
        raise PlanError(f"ep_span: unknown {ep_span!r}; fix: use 'all' (one EP group over every DC) or 'default'")
    return work, topo.default_ep_size(work.num_experts)


# ---- policies -------------------------------------------------------------------------------------------------
def parse_policy(text: str) -> tuple[str, float | None]:
    name, _, value = text.partition(":")
    if name not in POLICIES:
        raise PlanError(f"policy: unknown {name!r}; fix: use one of ep, fixed-domain:K, fixed-p:P, planner, paper, "
                        "replicated, best, pp:K, layout, megatron")
    if name == "pp":
        if not value.isdigit() or int(value) < 1:
            raise PlanError(f"policy {text!r}: needs the number of pipeline stages, e.g. pp:4")
        return name, float(value)
    if name in ("fixed-domain", "fixed-p"):
        try:
            v = float(value)
        except ValueError:
            raise PlanError(f"policy {text!r}: needs a value, e.g. fixed-domain:4 or fixed-p:0.5") from None
        if name == "fixed-p" and not 0 <= v < 1:
            raise PlanError(f"policy {text!r}: p must be in [0, 1); fix: e.g. fixed-p:0.5")
        if name == "fixed-domain" and (v < 1 or v != int(v)):
            raise PlanError(f"policy {text!r}: the domain size is a whole number of DCs >= 1")
        return name, v
    if value:
        raise PlanError(f"policy {text!r}: {name} takes no value")
    return name, None


def dc_plan(topo: Topology, work: Workload, ep_size: int, s_dc: int) -> Plan:
    """A domains plan with S_dc DCs per domain at the coarsest level, S = 1 below."""
    lay = topo.ep_layout(ep_size)
    if lay.levels[0] != 0:
        raise PlanError(f"ep_size={ep_size}: the EP group does not span DCs, so DC-level domains do not apply; "
                        "fix: use --ep-span all or a larger EP group")
    sizes = (s_dc,) + (1,) * (len(lay.counts) - 1)
    return Plan("domains", lay.names, lay.counts, sizes, work.num_experts)


def policy_plan(policy: str, value: float | None, topo: Topology, work: Workload, ep_size: int,
                options: SimOptions | None = None) -> Plan:
    lay = topo.ep_layout(ep_size)
    n_dc = lay.counts[0] if lay.levels[0] == 0 else 1
    if policy == "ep":
        return Plan("domains", lay.names, lay.counts, (1,) * len(lay.counts), work.num_experts)
    if policy == "fixed-domain":
        assert value is not None
        return dc_plan(topo, work, ep_size, max(d for d in divisors(n_dc) if d <= int(value)))
    if policy == "fixed-p":
        assert value is not None
        target = (1 - value) * n_dc
        s = min(divisors(n_dc), key=lambda d: (abs(d - target), d))
        return dc_plan(topo, work, ep_size, s)
    if policy == "replicated":
        return Plan.replicated(lay.counts, work.num_experts, lay.names)
    if policy == "planner":
        return choose_plan(topo, work, ep_size).best
    if policy == "paper":
        from megatron_hybridep.plan.paper_model import PaperModel

        sizes = PaperModel(topo, work).optimum(ep_size).domain_sizes
        return Plan("domains", lay.names, lay.counts, sizes, work.num_experts)
    if policy == "best":
        plans = within_quality_cap(work, enumerate_plans(lay, work.num_experts))
        return min(plans, key=lambda p: simulate(topo, work, p, options=options).total)
    raise PlanError(f"policy: unknown {policy!r}")


# ---- pipeline layouts ------------------------------------------------------------------------------------------
def pipeline_sizes(topo: Topology, work: Workload) -> tuple[int, ...]:
    """PP sizes a point admits: divisors of the layers whose stages are contiguous blocks aligned with
    the levels (plan/layout.py's rules)."""
    out = []
    for k in divisors(work.layers):
        try:
            topo.pipeline_stage(k)
        except PlanError:
            continue
        out.append(k)
    return tuple(out)


def pipeline_point(topo: Topology, work: Workload, pp: int, ep_span: str) -> tuple[Workload, int]:
    """The workload of PP ``pp`` for the same global batch (TP 1) and its EP size: one stage's ranks
    with ``ep_span="all"``, else the largest group that fits a stage."""
    w = layout_workload(work, 1, pp)
    stage = topo.pipeline_stage(pp)
    return w, stage.world_size if ep_span == "all" else stage.default_ep_size(w.num_experts)


def layout_plan(policy: str, value: float | None, topo: Topology, work: Workload,
                ep_span: str) -> tuple[Workload, int, Plan]:
    """``pp:K``, ``layout`` or ``megatron`` (module doc): the workload, EP size and plan to simulate."""
    sizes = pipeline_sizes(topo, work)
    if policy == "pp":
        k = int(value or 1)
        if k not in sizes:
            raise PlanError(f"pp:{k}: {work.layers} layers on {topo.describe()} admit PP {list(sizes)}")
        w, G = pipeline_point(topo, work, k, ep_span)
        return w, G, choose_plan(topo, w, G).best
    best: tuple[float, Workload, int, Plan] | None = None
    for k in sizes:
        w, G = pipeline_point(topo, work, k, ep_span)
        try:
            r = choose_plan(topo, w, G)
        except PlanError:  # nothing fits the memory at this PP
            continue
        c = next((c for c in r.candidates if c.fits_memory and (policy == "layout" or not is_hybridep(c.plan))), None)
        if c is not None and (best is None or c.cost.total < best[0]):
            best = (c.cost.total, w, G, c.plan)
    if best is None:
        raise PlanError(f"{policy}: no pipeline layout fits the memory on {topo.describe()}")
    return best[1], best[2], best[3]


def dc_p(plan: Plan) -> float:
    """The paper's p at the DC level: fraction of token traffic still crossing DCs by all-to-all."""
    if plan.kind == "replicated":
        return 0.0
    return 1.0 - plan.domain_sizes[0] / plan.level_counts[0]


# ---- the sweep ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class SweepSpec:
    base: Topology
    workload: Workload
    dcs: tuple[int, ...]
    wan_gbps: tuple[float, ...]
    policies: tuple[str, ...]
    ep_span: str = "all"
    experts_per_rank: int = 1
    wan_latency_us: float | None = None
    options: SimOptions = dataclasses.field(default_factory=SimOptions)

    def points(self) -> list[tuple[int, float]]:
        return [(n, b) for n in self.dcs for b in self.wan_gbps]


def _point(spec: SweepSpec, dcs: int, bw: float) -> list[dict[str, Any]]:
    """Every policy at one (DC count, bandwidth) point, plus the EP baseline."""
    topo = scaled_topology(spec.base, dcs, bw, spec.wan_latency_us)
    work, G = point_workload(spec.workload, topo, spec.ep_span, spec.experts_per_rank)
    rows = []
    t0 = time.perf_counter()
    ep_plan = policy_plan("ep", None, topo, work, G)
    ep = simulate(topo, work, ep_plan, options=spec.options)
    done: dict[tuple[Plan, int], Any] = {(ep_plan, 1): ep}
    for text in spec.policies:
        name, value = parse_policy(text)
        t1 = time.perf_counter()
        w, g = work, G
        try:
            if name in LAYOUT_POLICIES:
                w, g, plan = layout_plan(name, value, topo, work, spec.ep_span)
            else:
                plan = policy_plan(name, value, topo, work, G, spec.options)
        except PlanError as exc:
            rows.append(_row(spec, dcs, bw, G, work, text, None, None, ep, 0.0, str(exc)))
            continue
        key = (plan, w.pipeline_model_parallel_size)
        if key not in done:
            done[key] = simulate(topo, w, plan, options=spec.options)
        rows.append(_row(spec, dcs, bw, g, w, text, plan, done[key], ep, time.perf_counter() - t1))
    for r in rows:
        r["point_seconds"] = time.perf_counter() - t0
    return rows


def _row(spec: SweepSpec, dcs: int, bw: float, G: int, work: Workload, policy: str, plan: Plan | None,
         res: Any, ep: Any, secs: float, error: str = "") -> dict[str, Any]:
    row: dict[str, Any] = {
        "dcs": dcs, "ranks_per_dc": math.prod(spec.base.level_counts[1:]), "ep_size": G,
        "experts": work.num_experts, "pp": work.pipeline_model_parallel_size, "micro_batches": work.micro_batches,
        "wan_gbps": bw, "policy": policy,
        "plan": plan.label if plan else "", "domain_sizes": "x".join(map(str, plan.domain_sizes)) if plan else "",
        "p_dc": round(dc_p(plan), 6) if plan else "", "iteration_s": res.total if res else "",
        "ep_iteration_s": ep.total, "speedup_vs_ep": ep.total / res.total if res else "",
        "forward_s": res.forward if res else "", "ep_forward_s": ep.forward,
        "sim_seconds": secs, "error": error,
    }
    for ph in PHASES:
        row[ph] = res.phases.get(ph, 0.0) if res else ""
    return row


def _point_star(args: tuple[SweepSpec, int, float]) -> list[dict[str, Any]]:
    return _point(*args)


def run_sweep(spec: SweepSpec, jobs: int = 1, progress: bool = False,
              on_row: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Simulate every point; ``jobs`` > 1 uses that many processes; ``progress`` shows a tqdm bar."""
    pts = spec.points()
    rows: list[dict[str, Any]] = []
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=len(pts), unit="point", desc="simulate", leave=False)

    def take(batch: Iterable[dict[str, Any]]) -> None:
        for r in batch:
            rows.append(r)
            if on_row:
                on_row(r)
        if bar is not None:
            bar.update(1)

    try:
        if jobs > 1 and len(pts) > 1:
            # large points first so the pool stays busy to the end
            order = sorted(pts, key=lambda p: -p[0])
            with ProcessPoolExecutor(max_workers=jobs) as pool:
                for batch in pool.map(_point_star, [(spec, n, b) for n, b in order]):
                    take(batch)
        else:
            for n, b in pts:
                take(_point(spec, n, b))
    finally:
        if bar is not None:
            bar.close()
    rows.sort(key=lambda r: (r["dcs"], r["wan_gbps"], spec.policies.index(r["policy"])))
    return rows


def write_csv(rows: Sequence[dict[str, Any]], path: str) -> None:
    if not rows:
        raise PlanError("sweep: no rows to write; fix: give at least one DC count, bandwidth and policy")
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", newline="", encoding="utf-8") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)


def parse_list(text: str, kind: type, what: str) -> tuple[Any, ...]:
    """'2,10,100' or a range 'a:b:n' (n log-spaced integers / floats from a to b inclusive)."""
    try:
        if text.count(":") == 2:
            a, b, n = text.split(":")
            lo, hi, k = float(a), float(b), int(n)
            if k < 2 or lo <= 0 or hi <= lo:
                raise ValueError
            vals = [lo * (hi / lo) ** (i / (k - 1)) for i in range(k)]
            out = [kind(round(v)) if kind is int else kind(v) for v in vals]
            return tuple(dict.fromkeys(out))
        return tuple(kind(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise PlanError(f"{what}: cannot read {text!r}; fix: a comma list like 2,10,100 or a log range "
                        "like 2:1000:12") from None
