"""sim/: a flow-level simulator of HybridEP (and plain EP, and replicated experts) training iterations.

Pure Python + numpy, built on plan/ (Topology, Workload, Plan, the families of plan/network.py):

    from megatron_hybridep.sim import simulate, SimOptions
    r = simulate(topo, work, plan)                 # plan=None: the planner's choice
    r.total, r.phases, r.forward, r.timeline       # seconds per iteration, exposed per phase, spans
    r.ops["gather"].busy_seconds, r.traffic        # per collective, bytes per rank per level

What is simulated: per MoE layer and micro-batch the compute (T_pre, experts; backward 2x) and the
collectives (token all-to-all over rails, expert all-gather and gradient return over domains, shared-
expert refresh, expert data-parallel all-reduce), in the order and overlap the runtime uses
(schedule.py), on links with bandwidth, latency, uplinks and per-pair overrides shared max-min fairly
by the flows in flight (maxmin.py, engine.py). Flows are reduced to classes by the translation
symmetry of the world (flows.py), EP groups with identical links are simulated once (simulate.py).

Modules: flows (collectives -> flow classes, link table), maxmin (progressive filling), engine
(event-driven executor, memo), schedule (the runtime's / the paper's program), simulate (one
iteration), sweep (DC count x bandwidth x policy), paper (the paper's 1000-DC experiments),
validate (testbed CSV, closed form), plot (PNGs), cli (`hybridep simulate`).
"""

from megatron_hybridep.sim.schedule import PHASES, SimOptions
from megatron_hybridep.sim.simulate import SimResult, simulate

__all__ = ["PHASES", "SimOptions", "SimResult", "simulate"]
