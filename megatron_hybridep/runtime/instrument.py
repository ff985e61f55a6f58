"""Per-step measurements of HybridEP's (and plain EP's) communication: bytes and time of each
collective per layer and group kind, and tokens per expert. Cheap enough to leave on: a few dict
updates per layer; read by the planner/scheduler, the benchmarks and the training log."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np


@dataclass
class Record:
    bytes: int = 0
    seconds: float = 0.0
    calls: int = 0
    wall: float = 0.0  # issue-to-use time for asynchronous collectives (overlap = wall - seconds)


@dataclass
class Stats:
    """Accumulates until ``reset()``; keys are (layer, phase, group kind, link level), the level
    being the coarsest topology level the bytes cross ('dc' = inter-DC links)."""

    records: dict[tuple[int, str, str, str], Record] = field(default_factory=lambda: defaultdict(Record))
    # per layer: tokens routed to each expert, summed where they were counted (a GPU tensor stays
    # on the GPU: copying it per layer call would stall the launch queue); read tokens_per_expert
    routing: dict[int, Any] = field(default_factory=dict)
    borrowed_bytes: dict[int, int] = field(default_factory=dict)  # per layer: peers' expert copies held

    def add_borrowed(self, layer: int, nbytes: int) -> None:
        self.borrowed_bytes[layer] = max(self.borrowed_bytes.get(layer, 0), int(nbytes))

    def add(self, layer: int, phase: str, group: str, nbytes: int, seconds: float, wall: float = 0.0,
            level: str = "all") -> None:
        r = self.records[(layer, phase, group, level)]
        r.bytes += int(nbytes)
        r.seconds += seconds
        r.wall += wall
        r.calls += 1

    @contextmanager
    def timed(self, phase: str, group: str = "dp", *, nbytes: int = 0, layer: int = -1,
              level: str | None = None) -> Iterator[None]:
        """Time a blocking step of the training loop as one collective record, e.g. Megatron's
        finalize_model_grads as ``stats.timed("dense_grad_allreduce")``: the scheduler subtracts
        every timed record from the wall time to measure compute, and the cost model prices the
        phase from bandwidth. ``level``: the coarsest link level its ``nbytes`` cross (a bytes-only
        record, as the collectives write them); layer -1: not a layer's."""
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self.add(layer, phase, group, 0 if level else nbytes, time.perf_counter() - t0)
            if level:
                self.add(layer, phase, group, nbytes, 0.0, level=level)

    def add_routing(self, layer: int, counts: Any) -> None:  # noqa: ANN401 - ndarray or tensor, any device
        prev = self.routing.get(layer)
        self.routing[layer] = counts if prev is None else prev + counts

    @property
    def tokens_per_expert(self) -> dict[int, np.ndarray]:
        """Per layer: tokens routed to each expert since the last reset, on the host (one copy per
        layer when read: the scheduler reads once per decision interval)."""
        return {k: np.asarray(v.cpu() if hasattr(v, "cpu") else v) for k, v in self.routing.items()}

    def _select(self, phase: str | None, group: str | None, level: str | None) -> list[Record]:
        return [r for (_, p, g, lv), r in self.records.items()
                if (phase is None or p == phase) and (group is None or g == group) and (level is None or lv == level)]

    def bytes_by(self, *, phase: str | None = None, group: str | None = None, level: str | None = None) -> int:
        return sum(r.bytes for r in self._select(phase, group, level))

    def seconds_by(self, *, phase: str | None = None, group: str | None = None, level: str | None = None) -> float:
        """Seconds per phase. Per-level records carry bytes only (time is counted once, at 'all')."""
        return sum(r.seconds for r in self._select(phase, group, level))

    def summary(self) -> dict[str, float]:
        """Flat figures for logs: bytes and seconds per phase."""
        out: dict[str, float] = {}
        for (_, phase, _, _), r in self.records.items():
            out[f"{phase}_bytes"] = out.get(f"{phase}_bytes", 0) + r.bytes
            out[f"{phase}_s"] = out.get(f"{phase}_s", 0.0) + r.seconds
        return out

    def reset(self) -> None:
        self.records.clear()
        self.routing.clear()
