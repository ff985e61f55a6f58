"""Pipeline parallelism: what the sends between stages cost and how long the schedule runs.

Megatron orders ranks TP fastest and PP outermost, so stage s is the contiguous block of ranks
[s R, (s + 1) R) with R = world / PP, and rank r of a stage sends its activations to rank r + R (its
gradients come back from there). Every rank of a stage sends at once, so a stage's ranks share
the uplinks they leave through; :func:`boundary_sends` prices each stage boundary with the
network's explicit flows (plan/network.py): inside a unit the intra-unit rate, across a DC the WAN
sibling link and both DCs' uplinks, with per-pair overrides.

Two schedules, as Megatron-Core runs them (pipeline_parallel/schedules.py, checked against 0.19):
- 1F1B (no virtual stages): warm-up forwards, then one forward and one backward per micro-batch,
  then cool-down backwards. Its sends block: the schedule refuses ``overlap_p2p_comm`` and waits on
  every batched isend/irecv. :func:`one_f_one_b` replays that program stage by stage; a transfer
  starts when both its sender and its receiver have posted it and takes the boundary's time. With
  free sends it gives (M + P - 1)(f + b): the bubble is (P - 1)/M of the work.
- interleaved (v virtual stages per rank, ``overlap_p2p_comm`` on, Megatron's default): a send
  runs while the next chunk computes. :func:`interleaved` prices it in closed form: the bubble
  (P - 1)(f + b)/v, the fill and the drain crossing each boundary once (the first micro-batch's
  activations forward, the last one's gradients back), and the steady state bound by the busier
  of compute and the busiest link (every boundary's bytes of one micro-batch: sends overlap compute
  but not each other).
Stages are priced alike: f and b are the busiest stage's (plan/cost.py prices that one).

:func:`one_f_one_b_shared` replays 1F1B on ranks that share a few cores (the CPU testbed: eight
ranks on two cores). Computing ranks split the cores evenly; a stage blocked on a send or receive
uses none, so the others run faster. That hides part of a stage's wait, which a collective that
blocks every rank at once cannot (bench/predict.py prices the testbed with it). It is a fluid replay:
a stage's ranks may form several independent pipelines (EP 1: data-parallel replicas) whose transfers
share each boundary's link, started out of step.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.network import Network, PhaseCost
from megatron_hybridep.plan.topology import Topology


@dataclass(frozen=True)
class Sends:
    """The sends of one micro-batch between pipeline stages."""

    fwd: tuple[PhaseCost, ...]      # boundary k: stage k's activations to stage k + 1, alone
    bwd: tuple[PhaseCost, ...]      # boundary k: stage k + 1's activation gradients back to stage k
    per_micro_batch: PhaseCost      # every boundary in both directions together (link loads per micro-batch)


@dataclass(frozen=True)
class PipelineTime:
    total: float        # seconds of the pipelined micro-batches (compute + what the schedule exposes)
    bubble: float       # idle time of the schedule with free sends: total(free) - M (f + b)
    send: float         # what the sends add: total - total(free)


def boundary_sends(world: Topology, pp: int, nbytes: float, virtual: int = 1, call_s: float = 0.0) -> Sends:
    """Each rank sends ``nbytes`` per chunk boundary per micro-batch. With ``virtual`` > 1 the last
    stage also sends each chunk but the last to stage 0 (the wrap-around boundary, v - 1 times).
    ``call_s``: the backend's fixed cost per call (Workload.call_seconds), once per send."""
    n = world.world_size
    if pp < 2:
        z = PhaseCost.zero(len(world.levels))
        return Sends((), (), z)
    if n % pp:
        raise PlanError(f"pipeline_model_parallel_size: {pp} does not divide the world size {n} "
                        f"({world.describe()}); fix: use a divisor of it")
    net, R = Network(world, call_s), n // pp
    lay = world.ep_layout(n)  # the whole world as one group: flows between any two ranks
    ranks = np.arange(R)
    ones = np.full(R, float(nbytes))

    def cost(src_stage: int, dst_stage: int) -> PhaseCost:
        return net.flows(lay, ranks + src_stage * R, ranks + dst_stage * R, ones)

    fwd = tuple(cost(k, k + 1) for k in range(pp - 1))
    bwd = tuple(cost(k + 1, k) for k in range(pp - 1))
    src, dst, w = [], [], []
    pairs = [(k, k + 1, virtual) for k in range(pp - 1)] + ([(pp - 1, 0, virtual - 1)] if virtual > 1 else [])
    for a, b, times in pairs:
        for s, d in ((a, b), (b, a)):
            src.append(ranks + s * R)
            dst.append(ranks + d * R)
            w.append(ones * times)
    both = net.flows(lay, np.concatenate(src), np.concatenate(dst), np.concatenate(w))
    return Sends(fwd, bwd, both)


def _boundary_times(pp: int, fwd: Sequence[float], bwd: Sequence[float]) -> tuple[list[float], list[float]]:
    """Each boundary's transfer times both ways, free where none are given."""
    fwd = list(fwd) or [0.0] * (pp - 1)
    bwd = list(bwd) or [0.0] * (pp - 1)
    if len(fwd) != pp - 1 or len(bwd) != pp - 1:
        raise ValueError(f"need {pp - 1} boundary times, got {len(fwd)} / {len(bwd)}")
    return fwd, bwd


def one_f_one_b(pp: int, m: int, f: float, b: float, fwd: Sequence[float] = (), bwd: Sequence[float] = ()) -> float:
    """Seconds of Megatron's non-interleaved 1F1B schedule: ``pp`` stages, ``m`` micro-batches, a
    stage's forward ``f`` and backward ``b`` per micro-batch, ``fwd[k]`` / ``bwd[k]`` seconds of one
    activation / gradient transfer over boundary k (default: free). Sends block (module doc)."""
    fwd, bwd = _boundary_times(pp, fwd, bwd)
    progs = [stage_program(s, pp, m) for s in range(pp)]
    clock, pc = [0.0] * pp, [0] * pp
    posted: dict[tuple, float] = {}  # (message, side) -> time its op was posted
    done: dict[tuple, float] = {}    # message -> time it arrived

    def duration(msg: tuple) -> float:
        kind, k, _ = msg
        return fwd[k] if kind == "a" else bwd[k]

    queue, queued = deque(range(pp)), [True] * pp  # a stage blocked on a peer waits for that peer to post
    while queue:
        s = queue.popleft()
        queued[s] = False
        while pc[s] < len(progs[s]):
            op = progs[s][pc[s]]
            if op in ("F", "B"):
                clock[s] += f if op == "F" else b
            else:  # a batched p2p op: a tuple of (side, message)
                fresh = [posted.setdefault((msg, side), clock[s]) for side, msg in op if (msg, side) not in posted]
                for peer in (s - 1, s + 1) if fresh else ():
                    if 0 <= peer < pp and not queued[peer]:
                        queue.append(peer)
                        queued[peer] = True
                if not all((msg, "recv" if side == "send" else "send") in posted for side, msg in op):
                    break  # the peer has not posted yet
                for _, msg in op:
                    if msg not in done:
                        done[msg] = max(posted[(msg, "send")], posted[(msg, "recv")]) + duration(msg)
                clock[s] = max([clock[s]] + [done[msg] for _, msg in op])
            pc[s] += 1
    if any(pc[s] < len(progs[s]) for s in range(pp)):  # pragma: no cover - Megatron's program does not deadlock
        raise RuntimeError("1F1B replay deadlocked")
    return max(clock)


def one_f_one_b_shared(pp: int, m: int, f: float, b: float, fwd: Sequence[float] = (), bwd: Sequence[float] = (),
                       ranks_per_stage: int = 1, cores: float | None = None, duty: float = 1.0, groups: int = 1,
                       stagger: float = 0.0, hold: float = 0.0) -> float:
    """:func:`one_f_one_b` on shared cores: ``f`` and ``b`` are a rank's compute with a core to itself,
    of which it keeps a core busy ``duty`` (the rest waits on something other than the cores); while k
    pipelines' stages compute, each of their ranks runs at min(1, cores / (k ranks duty)) of that speed
    (processor sharing). ``cores`` None: a core per rank (the same result as one_f_one_b).

    ``groups``: a stage's ranks form that many independent pipelines (EP groups of data-parallel
    replicas: nothing couples them until the gradient reduction), each of ranks_per_stage / groups
    ranks; the transfers of one boundary and direction share its link (``fwd`` / ``bwd``: the whole
    stage's transfer; one group's alone takes 1 / groups of it). ``stagger``: pipeline g starts
    g x stagger x (f + b) late. In step, the groups wait together and the result is the one-group replay.
    ``hold``: the share of a computing rank's claim on the cores that a rank blocked on a transfer keeps
    (0: it frees them all; 1: none, the waits hide nothing)."""
    fwd, bwd = _boundary_times(pp, fwd, bwd)
    if cores is not None and not cores > 0:
        raise ValueError(f"cores must be > 0, got {cores!r}")
    if not 0 < duty <= 1:
        raise ValueError(f"duty must be in (0, 1], got {duty!r}")
    if groups < 1 or ranks_per_stage % groups:
        raise ValueError(f"groups must divide ranks_per_stage ({ranks_per_stage}), got {groups!r}")
    ranks = ranks_per_stage // groups
    progs = [stage_program(s, pp, m) for s in range(pp)]
    units = [(g, s) for g in range(groups) for s in range(pp)]
    pc = dict.fromkeys(units, 0)
    late = {u: u[0] * stagger * (f + b) for u in units if u[0] and stagger > 0}  # seconds before it starts
    work: dict = dict.fromkeys(units)  # dedicated seconds left of the F or B a unit computes
    waits: dict = dict.fromkeys(units)  # the transfers of the p2p op a unit waits on
    posted: set = set()
    left: dict = {}  # transfer (group, kind, boundary, micro-batch) -> link seconds left, in the order they started
    done: set = set()
    now = 0.0

    def settle() -> None:
        """Run every unit forward to its next compute or wait (posting ops unblocks peers: repeat)."""
        moved = True
        while moved:
            moved = False
            for u in units:
                if u in late:
                    continue
                g, s = u
                if waits[u] is not None and all(k in done for k in waits[u]):
                    waits[u] = None
                    pc[u] += 1
                    moved = True
                while pc[u] < len(progs[s]) and work[u] is None and waits[u] is None:
                    op = progs[s][pc[u]]
                    if op in ("F", "B"):
                        work[u] = f if op == "F" else b
                        break
                    for side, msg in op:
                        key = (g, *msg)
                        if (key, side) not in posted:
                            posted.add((key, side))
                            moved = True
                            if (key, "recv" if side == "send" else "send") in posted:
                                t = (fwd if msg[0] == "a" else bwd)[msg[1]] / groups
                                if t > 0:
                                    left[key] = t
                                else:
                                    done.add(key)
                    pending = tuple(key for _, msg in op if (key := (g, *msg)) not in done)
                    if pending:
                        waits[u] = pending
                        break
                    pc[u] += 1
                    moved = True

    while True:
        settle()
        busy = [u for u in units if work[u] is not None]
        if not busy and not left and not late:
            if any(pc[u] < len(progs[u[1]]) for u in units):  # pragma: no cover - Megatron's program does not deadlock
                raise RuntimeError("1F1B replay deadlocked")
            return now
        if cores is None or not busy:
            rate = 1.0
        else:  # blocked units (started, not done, not computing) keep ``hold`` of a computing one's claim
            waiting = sum(1 for u in units if work[u] is None and u not in late and pc[u] < len(progs[u[1]])) \
                if hold else 0
            rate = min(1.0, cores / ((len(busy) + hold * waiting) * ranks * duty))
        # one group's transfers over a boundary and direction go in order (one TCP connection per rank pair);
        # the groups' connections share the link
        heads = list({(k[0], *k[1:3]): k for k in reversed(left)}.values())
        share = Counter(k[1:3] for k in heads)
        dt = min([work[u] / rate for u in busy] + list(late.values()) + [left[k] * share[k[1:3]] for k in heads])
        now += dt
        eps = 1e-12 * max(1.0, now)
        for u in busy:
            work[u] -= dt * rate
            if work[u] <= eps:
                work[u] = None
                pc[u] += 1
        for u in list(late):
            late[u] -= dt
            if late[u] <= eps:
                del late[u]
        for k in heads:
            left[k] -= dt / share[k[1:3]]
            if left[k] <= eps:
                del left[k]
                done.add(k)


def stage_program(s: int, pp: int, m: int) -> list:
    """Stage s's ops in Megatron's order; a p2p op is a tuple of (side, (kind, boundary, micro-batch));
    sends off the pipeline's ends are dropped, as Megatron's are no-ops there."""
    def p2p(*items: tuple[str, str, int]) -> tuple:
        out = []
        for side, kind, i in items:
            # activations cross boundary s (sent) / s - 1 (received); gradients the other way round
            k = (s if side == "send" else s - 1) if kind == "a" else (s - 1 if side == "send" else s)
            if 0 <= k < pp - 1:
                out.append((side, (kind, k, i)))
        return tuple(out)

    warm = min(pp - s - 1, m)
    ops: list = []
    for i in range(warm):
        ops += [p2p(("recv", "a", i)), "F", p2p(("send", "a", i))]
    if m > warm:
        ops.append(p2p(("recv", "a", warm)))
    for j in range(m - warm):
        i = warm + j  # forward of micro-batch i, backward of micro-batch j
        ops += ["F", p2p(("send", "a", i), ("recv", "g", j)), "B"]
        ops.append(p2p(("send", "g", j)) if j == m - warm - 1 else p2p(("send", "g", j), ("recv", "a", i + 1)))
    for j in range(m - warm, m):
        ops += [p2p(("recv", "g", j)), "B", p2p(("send", "g", j))]
    return [op for op in ops if op != ()]


def interleaved(pp: int, virtual: int, m: int, f: float, b: float, fwd: Sequence[float] = (),
                bwd: Sequence[float] = (), link_per_micro_batch: float = 0.0) -> float:
    """Seconds of the interleaved schedule with overlapped sends (module doc): ``f`` / ``b`` are a
    stage's whole forward / backward per micro-batch (all its chunks), ``link_per_micro_batch`` the
    busiest link's time for one micro-batch's sends."""
    if virtual < 1:
        raise ValueError("virtual stages must be >= 1")
    t = f + b
    fill = sum(fwd) + sum(bwd)
    return m * max(t, link_per_micro_batch) + (pp - 1) * t / virtual + fill


def schedule_time(pp: int, virtual: int, m: int, f: float, b: float, sends: Sends | None = None) -> PipelineTime:
    """Both schedules behind one call: 1F1B when ``virtual`` is 1, else interleaved."""
    if pp < 2:
        return PipelineTime(m * (f + b), 0.0, 0.0)
    fwd = [p.seconds for p in sends.fwd] if sends else []
    bwd = [p.seconds for p in sends.bwd] if sends else []
    link = sends.per_micro_batch.seconds if sends else 0.0
    if virtual == 1:
        free = (m + pp - 1) * (f + b)  # what one_f_one_b gives with free sends (tests check it)
        # blocking sends of different boundaries may share an uplink: never faster than its bytes
        total = max(one_f_one_b(pp, m, f, b, fwd, bwd), m * link) if sends else free
    else:
        free = interleaved(pp, virtual, m, f, b)
        total = interleaved(pp, virtual, m, f, b, fwd, bwd, link) if sends else free
    return PipelineTime(total, free - m * (f + b), total - free)


def bubble_fraction(pp: int, m: int, virtual: int = 1) -> float:
    """Idle time over useful time with free sends: (P - 1) / (v M)."""
    return (pp - 1) / (virtual * m) if pp > 1 else 0.0


__all__ = ["PipelineTime", "Sends", "boundary_sends", "bubble_fraction", "interleaved", "one_f_one_b",
           "one_f_one_b_shared", "schedule_time", "stage_program"]
