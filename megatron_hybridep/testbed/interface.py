"""What the launcher and the self-check need from a testbed: network.Testbed provides it, and
they depend on this alone, so the network imports them and not the other way round."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class RankInfo:
    """Where one rank runs and what it is told."""

    rank: int
    dc: int
    local_rank: int
    world_size: int
    ranks_per_dc: int
    netns: str
    address: str  # the DC's address (shared by the DC's ranks)
    interface: str  # the DC's uplink interface (GLOO_SOCKET_IFNAME)


class EmulatedDCs(Protocol):
    """What the launcher and the self-check need of an emulated multi-DC network (the Testbed)."""

    @property
    def dcs(self) -> int: ...

    @property
    def interface(self) -> str: ...

    def netns(self, dc: int) -> str: ...

    def address(self, dc: int) -> str: ...

    def ranks(self, ranks_per_dc: int | None = None) -> list[RankInfo]: ...

    def rates(self) -> list[float | None]: ...

    def expected_mbit(self, src_dc: int, dst_dc: int) -> float | None: ...

    def describe(self) -> str: ...
