"""The paper's 1000-DC claims in the regime that produces them, derived from its stream model.

The setting is sim/paper.py's (N DCs x 8 GPUs, one EP group over all of them, uniform WAN swept
over a 100x range as each DC's uplink, domains at the DC level, forward only, no latency). With
exact bytes, one MoE layer's forward on the DC uplink (8 GPUs share it) is

    T(S) = max(T_pre, 8 (S - 1) P / B) + T_exp + 2 * max(8 D (N - S) / (N B), 7 D S / (8 N B_gpu))

with S DCs whose experts a DC holds (S = 1: EP) and p = (N - S) / (N - 1), the paper's Definition 1
share of peers still reached by all-to-all (p = k / (G - 1) at the DC level). Let A(B) = EP's two
all-to-alls and c = T_pre + T_exp. Then:

- while the gather hides behind T_pre, speed-up(B) = (c + A) / (c + p A): it grows as B falls
  (A ~ 1/B) toward 1/p, so a claim lo..hi needs p <= 1/hi;
- with a bandwidth range k = B_max / B_min and r = c / A(B_max), the two ends give two linear
  equations, so p and r follow: p = (k (lo - 1) - (hi - 1)) / (k hi (lo - 1) - lo (hi - 1)) and
  r = (1 - lo p) / (lo - 1) (compute comparable to EP's all-to-alls at the top bandwidth);
- the gather stays hidden at the lowest bandwidth only if 8 (S - 1) P <= T_pre B_min: once exposed
  it grows like 1/B too, and the speed-up flattens to A / (AG + p A) (our original reading);
- at fixed p, adding DCs raises EP's WAN share (N - 1) / N while HybridEP's stays p: the speed-up
  grows with N as long as the gather (S - 1 = (1 - p) N - 1 experts) stays hidden.

Equal-size domains give p = 1 - 1/m only (S divides N): p = 0.25 is not one of them at any N, and
S = 333 does not divide 1000. The closed form is exact for uniform neighbourhoods (each DC holds
the experts of S DCs, p = k / (N - 1)); the simulator checks it at the equal-domain points of the
same regime (S = N / 2 and S = N for fixed p; S = 333 at N = 666, 999 for the fixed domain).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload
from megatron_hybridep.sim.paper import PAPER_CLAIMS, repro_topology, repro_workload
from megatron_hybridep.sim.schedule import SimOptions
from megatron_hybridep.sim.simulate import simulate
from megatron_hybridep.sim.sweep import scaled_topology

BANDWIDTHS = (1.0, 2.5, 5.0, 10.0, 25.0, 50.0, 100.0)   # Gbit/s, the 100x range
SIM_BANDWIDTHS = (1.0, 10.0, 100.0)                      # where the simulator checks the closed form
RANKS = 8                                                # GPUs sharing one DC uplink
GPU_GBPS = 128.0                                         # each GPU's link inside a DC (1000dc_x_8)
FIXED_P = 0.25
FIXED_DOMAIN = 333                                       # about N / 3 DCs
DCS_FIXED_P = (4, 8, 16, 32, 64, 128, 256, 512, 1000)
DCS_FIXED_DOMAIN = (400, 500, 600, 666, 800, 999, 1000)
GATHER_MARGIN = 0.5      # the derived regime's gather uses half of T_pre at the lowest bandwidth
PAPER_FORWARD = SimOptions(schedule="paper", backward=False)


def gbps(b: float) -> float:
    return b * 1e9 / 8


# ---- the closed form --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Inputs:
    D: float        # bytes each GPU dispatches per all-to-all
    P: float        # bytes of one shipped expert (one expert per GPU)
    t_pre: float    # compute before the experts (hides the gather)
    t_exp: float    # expert compute (the same for every plan under balanced routing)


def layer_time(N: float, S: float, x: Inputs, B: float) -> tuple[float, float, float]:
    """(total, gather, all-to-alls) of one MoE layer's forward; S may be fractional (neighbourhoods)."""
    ag = RANKS * (S - 1) * x.P / B
    # a rail also spans the DC's other GPUs: D S / (8 N) to each, concurrently on the GPU links
    a2a = 2 * max(RANKS * x.D * (N - S) / (N * B), (RANKS - 1) * x.D * S / (RANKS * N * gbps(GPU_GBPS)))
    return max(x.t_pre, ag) + x.t_exp + a2a, ag, a2a


def speedup(N: float, S: float, x: Inputs, gbit: float) -> float:
    B = gbps(gbit)
    return layer_time(N, 1, x, B)[0] / layer_time(N, S, x, B)[0]


def p_of(N: float, S: float) -> float:
    return (N - S) / (N - 1)


def s_of(N: float, p: float) -> float:
    """S for a given p = k / (N - 1), k rounded to whole peers."""
    return N - round(p * (N - 1))


def solve_claim(lo: float, hi: float, k: float) -> tuple[float, float]:
    """(p, r = c / A(B_max)) that make a hidden-gather speed-up run from lo at B_max to hi at B_max / k."""
    p = (k * (lo - 1) - (hi - 1)) / (k * hi * (lo - 1) - lo * (hi - 1))
    return p, (1 - lo * p) / (lo - 1)


# ---- the two regimes --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Experiment:
    claim: str
    dcs: tuple[int, ...]
    bandwidths: tuple[float, ...]
    inputs: Inputs
    fixed: float                 # p (fixed-p) or S (fixed-domain)

    def S(self, N: float) -> float:
        return s_of(N, self.fixed) if self.claim == "fixed-p" else min(self.fixed, N)

    def speedups(self, N: float) -> list[float]:
        return [speedup(N, self.S(N), self.inputs, b) for b in self.bandwidths]


def original_inputs(root: str) -> Inputs:
    w = repro_workload(root)
    return Inputs(w.dispatch_bytes, w.expert_wire_bytes, w.t_pre, w.tokens * w.top_k * w.expert_seconds_per_token)


def original(root: str) -> dict[str, Experiment]:
    """sim/paper.py's reading: S = 4 DCs, p = 0.5 (S = N / 2), 0.36 MB experts, 192 MiB tokens."""
    x = original_inputs(root)
    return {"fixed-domain": Experiment("fixed-domain", (8, 16, 64, 256, 1000), BANDWIDTHS, x, 4),
            "fixed-p": Experiment("fixed-p", DCS_FIXED_P, BANDWIDTHS, x, 0.5)}


def derived(root: str, bandwidths: Sequence[float] = BANDWIDTHS) -> dict[str, Experiment]:
    """The regime the claims need: same model and token traffic, T_pre from r, P from the gather bound.
    p is the paper's (0.25) or S = 333 (~N / 3); r is fitted to the claim's low end only, so the high
    end (at B_max / 100) is a prediction, not a fit."""
    base = original_inputs(root)
    bmax, bmin = max(bandwidths), min(bandwidths)
    out = {}
    for claim, fixed, dcs in (("fixed-domain", FIXED_DOMAIN, DCS_FIXED_DOMAIN), ("fixed-p", FIXED_P, DCS_FIXED_P)):
        lo, _ = PAPER_CLAIMS[claim]
        N = 1000
        S = s_of(N, fixed) if claim == "fixed-p" else fixed
        p = p_of(N, S)
        A = layer_time(N, 1, dataclasses.replace(base, t_pre=0.0, t_exp=0.0), gbps(bmax))[2]
        c = (1 - lo * p) / (lo - 1) * A
        t_pre = c - base.t_exp
        S_max = max(s_of(n, fixed) if claim == "fixed-p" else min(fixed, n) for n in dcs)
        P = GATHER_MARGIN * t_pre * gbps(bmin) / (RANKS * (S_max - 1))
        out[claim] = Experiment(claim, dcs, tuple(bandwidths), Inputs(base.D, P, t_pre, base.t_exp), fixed)
    return out


# ---- conditions, derived --------------------------------------------------------------------------------
def conditions(e: Experiment, N: int = 1000) -> dict[str, float]:
    """What the claim needs vs what the experiment has, at N DCs."""
    lo, hi = PAPER_CLAIMS[e.claim]
    k = max(e.bandwidths) / min(e.bandwidths)
    p_need, r_need = solve_claim(lo, hi, k)
    x, S = e.inputs, e.S(N)
    A_top = layer_time(N, 1, dataclasses.replace(x, t_pre=0.0, t_exp=0.0), gbps(max(e.bandwidths)))[2]
    ag_low = layer_time(N, S, x, gbps(min(e.bandwidths)))[1]
    return {"p_need": p_need, "p_max": 1 / hi, "r_need": r_need, "k": k, "p": p_of(N, S), "S": S,
            "r": (x.t_pre + x.t_exp) / A_top, "ag_over_tpre": ag_low / x.t_pre if x.t_pre else math.inf,
            "P_over_D": x.P / x.D}


def trends(e: Experiment) -> dict[str, bool]:
    """Lower bandwidth -> larger speed-up (at the largest N); fixed p: more DCs -> larger speed-up."""
    N = max(e.dcs)
    sp = [speedup(N, e.S(N), e.inputs, b) for b in sorted(e.bandwidths)]
    out = {"lower_bw_larger": all(a > b for a, b in zip(sp, sp[1:], strict=False))}
    if e.claim == "fixed-p":
        for b in e.bandwidths:
            by_n = [speedup(n, e.S(n), e.inputs, b) for n in sorted(e.dcs)]
            if not all(a < c for a, c in zip(by_n, by_n[1:], strict=False)):
                out["more_dcs_larger"] = False
                break
        else:
            out["more_dcs_larger"] = True
    return out


def closed_form_rows(e: Experiment, reading: str) -> list[dict[str, Any]]:
    rows = []
    for n in e.dcs:
        S = e.S(n)
        for b in e.bandwidths:
            rows.append({"reading": reading, "claim": e.claim, "dcs": n, "wan_gbps": b, "S_dc": S,
                         "p": p_of(n, S) if n > 1 else 0.0, "equal_domains": float(S).is_integer() and n % S == 0,
                         "speedup_closed_form": speedup(n, S, e.inputs, b), "speedup_sim": ""})
    return rows


# ---- the simulator at the equal-domain points -------------------------------------------------------------
def sim_workload(root: str, x: Inputs) -> Workload:
    return repro_workload(root).replace(t_pre_ms=x.t_pre * 1e3, compressed_expert_bytes=x.P,
                                        compressed_grad_bytes=x.P)


def sim_speedup(topo: Topology, w: Workload, N: int, S: int, gbit: float) -> tuple[float, float, float]:
    """(speed-up, simulated layer time of the plan, of EP), forward only, the paper's schedule."""
    t = scaled_topology(topo, N, gbit)
    G = t.world_size
    w = w.replace(num_experts=G, top_k=min(w.top_k, G), routing_counts=None)
    lay = t.ep_layout(G)
    rest = (1,) * (len(lay.counts) - 1)
    ep = simulate(t, w, Plan("domains", lay.names, lay.counts, (1,) + rest, G), options=PAPER_FORWARD)
    hy = simulate(t, w, Plan("domains", lay.names, lay.counts, (S,) + rest, G), options=PAPER_FORWARD)
    L = w.num_moe_layers * w.micro_batches
    return ep.total / hy.total, hy.total / L, ep.total / L


def sim_points(e: Experiment) -> list[tuple[int, int]]:
    """(N, S) with equal domains in this experiment's regime."""
    if e.claim == "fixed-p":
        return [(1000, 500), (1000, 1000), (64, 32)]
    return [(n, int(e.fixed)) for n in (666, 999)]


def simulate_points(root: str, e: Experiment, bandwidths: Sequence[float] | None = None) -> list[dict[str, Any]]:
    topo, w = repro_topology(root), sim_workload(root, e.inputs)
    rows = []
    for N, S in sim_points(e):
        for b in bandwidths or e.bandwidths:
            sp, hy, ep = sim_speedup(topo, w, N, S, b)
            B = gbps(b)
            rows.append({"reading": "derived", "claim": e.claim, "dcs": N, "wan_gbps": b, "S_dc": S, "p": p_of(N, S),
                         "equal_domains": True, "on_line": S == e.S(N),
                         "speedup_closed_form": speedup(N, S, e.inputs, b),
                         "speedup_sim": sp, "layer_sim_s": hy, "layer_closed_form_s": layer_time(N, S, e.inputs, B)[0],
                         "ep_layer_sim_s": ep, "ep_layer_closed_form_s": layer_time(N, 1, e.inputs, B)[0]})
    return rows


# ---- the table ----------------------------------------------------------------------------------------------
def _range(v: Sequence[float]) -> str:
    return f"{min(v):.3f}x-{max(v):.3f}x"


def _yes(b: bool | None) -> str:
    return "-" if b is None else ("yes" if b else "NO")


def table(root: str, orig_sim: dict[str, Sequence[float]] | None = None) -> list[dict[str, str]]:
    """One row per claim: paper, conditions (needed / original / derived), results, trends."""
    org, der = original(root), derived(root)
    out = []
    for claim in ("fixed-domain", "fixed-p"):
        lo, hi = PAPER_CLAIMS[claim]
        co, cd = conditions(org[claim]), conditions(der[claim])
        to, td = trends(org[claim]), trends(der[claim])
        need = (f"p <= 1/{hi:g} = {cd['p_max']:.3f}; over {cd['k']:.0f}x bandwidth: p = {cd['p_need']:.3f}, "
                f"compute/EP a2a at top BW r = {cd['r_need']:.2f}; gather hidden at lowest BW (AG/T_pre <= 1)")
        orig_res = _range(org[claim].speedups(1000))
        if orig_sim and orig_sim.get(claim):
            orig_res += f" (sim {_range(orig_sim[claim])})"
        out.append({
            "claim": claim, "paper": f"{lo:.2f}x-{hi:.2f}x", "needs": need,
            "original": (f"S={co['S']:g}, p={co['p']:.3f}, r={co['r']:.3f}, AG/T_pre={co['ag_over_tpre']:.3g} -> "
                         f"{orig_res}"),
            "derived": (f"S={cd['S']:g}, p={cd['p']:.3f}, r={cd['r']:.2f}, AG/T_pre={cd['ag_over_tpre']:.2f}, "
                        f"P/D={cd['P_over_D']:.2e} (T_pre {der[claim].inputs.t_pre * 1e3:.0f} ms, "
                        f"P {der[claim].inputs.P / 1e3:.1f} kB) -> {_range(der[claim].speedups(1000))}"),
            "trend_bw": f"original {_yes(to['lower_bw_larger'])}, derived {_yes(td['lower_bw_larger'])}",
            "trend_dcs": (f"original {_yes(to.get('more_dcs_larger'))}, derived {_yes(td.get('more_dcs_larger'))}"
                          if claim == "fixed-p" else "- (fixed S: falls with N by design)"),
        })
    return out


def format_claims(rows: Sequence[dict[str, str]]) -> str:
    heads = [("claim", "claim at 1000 DCs"), ("paper", "paper"), ("needs", "needs (stream model)"),
             ("original", "original reading"), ("derived", "regime meeting the conditions"),
             ("trend_bw", "lower BW -> larger?"), ("trend_dcs", "more DCs at fixed p -> larger?")]
    lines = []
    for r in rows:
        lines.append(f"{r['claim']}: paper {r['paper']}")
        for k, h in heads[2:]:
            lines.append(f"  {h:32s} {r[k]}")
    return "\n".join(lines)


def markdown_table(rows: Sequence[dict[str, str]]) -> str:
    heads = ["claim @1000 DCs", "paper", "needs (derived)", "original reading", "derived regime",
             "lower BW -> larger", "more DCs at fixed p -> larger"]
    keys = ["claim", "paper", "needs", "original", "derived", "trend_bw", "trend_dcs"]
    out = ["| " + " | ".join(heads) + " |", "|" + "---|" * len(heads)]
    out += ["| " + " | ".join(r[k] for k in keys) + " |" for r in rows]
    return "\n".join(out)


def simulate_neighbourhood_points(root: str, e: Experiment, N: int = 13,
                                  bandwidths: Sequence[float] = SIM_BANDWIDTHS) -> list[dict[str, Any]]:
    """The experiment's p as a neighbourhood plan (sim/neighbourhood.py, explicit flows: small N),
    e.g. p = 0.25 at 13 DCs (S = 10), which no equal-domain plan has."""
    from megatron_hybridep.sim.neighbourhood import simulate_neighbourhood

    topo, w0 = repro_topology(root), sim_workload(root, e.inputs)
    S = int(e.S(N))
    rows = []
    for b in bandwidths:
        t = scaled_topology(topo, N, b)
        w = w0.replace(num_experts=t.world_size, top_k=min(w0.top_k, t.world_size), routing_counts=None)
        hy, ep = (simulate_neighbourhood(t, w, s, PAPER_FORWARD) / (w.num_moe_layers * w.micro_batches)
                  for s in (S, 1))
        B = gbps(b)
        rows.append({"reading": "derived", "claim": e.claim, "dcs": N, "wan_gbps": b, "S_dc": S, "p": p_of(N, S),
                     "equal_domains": N % S == 0, "on_line": True, "plan": "neighbourhood",
                     "speedup_closed_form": speedup(N, S, e.inputs, b), "speedup_sim": ep / hy,
                     "layer_sim_s": hy, "layer_closed_form_s": layer_time(N, S, e.inputs, B)[0],
                     "ep_layer_sim_s": ep, "ep_layer_closed_form_s": layer_time(N, 1, e.inputs, B)[0]})
    return rows
