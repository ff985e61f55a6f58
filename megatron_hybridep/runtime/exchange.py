"""The lifecycle both expert exchanges share: runtime/migration.py DomainGather (a domain's borrowed
experts, all-gathered) and runtime/replication.py ReplicaExchange (hot replicas' weights, sent to
the ranks that compute them).

1. ``start()``: launch the weights' collective after the optimizer step (or in the forward pass);
2. the forward pass waits for it and uses the copy; with ``hold`` the copy is kept for the
   iteration (``_holds_current``: the version of the owners' parameters it carries is current);
3. the backward pass owes the owners the copy's gradient (``owed``): accumulated while Megatron
   runs micro-batches under no_sync, then returned blocking or launched (``_launch_return``) and
   collected by ``flush_owed`` before Megatron reduces gradients;
4. ``drop()``: a plan switch or a stale prefetch forgets what is in flight and held.
Subclasses implement the abstract ``start``, ``_launch_return``, ``drop`` and ``current_step``."""

from __future__ import annotations

import itertools
import re
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from typing import Any

import torch

from megatron_hybridep.runtime.borrowed import FusedWgrad, Launch, OwedGradient, add_to_grads, version_key


def expert_major(named: Sequence[tuple[str, torch.nn.Parameter]], num_local: int
                 ) -> list[tuple[str, torch.nn.Parameter]]:
    """Parameters ordered expert by expert, so the flat buffer is [L, n] (a row per expert): the
    codec compresses each expert on its own. Works for SequentialMLP (local_experts.<i>.*) and
    grouped-GEMM experts (weight<i>/bias<i>)."""
    if num_local == 1:
        return list(named)
    keyed = []
    for pos, (name, p) in enumerate(named):
        m = re.search(r"local_experts\.(\d+)\.", name) or re.search(r"(?:weight|bias)(\d+)$", name)
        if m is None:
            raise ValueError(f"cannot tell which local expert parameter {name!r} belongs to; compression needs "
                             "SequentialMLP or grouped-GEMM experts")
        keyed.append((int(m.group(1)), pos, name, p))
    keyed.sort()
    return [(name, p) for _, _, name, p in keyed]


class ExpertExchange(ABC):
    """One MoE layer's experts moved to other ranks under one plan (module doc).

    Args:
        params: the layer's local expert parameters (name, parameter); reordered expert by expert.
        num_local: experts this rank owns in the layer.
        layer: the MoE layer's number, for Stats.
        stats: where the collectives' times and bytes are recorded (None: not recorded).
        levels: the link level towards each peer (per group position), for per-level byte counts.
        hold: keep the copies for the iteration (gather once, return the accumulated gradient once).
        defer: while true, the copy's gradient accumulates instead of returning (Megatron's no_sync).
        asynchronous: while true, a return is launched, not waited for (--hybridep-async-grad-return).
        fuse_wgrad: the copies get a main_grad (--gradient-accumulation-fusion).
    """

    def __init__(self, params: Sequence[tuple[str, torch.nn.Parameter]], num_local: int, *, layer: int,
                 stats: Any, levels: tuple[str, ...], hold: bool, defer: Callable[[], bool] | None,
                 asynchronous: Callable[[], bool] | None, fuse_wgrad: bool) -> None:
        ordered = expert_major(params, num_local)
        self.names = [n for n, _ in ordered]
        self.params = [p for _, p in ordered]
        self.num_local, self.layer, self.stats, self.levels, self.hold = num_local, layer, stats, levels, hold
        sizes = [p.numel() for p in self.params]
        self.numel = sum(sizes)
        # where each parameter sits in this rank's flat buffer: (offset, shape), expert by expert
        self.spans = tuple(zip(itertools.accumulate([0, *sizes[:-1]]), (p.shape for p in self.params), strict=True))
        self.row = self.numel // num_local  # elements per expert
        self._pending: Any = None  # the collective in flight, if any
        # the copy of this optimizer step (hold) and the version of the owners' parameters it carries
        self._copy: torch.Tensor | None = None
        self._copy_key: tuple[int, ...] | None = None
        self.owed = OwedGradient(defer if defer is not None and hold else (lambda: False), self._return_grads,
                                 self._launch_return, asynchronous if hold else None,
                                 early=self._early_launchers() if hold else None, split_at=self._split_at)
        self.wgrad = FusedWgrad(fuse_wgrad)

    @abstractmethod
    def current_step(self) -> int:
        """The runtime's optimizer-step count (part of the parameters' version)."""

    @abstractmethod
    def start(self) -> None:
        """Launch the weights' collective (a no-op when one for the current version is in flight or held)."""

    @abstractmethod
    def drop(self) -> None:
        """Forget what is in flight and held (plan switch, stale prefetch)."""

    @abstractmethod
    def _launch_return(self, grad: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Start returning ``grad`` (the copies' gradient, flat) to the owners; the function returned
        waits and gives this rank's own experts' share, flat."""

    def _early_launchers(self) -> tuple[Launch, Launch] | None:
        """(launch the first M-1 micro-batches' gradient, launch the rest) for an early return; None: off."""
        return None

    def _split_at(self) -> int | None:
        """The deferred backward (M-1) at which the early return launches; None: one return."""
        return None

    def version(self) -> tuple[int, ...]:
        return version_key(self.params, self.current_step())

    def _holds_current(self) -> bool:
        return self.hold and self._copy is not None and self._copy_key == self.version()

    @abstractmethod
    def _forget_stale(self) -> None:
        """Wait for the collective in flight and forget it (it carries an older version)."""

    def _version_to_launch(self) -> tuple[int, ...] | None:
        """The parameters' version when ``start`` must launch a collective for it; None when one for
        it is in flight or its copies are held. A collective of an older version (a prefetch that
        outlived a step) is forgotten first, never used."""
        key = self.version()
        if self._pending is not None:
            if self._pending.key == key:
                return None
            self._forget_stale()
        return None if self._holds_current() else key

    def _flat(self, detach: bool) -> torch.Tensor:
        return torch.cat([(p.detach() if detach else p).reshape(-1) for p in self.params])

    def _return_grads(self, grad: torch.Tensor) -> torch.Tensor:
        return self._launch_return(grad)()

    def flush_owed(self) -> None:
        """Return a gradient still owed (a collective over the group) into the owners' main grads."""
        flat = self.owed.flush()
        if flat is not None:
            add_to_grads(flat, self.params)
