"""tc shaping of one end of a DC uplink: HTB for the rate, netem (child of HTB) for delay/jitter.

Layout on a shaped device:  root 1: htb default 1  ->  class 1:1 (rate = ceil)  [-> 10: netem | bfifo]
A single HTB class (not TBF) lets `set_rate` change the rate with `tc class change` while traffic
flows, without resetting the queue. The HTB bucket (burst) defaults to >= 70 KB (one 64 KiB GSO
super-packet); ``burst_ms`` sets it to that many ms at the rate instead (>= 2 frames), like a real
link that banks no idle time: with the default bucket a collective after an idle gap (compute)
passes its first 70 KB at veth speed, so small collectives run almost unshaped. With ``burst_ms``
the device also stops building GSO super-packets (gso_max_segs 1): HTB lets one packet through
whenever its bucket is positive, so a 64 KB GSO packet would pass a 6 KB bucket whole (measured:
a 64 KB send after idle took 5.9 ms instead of 11 ms at 50 Mbit/s; with this, 10.0 ms). The uplink
is shaped on both ends of its veth pair (egress of the DC side and egress of the switch-side port),
so both directions are limited.

The queue in front of the rate limit is the kernel's 1000 packets (1.2 s at 10 Mbit/s) unless
``queue_ms`` sizes it as time at the rate, a shallow-buffer link: a bfifo leaf, in bytes because GSO
packets are up to 64 KB (netem's limit, in frames, when there is a delay). docs/testbed.md ("Queue and
TCP") has what each does to gloo's collectives.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass

from megatron_hybridep.testbed.sh import TestbedError, sh

_RATE_UNITS_BIT = {"": 1e6, "bit": 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9, "tbit": 1e12}
# tc's "bps" units mean bytes per second
_RATE_UNITS_BYTE = {"bps": 8.0, "kbps": 8e3, "mbps": 8e6, "gbps": 8e9}
_TIME_UNITS = {"": 1.0, "ms": 1.0, "msec": 1.0, "s": 1e3, "sec": 1e3, "us": 1e-3, "usec": 1e-3}
_NUM = r"(\d+(?:\.\d*)?|\.\d+)"
MAX_FRAME = 1514  # bytes of a full Ethernet frame at MTU 1500
GSO_MAX_SEGS_DEFAULT = 65535  # the kernel's default segments per GSO packet
MIN_QUEUE_FRAMES = 8  # at very low rates: room for a few flows' bursts
GSO_MAX_BYTES = 65_536  # one GSO super-packet (the default bucket keeps GSO on)


def parse_rate_mbit(text: str | float | int | None) -> float | None:
    """'100mbit' -> 100.0; '1gbit' -> 1000.0; '12.5mbps' (bytes) -> 100.0; bare number = Mbit/s.

    'none', 'off', 'unlimited', '' and None mean unshaped (returns None).
    """
    if text is None:
        return None
    if isinstance(text, int | float):
        value = float(text)
    else:
        s = text.strip().lower()
        if s in ("", "none", "off", "unlimited", "0"):
            return None
        m = re.fullmatch(_NUM + r"\s*([a-z]*)", s)
        if not m:
            raise TestbedError(f"cannot parse rate {text!r}: use e.g. 100mbit, 1gbit, 500kbit")
        num, unit = float(m.group(1)), m.group(2)
        if unit in _RATE_UNITS_BIT:
            value = num * _RATE_UNITS_BIT[unit] / 1e6
        elif unit in _RATE_UNITS_BYTE:
            value = num * _RATE_UNITS_BYTE[unit] / 1e6
        else:
            raise TestbedError(f"unknown rate unit {unit!r} in {text!r}: use bit, kbit, mbit, gbit")
    if value <= 0:
        raise TestbedError(f"rate must be positive, got {text!r}")
    return value


def parse_time_ms(text: str | float | int | None) -> float:
    """'5ms' -> 5.0; '1s' -> 1000.0; '200us' -> 0.2; bare number = ms; None/'' -> 0."""
    if text is None:
        return 0.0
    if isinstance(text, int | float):
        value = float(text)
    else:
        s = text.strip().lower()
        if not s:
            return 0.0
        m = re.fullmatch(_NUM + r"\s*([a-z]*)", s)
        if not m or m.group(2) not in _TIME_UNITS:
            raise TestbedError(f"cannot parse time {text!r}: use e.g. 5ms, 0.5ms, 200us, 1s")
        value = float(m.group(1)) * _TIME_UNITS[m.group(2)]
    if value < 0:
        raise TestbedError(f"time must not be negative, got {text!r}")
    return value


@dataclass(frozen=True)
class LinkShape:
    """What one end of an uplink does to its egress traffic."""

    rate_mbit: float | None = None  # None: no rate limit
    delay_ms: float = 0.0  # added one-way latency (netem)
    jitter_ms: float = 0.0  # +- variation of the delay (netem; reorders packets)
    burst_ms: float | None = None  # HTB bucket as time at the rate; None: >= 70 KB (module doc)
    queue_ms: float | None = None  # queue before the rate limit as time at it; None: the kernel's 1000 packets

    @property
    def needs_netem(self) -> bool:
        return self.delay_ms > 0 or self.jitter_ms > 0


def _fmt_rate(mbit: float) -> str:
    return f"{round(mbit * 1000)}kbit"  # integer kbit: tc accepts no exponent notation


def parse_burst_ms(text: str | float | int | None) -> float | None:
    """'1ms' -> 1.0; None, '' or 'default' -> None (the >= 70 KB bucket); must be > 0."""
    if text is None or (isinstance(text, str) and text.strip().lower() in ("", "default")):
        return None
    value = parse_time_ms(text)
    if value <= 0:
        raise TestbedError(f"burst must be positive, got {text!r}: use e.g. 1ms, or 'default' for the 70 KB bucket")
    return value


def parse_queue_ms(value: str | float | int | None) -> float | None:
    """'50ms' or 50 -> 50.0; None, 0, 'kernel' -> None (the kernel's 1000-packet queue); must be >= 0."""
    if value is None or (isinstance(value, str) and value.strip().lower() in ("kernel", "0", "0ms")):
        return None
    ms = parse_time_ms(value)
    if ms < 0:
        raise TestbedError(f"queue must be >= 0 ms, got {value!r}: use e.g. 50ms, or 0 for the kernel's 1000 packets")
    return ms or None


def queue_bytes(mbit: float, queue_ms: float, gso: bool = False) -> int:
    """Bytes the uplink queue holds: queue_ms at the rate, at least MIN_QUEUE_FRAMES frames, and with GSO
    on (no burst_ms) two super-packets, or one would never fit."""
    floor = 2 * GSO_MAX_BYTES if gso else MIN_QUEUE_FRAMES * MAX_FRAME
    return max(floor, round(mbit * 1e6 / 8 * queue_ms / 1e3))


def _bfifo(shape: LinkShape, rate_mbit: float) -> list[str]:
    return ["bfifo", "limit", str(queue_bytes(rate_mbit, shape.queue_ms, gso=shape.burst_ms is None))]


def _htb_params(mbit: float, burst_ms: float | None = None) -> list[str]:
    bytes_per_s = mbit * 1e6 / 8
    if burst_ms is None:
        # ~1 ms at the rate but at least one 64 KiB GSO super-packet, so HTB never stalls on a large
        # skb and short measurements are barely inflated by the bucket's initial credit
        burst = max(int(bytes_per_s * 1e-3), 70_000)
        # single class: quantum only matters for the "quantum is big" warning; keep it in range
        quantum = min(200_000, max(1_600, int(bytes_per_s / 10)))
    else:
        burst = max(int(bytes_per_s * burst_ms * 1e-3), 2 * MAX_FRAME)
        quantum = MAX_FRAME
    rate = _fmt_rate(mbit)
    return ["rate", rate, "ceil", rate, "burst", str(burst), "cburst", str(burst), "quantum", str(quantum)]


def htb_burst_bytes(mbit: float, burst_ms: float | None = None) -> int:
    """The bucket size _htb_params gives (for reports and tests)."""
    return int(_htb_params(mbit, burst_ms)[5])


def _netem_params(shape: LinkShape, rate_mbit: float | None) -> list[str]:
    params = ["delay", f"{shape.delay_ms:g}ms"]
    if shape.jitter_ms > 0:
        params.append(f"{shape.jitter_ms:g}ms")
    # the netem queue must hold a bandwidth-delay product of packets, or it drops and TCP backs off
    bdp_pkts = int((rate_mbit or 10_000) * 1e6 / 8 * (shape.delay_ms + shape.jitter_ms) / 1e3 / 1500)
    if shape.queue_ms is not None and rate_mbit is not None:  # the delay line plus the queue
        queue = queue_bytes(rate_mbit, shape.queue_ms, gso=shape.burst_ms is None)
        params += ["limit", str(bdp_pkts + -(-queue // MAX_FRAME))]
    else:
        params += ["limit", str(max(1000, 4 * bdp_pkts))]
    return params


def _netem_missing(exc: TestbedError) -> TestbedError:
    return TestbedError(
        "the netem qdisc (needed for --delay/--jitter) is not available in this kernel "
        f"({exc}). Fix: `modprobe sch_netem` (package linux-modules-extra-$(uname -r) on Ubuntu), "
        "or run without delay/jitter."
    )


def _htb_missing(exc: TestbedError) -> TestbedError:
    return TestbedError(
        f"the htb qdisc (needed for the rate limit) is not available in this kernel ({exc}). "
        "Fix: `modprobe sch_htb`, or run with --rate none."
    )


def clear(ns: str, dev: str) -> None:
    sh(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)


def apply(ns: str, dev: str, shape: LinkShape) -> None:
    """Replace whatever shapes dev's egress in ns with `shape`."""
    clear(ns, dev)
    tc = ["tc", "-n", ns]
    if shape.rate_mbit is not None:
        try:
            sh([*tc, "qdisc", "add", "dev", dev, "root", "handle", "1:", "htb", "default", "1"])
        except TestbedError as exc:
            if "unknown" in str(exc).lower():
                raise _htb_missing(exc) from exc
            raise
        sh([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
            *_htb_params(shape.rate_mbit, shape.burst_ms)])
        parent = ["parent", "1:1", "handle", "10:"]
    else:
        parent = ["root", "handle", "10:"]
    if shape.needs_netem:
        try:
            sh([*tc, "qdisc", "add", "dev", dev, *parent, "netem", *_netem_params(shape, shape.rate_mbit)])
        except TestbedError as exc:
            if "unknown" in str(exc).lower():
                raise _netem_missing(exc) from exc
            raise
    elif shape.rate_mbit is not None and shape.queue_ms is not None:
        sh([*tc, "qdisc", "add", "dev", dev, *parent, *_bfifo(shape, shape.rate_mbit)])
    if shape.burst_ms is not None:  # wire-size packets under a small bucket (module doc)
        segs = 1 if shape.rate_mbit is not None else GSO_MAX_SEGS_DEFAULT
        sh(["ip", "-n", ns, "link", "set", "dev", dev, "gso_max_segs", str(segs)])


def change_rate(ns: str, dev: str, old: LinkShape, new_rate_mbit: float | None) -> LinkShape:
    """Change the rate of a shaped end; live (`tc class change`) when HTB is already there."""
    new = dataclasses.replace(old, rate_mbit=new_rate_mbit)
    if old.rate_mbit is not None and new_rate_mbit is not None:
        sh(["tc", "-n", ns, "class", "change", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
            *_htb_params(new_rate_mbit, new.burst_ms)])
        if new.queue_ms is not None:  # the queue keeps its time at the new rate (queued packets stay)
            leaf = ["netem", *_netem_params(new, new_rate_mbit)] if new.needs_netem else _bfifo(new, new_rate_mbit)
            sh(["tc", "-n", ns, "qdisc", "change", "dev", dev, "parent", "1:1", "handle", "10:", *leaf])
    else:
        apply(ns, dev, new)  # adding or removing the rate limit changes the qdisc tree
    return new


def netem_available(ns: str, dev: str) -> bool:
    """Probe: can a netem qdisc be attached here? (Leaves dev unshaped.)"""
    proc = sh(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "netem", "delay", "1ms"], check=False)
    clear(ns, dev)
    return proc.returncode == 0


def show(ns: str, dev: str) -> str:
    """tc's view of dev's qdiscs and classes (for `status`)."""
    qd = sh(["tc", "-n", ns, "qdisc", "show", "dev", dev], check=False).stdout.strip()
    cl = sh(["tc", "-n", ns, "class", "show", "dev", dev], check=False).stdout.strip()
    return "\n".join(x for x in (qd, cl) if x)
