"""Event-driven execution of a program: one compute stream plus collectives that share links.

The program is what one rank's main thread does (every rank of a simulated group does the same,
phase-synchronously): COMPUTE for a while, START a collective asynchronously, WAIT for it, or BLOCK
on one (START + WAIT). Between events, every in-flight collective's flow classes progress at their
max-min fair rates (maxmin.py); an event is a compute end or a flow class draining its last byte.
A flow is done ``tail`` seconds after it drains (latency of its rounds); a collective is done when
all its flows are.

Memo: the state before an instruction is (instruction, in-flight collectives with the bytes left
and time to completion of each class). Layers and micro-batches repeat the same states, so each
distinct segment is simulated once; a 58-layer x 8-micro-batch iteration runs a few dozen.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from megatron_hybridep.sim.flows import FlowSet
from megatron_hybridep.sim.maxmin import max_min_rates

COMPUTE, START, WAIT, BLOCK = "compute", "start", "wait", "block"
EPS = 1e-12


@dataclass(frozen=True)
class Instr:
    kind: str
    phase: str                  # reporting category (cost.PHASES names)
    seconds: float = 0.0        # COMPUTE
    op: str = ""                # START / BLOCK: collective name; WAIT: instance key
    key: str = ""               # START: instance key (so a later WAIT can name it)
    layer: int = -1
    micro_batch: int = -1
    stage: str = ""             # fwd / bwd / step (optimizer-side work)


@dataclass(frozen=True)
class Span:
    """One instruction on the main thread (``kind`` compute / wait / block) or one collective
    (``kind`` 'async') from issue to completion."""

    kind: str
    phase: str
    name: str
    start: float
    end: float
    layer: int
    micro_batch: int
    stage: str = ""

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclass
class _Run:
    op: int
    name: str
    key: str
    issued: float
    rem: np.ndarray
    fin: np.ndarray            # absolute completion time per class (nan while bytes are left)
    layer: int = -1
    micro_batch: int = -1
    stage: str = ""

    def drained(self) -> bool:
        return not bool(np.any(self.rem > 0))

    def done_time(self) -> float:
        return float(self.fin.max()) if len(self.fin) else self.issued


@dataclass
class EngineStats:
    instructions: int = 0
    segments: int = 0           # instructions simulated with the event loop
    memo_hits: int = 0
    events: int = 0
    fills: int = 0


@dataclass
class Trace:
    total: float
    spans: list[Span]
    stats: EngineStats
    exposed: dict[str, float] = field(default_factory=dict)


class Engine:
    def __init__(self, flowsets: Sequence[FlowSet], link_cap: np.ndarray, memo: bool = True) -> None:
        self.use_memo = memo
        self.ops = list(flowsets)
        self.index = {fs.name: i for i, fs in enumerate(self.ops)}
        self.cap = link_cap
        self._union: dict[tuple[int, ...], tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        self._memo: dict[tuple, tuple] = {}
        self.stats = EngineStats()
        self.t = 0.0
        self.inflight: list[_Run] = []

    # ---- rates over the in-flight collectives --------------------------------------------------------
    def _incidence(self, ops: tuple[int, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        if ops not in self._union:
            offs = np.cumsum([0] + [self.ops[i].size for i in ops])
            self._union[ops] = (
                np.concatenate([self.ops[i].inc_flow + o for i, o in zip(ops, offs, strict=False)]),
                np.concatenate([self.ops[i].inc_link for i in ops]),
                np.concatenate([self.ops[i].inc_count for i in ops]),
                offs)
        return self._union[ops]

    def _rates(self, runs: list[_Run]) -> list[np.ndarray]:
        ops = tuple(r.op for r in runs)
        fl, lk, cnt, offs = self._incidence(ops)
        alive = np.concatenate([r.rem > 0 for r in runs])
        rate = max_min_rates(alive, fl, lk, cnt, self.cap)
        self.stats.fills += 1
        return [rate[offs[i]:offs[i + 1]] for i in range(len(runs))]

    # ---- time advance --------------------------------------------------------------------------------
    def _advance(self, until: float | None, wait: _Run | None) -> None:
        """Move time forward to ``until``, or until ``wait`` is done, progressing all in-flight flows."""
        while True:
            if wait is not None and wait.drained():
                until, wait = wait.done_time(), None
            live = [r for r in self.inflight if not r.drained()]
            if not live:
                if until is not None:
                    self.t = max(self.t, until)
                return
            rates = self._rates(live)
            ttd = [r.rem / np.where(rt > 0, rt, np.inf) for r, rt in zip(live, rates, strict=True)]
            dt = min(float(np.min(x[r.rem > 0])) for r, x in zip(live, ttd, strict=True))
            stop = until is not None and until - self.t <= dt * (1 + 1e-12)
            step = max(until - self.t, 0.0) if stop else dt
            t_new = self.t + step
            for r, rt, x in zip(live, rates, ttd, strict=True):
                on = r.rem > 0
                r.rem[on] -= rt[on] * step
                if stop:  # classes within rounding of their last byte drain here too
                    done = on & (r.rem <= EPS * self.ops[r.op].nbytes)
                else:     # the class(es) that set dt, and any within rounding of it
                    done = on & (x <= dt * (1 + 1e-9))
                r.rem[done] = 0.0
                r.fin[done] = t_new + self.ops[r.op].tail[done]
            self.stats.events += 1
            self.t = t_new
            if stop:
                return

    # ---- memo ---------------------------------------------------------------------------------------
    def _state_key(self) -> tuple:
        parts = []
        for r in self.inflight:
            rel = (r.fin - self.t).astype(np.float32)
            parts.append((r.op, r.rem.astype(np.float32).tobytes(), rel.tobytes()))
        return tuple(parts)

    def _snapshot(self, t0: float) -> list[tuple[np.ndarray, np.ndarray]]:
        return [(r.rem.copy(), r.fin - t0) for r in self.inflight]

    # ---- the program ----------------------------------------------------------------------------------
    def run(self, program: Sequence[Instr]) -> Trace:
        self.t = 0.0
        self.inflight: list[_Run] = []
        self.stats = EngineStats()
        spans: list[Span] = []
        exposed: dict[str, float] = {}
        byname: dict[str, _Run] = {}
        for ins in program:
            self.stats.instructions += 1
            t0 = self.t
            if ins.kind == START:
                run = self._start(ins.op, ins.key or ins.op, ins)
                byname[run.key] = run
                continue
            if ins.kind == COMPUTE and not self.inflight:
                self.t += ins.seconds
            else:
                run = None
                if ins.kind == BLOCK:
                    run = self._start(ins.op, ins.op, ins)
                elif ins.kind == WAIT:
                    run = byname.pop(ins.op)
                self._execute(ins, run)
                if run is not None:
                    self.inflight.remove(run)
                    if ins.kind == WAIT:
                        spans.append(Span("async", ins.phase, run.name, run.issued, run.done_time(), run.layer,
                                          run.micro_batch, run.stage))
            spans.append(Span(ins.kind, ins.phase, ins.op or ins.phase, t0, self.t, ins.layer, ins.micro_batch,
                              ins.stage))
            exposed[ins.phase] = exposed.get(ins.phase, 0.0) + (self.t - t0)
        if self.inflight:  # collectives nobody waited for still end the iteration
            t0 = self.t
            for run in list(self.inflight):
                self._advance(None, run)
            self.t = max([self.t] + [r.done_time() for r in self.inflight])
            exposed["unwaited"] = exposed.get("unwaited", 0.0) + self.t - t0
            for r in self.inflight:
                spans.append(Span("async", "unwaited", r.name, r.issued, r.done_time(), r.layer, r.micro_batch,
                                  r.stage))
            self.inflight = []
        return Trace(self.t, spans, self.stats, exposed)

    def _start(self, name: str, key: str, ins: Instr) -> _Run:
        if name not in self.index:
            raise KeyError(f"program names collective {name!r}, which is not built")
        i = self.index[name]
        fs = self.ops[i]
        run = _Run(i, name, key, self.t, fs.nbytes.copy(), np.full(fs.size, np.nan), ins.layer, ins.micro_batch,
                   ins.stage)
        zero = run.rem <= 0
        run.fin[zero] = self.t + fs.tail[zero]
        self.inflight.append(run)
        return run

    def _execute(self, ins: Instr, run: _Run | None) -> None:
        """COMPUTE with collectives in flight, WAIT or BLOCK: memoised on the in-flight state."""
        pos = self.inflight.index(run) if run is not None else -1
        key = (ins.kind, np.float32(ins.seconds).tobytes(), pos, self._state_key())
        hit = self._memo.get(key) if self.use_memo else None
        t0 = self.t
        if hit is not None:
            self.stats.memo_hits += 1
            dt, states = hit
            for r, (rem, fin_rel) in zip(self.inflight, states, strict=True):
                r.rem = rem.copy()
                r.fin = fin_rel + t0
            self.t = t0 + dt
            return
        self.stats.segments += 1
        if ins.kind == COMPUTE:
            self._advance(t0 + ins.seconds, None)
        else:
            assert run is not None
            self._advance(None, run)
            self.t = max(self.t, run.done_time())
        self._memo[key] = (self.t - t0, self._snapshot(t0))
