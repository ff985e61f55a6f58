"""Self-check: measure namespace-to-namespace TCP throughput with plain Python sockets.

The receiving socket lives in the destination DC's namespace, the sending one in the source
DC's (created by a thread that joined the namespace), and the sender connects to the
destination DC's address: the same path two ranks take. Bounded in bytes and time.
Across DCs the TCP goodput should be within `tolerance` of min(uplink rates); it sits ~4.4%
under the configured rate (TCP_GOODPUT_FRACTION) because tc counts the Ethernet/IP/TCP headers.
Inside a DC it should be far (`intra_factor` x) above the fastest uplink.

Two-way: gloo sends both directions of a pair over one TCP connection at once (an all-to-all's
exchange, a ring's neighbours), so the check also runs dc0 <-> dc1 as one connection carrying bulk
data both ways and reports each direction's goodput (ACKs then queue behind data in the shaped
uplinks). Measured here (80 Mbit/s, 1 ms bucket, 0.5 s windows): one direction keeps ~76 Mbit/s,
the other gets 55-70 (~0.6 s to converge; 2 s windows: 83-93% each). A full-duplex wire would
give both their rate; TCP sharing two HTB queues with its own ACKs does not, so this is judged
only against `two_way_tolerance` (default: at least half the rate) and otherwise reported; the
bench measures what gloo's collectives get (its all-to-all probe).
"""

from __future__ import annotations

import socket
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from megatron_hybridep.testbed import netns
from megatron_hybridep.testbed.sh import TestbedError

if TYPE_CHECKING:
    from megatron_hybridep.testbed.interface import EmulatedDCs

# TCP payload per wire byte that tc's rate counts, MTU 1500: 1448 B payload (TCP timestamps on)
# in 1514 B frames (Ethernet 14 + IP 20 + TCP 32 header bytes). A cost model that predicts
# transfer times on the testbed should use rate x this, not the configured rate.
TCP_GOODPUT_FRACTION = 1448 / 1514
CHUNK = 256 * 1024
WARMUP_FRACTION = 0.2  # of the window: skip the token bucket's initial credit and slow start
UNBOUNDED_BYTES = 4 << 30  # intra-DC / unshaped: the time limit ends it first


@dataclass
class LinkThroughput:
    src_dc: int
    dst_dc: int
    mbit: float  # measured TCP goodput
    nbytes: int  # received in total
    seconds: float  # receive window the rate was computed over
    expected_mbit: float | None  # min of the uplinks; None inside a DC or unshaped
    two_way: bool = False  # measured while the same connection carried bulk data the other way
    ok: bool = True
    verdict: str = ""

    @property
    def intra(self) -> bool:
        return self.src_dc == self.dst_dc

    @property
    def ratio(self) -> float | None:
        return self.mbit / self.expected_mbit if self.expected_mbit else None


@dataclass
class SelfCheckReport:
    testbed: str
    tolerance: float
    intra_factor: float
    measurements: list[LinkThroughput] = field(default_factory=list)

    two_way_tolerance: float = 0.5

    @property
    def ok(self) -> bool:
        return all(m.ok for m in self.measurements)

    def two_way_ratio(self) -> float | None:
        """Mean two-way goodput / one-way goodput of the same paths (None if not measured)."""
        one = {(m.src_dc, m.dst_dc): m.mbit for m in self.measurements if not m.two_way and not m.intra}
        pairs = [(m.mbit, one[(m.src_dc, m.dst_dc)]) for m in self.measurements
                 if m.two_way and (m.src_dc, m.dst_dc) in one]
        return sum(a / b for a, b in pairs) / len(pairs) if pairs else None

    def format(self) -> str:
        lines = [self.testbed, f"  {'path':<20} {'configured':>11} {'measured':>10} {'ratio':>7}  verdict"]
        for m in self.measurements:
            path = f"dc{m.src_dc} -> dc{m.dst_dc}" + (" (2-way)" if m.two_way else "")
            conf = "unshaped" if m.expected_mbit is None else f"{m.expected_mbit:.1f}"
            ratio = "" if m.ratio is None else f"{m.ratio:.3f}"
            lines.append(f"  {path:<20} {conf:>11} {m.mbit:>10.1f} {ratio:>7}  {m.verdict}")
        lines.append(f"  (Mbit/s TCP goodput over {self.measurements[0].seconds:.2f} s windows)"
                     if self.measurements else "  (nothing measured)")
        if (r := self.two_way_ratio()) is not None:
            lines.append(f"  two-way on one connection: each direction gets {r:.0%} of its one-way goodput")
        lines.append(f"self-check: {'PASS' if self.ok else 'FAIL'}")
        return "\n".join(lines)


def measure_throughput(
    tb: EmulatedDCs,
    src_dc: int,
    dst_dc: int,
    *,
    seconds: float = 1.0,
    max_bytes: int | None = None,
) -> LinkThroughput:
    """Send from a socket in src_dc's namespace to one in dst_dc's for ~`seconds`
    (or `max_bytes`), and return the receiver's steady-state goodput."""
    expected = tb.expected_mbit(src_dc, dst_dc)
    if max_bytes is None:
        # twice what the configured rate could carry: the time limit ends it, not the bytes
        max_bytes = int(expected * 1e6 / 8 * seconds * 2) if expected else UNBOUNDED_BYTES
    dst_addr = tb.address(dst_dc)
    hard_timeout = seconds + 10.0

    server = netns.socket_in_netns(tb.netns(dst_dc))
    client = netns.socket_in_netns(tb.netns(src_dc))
    samples: list[tuple[float, int]] = []
    errors: list[BaseException] = []
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((dst_addr, 0))
        server.listen(1)
        server.settimeout(hard_timeout)
        port = server.getsockname()[1]

        def receive() -> None:
            try:
                conn, _ = server.accept()
                with conn:
                    conn.settimeout(hard_timeout)
                    buf = bytearray(1 << 20)
                    total = 0
                    while (n := conn.recv_into(buf)) > 0:
                        total += n
                        samples.append((time.monotonic(), total))
            except BaseException as exc:  # reported by the caller
                errors.append(exc)

        receiver = threading.Thread(target=receive, name="selfcheck-recv", daemon=True)
        receiver.start()
        client.settimeout(hard_timeout)
        client.connect((dst_addr, port))
        payload = memoryview(bytes(CHUNK))
        sent, stop = 0, time.monotonic() + seconds
        while sent < max_bytes and time.monotonic() < stop:
            client.sendall(payload)
            sent += CHUNK
        client.shutdown(socket.SHUT_WR)  # EOF: the receiver drains the queues and ends
        receiver.join(hard_timeout)
        if receiver.is_alive():
            raise TestbedError(f"self-check dc{src_dc} -> dc{dst_dc}: receiver did not finish")
    finally:
        client.close()
        server.close()
    if errors:
        raise TestbedError(f"self-check dc{src_dc} -> dc{dst_dc} failed: {errors[0]}") from errors[0]
    if len(samples) < 2:
        raise TestbedError(f"self-check dc{src_dc} -> dc{dst_dc}: too little data received")

    mbit, window = _steady_mbit(samples)
    return LinkThroughput(src_dc, dst_dc, mbit, samples[-1][1], window, expected)


def _steady_mbit(samples: list[tuple[float, int]], until: float | None = None) -> tuple[float, float]:
    """Goodput (Mbit/s) over the receive samples after the warm-up fraction (and before `until`)."""
    if until is not None:
        samples = [s for s in samples if s[0] <= until] or samples[:2]
    t_first, t_last = samples[0][0], samples[-1][0]
    t_window = t_first + WARMUP_FRACTION * (t_last - t_first)
    start = next(s for s in samples if s[0] >= t_window)
    window = max(t_last - start[0], 1e-9)
    return (samples[-1][1] - start[1]) * 8 / window / 1e6, window


def measure_two_way(tb: EmulatedDCs, a_dc: int, b_dc: int, *,
                    seconds: float = 1.0) -> tuple[LinkThroughput, LinkThroughput]:
    """One TCP connection between a_dc and b_dc carrying bulk data both ways at once for ~`seconds`:
    the goodput of each direction over the time both were sending (a -> b, b -> a)."""
    if a_dc == b_dc:
        raise TestbedError("two-way check: needs two different DCs")
    hard_timeout = seconds + 10.0
    server = netns.socket_in_netns(tb.netns(b_dc))
    client = netns.socket_in_netns(tb.netns(a_dc))
    samples: dict[str, list[tuple[float, int]]] = {"ab": [], "ba": []}
    errors: list[BaseException] = []
    stop = 0.0
    conn: socket.socket | None = None
    try:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((tb.address(b_dc), 0))
        server.listen(1)
        server.settimeout(hard_timeout)
        client.settimeout(hard_timeout)
        client.connect((tb.address(b_dc), server.getsockname()[1]))
        conn, _ = server.accept()
        conn.settimeout(hard_timeout)
        stop = time.monotonic() + seconds

        def send(sock: socket.socket) -> None:
            try:
                payload = memoryview(bytes(CHUNK))
                while time.monotonic() < stop:
                    sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
            except BaseException as exc:  # reported by the caller
                errors.append(exc)

        def receive(sock: socket.socket, key: str) -> None:
            try:
                buf, total = bytearray(1 << 20), 0
                while (n := sock.recv_into(buf)) > 0:
                    total += n
                    samples[key].append((time.monotonic(), total))
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=send, args=(client,), daemon=True),
                   threading.Thread(target=send, args=(conn,), daemon=True),
                   threading.Thread(target=receive, args=(conn, "ab"), daemon=True),
                   threading.Thread(target=receive, args=(client, "ba"), daemon=True)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(hard_timeout)
        if any(t.is_alive() for t in threads):
            raise TestbedError(f"two-way check dc{a_dc} <-> dc{b_dc}: did not finish")
    finally:
        client.close()
        if conn is not None:
            conn.close()
        server.close()
    if errors:
        raise TestbedError(f"two-way check dc{a_dc} <-> dc{b_dc} failed: {errors[0]}") from errors[0]
    out = []
    for key, (src, dst) in (("ab", (a_dc, b_dc)), ("ba", (b_dc, a_dc))):
        if len(samples[key]) < 2:
            raise TestbedError(f"two-way check dc{src} -> dc{dst}: too little data received")
        mbit, window = _steady_mbit(samples[key], until=stop)  # only while both directions were sending
        out.append(LinkThroughput(src, dst, mbit, samples[key][-1][1], window, tb.expected_mbit(src, dst),
                                  two_way=True))
    return out[0], out[1]


def selfcheck(
    tb: EmulatedDCs,
    *,
    seconds: float = 1.0,
    tolerance: float = 0.10,
    intra_factor: float = 5.0,
    two_way_tolerance: float = 0.5,
) -> SelfCheckReport:
    """Check every uplink in both directions (dc i -> dc i+1, cyclic), DC 0 internally, and
    dc0 <-> dc1 two-way on one connection.

    Cross-DC: |measured / min(uplinks) - 1| <= tolerance (two-way: the two directions' mean within
    two_way_tolerance). Intra-DC:
    measured >= intra_factor x the fastest configured uplink. Unshaped paths are reported, not judged.
    """
    report = SelfCheckReport(tb.describe(), tolerance, intra_factor, two_way_tolerance=two_way_tolerance)
    pairs = [(dc, (dc + 1) % tb.dcs) for dc in range(tb.dcs)] if tb.dcs > 1 else []
    pairs.append((0, 0))
    shaped = [r for r in tb.rates() if r is not None]
    found = [measure_throughput(tb, src, dst, seconds=seconds) for src, dst in pairs]
    if tb.dcs > 1:
        found += measure_two_way(tb, 0, 1, seconds=seconds)
    # One TCP connection carrying both directions shares its rate unevenly from one window to the
    # next (ACKs queue behind the other direction's data): the pair is judged on its mean.
    pair = [m.ratio for m in found if m.two_way and m.ratio is not None]
    pair_ratio = sum(pair) / len(pair) if pair else None
    for m in found:
        tol = two_way_tolerance if m.two_way else tolerance
        if m.two_way and pair_ratio is not None:
            m.ok = abs(pair_ratio - 1) <= tol
            m.verdict = (f"ok: pair mean {pair_ratio:.2f} within {tol:.0%}" if m.ok
                         else f"FAIL: pair mean off by {abs(pair_ratio - 1):.1%} (> {tol:.0%})")
        elif m.intra and m.expected_mbit is None:
            if shaped:
                need = intra_factor * max(shaped)
                m.ok = m.mbit >= need
                verdict = "ok" if m.ok else "FAIL"
                m.verdict = f"{verdict}: intra-DC, need >= {need:.0f} ({intra_factor:g}x uplink)"
            else:
                m.verdict = "intra-DC (nothing shaped)"
        elif m.expected_mbit is None:
            m.verdict = "unshaped (not judged)"
        else:
            assert m.ratio is not None
            m.ok = abs(m.ratio - 1) <= tol
            m.verdict = f"ok: within {tol:.0%}" if m.ok else f"FAIL: off by {abs(m.ratio - 1):.1%} (> {tol:.0%})"
        report.measurements.append(m)
    return report
