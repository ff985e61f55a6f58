"""The emulated multi-DC network: N DC namespaces joined through one switch namespace.

    <prefix>-dc0 [wan0 10.77.0.1] ==veth== [dc0] \
    <prefix>-dc1 [wan0 10.77.0.2] ==veth== [dc1] -- br0 (bridge in <prefix>-sw)
    ...                                            /

Each veth pair is one DC's uplink; it is shaped on both ends (DC-side egress: traffic leaving the
DC, switch-side egress: traffic entering it), so a cross-DC flow runs at min(rate_src, rate_dst).
Ranks of one DC share its namespace and address; their traffic goes over lo, unshaped unless
`fabric_mbit` is set: then lo is shaped at that rate, one queue shared by all the DC's ranks in both
directions (a DC fabric scaled down like the WAN, so intra-DC token traffic costs time too).
Delay/jitter is added on the DC-side egress only: one-way latency dc a -> dc b = delay_a.
The DC namespaces run TCP Reno whatever the host's default (`congestion`; docs/testbed.md "Queue and
TCP": the host's BBR stalled Megatron's gradient all-reduces with retransmission timeouts).

Usage:
    with Testbed(TestbedConfig(dcs=2, ranks_per_dc=2, rate_mbit=100)) as tb:
        result = tb.launch([sys.executable, "train.py"], timeout_s=300)
        tb.set_rate(1, 50)
        with tb.outage(1):   # DC 1 cut off the WAN (every packet dropped, both ways) for the block
            ...
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import errno
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from megatron_hybridep.testbed import launcher, netns, selfcheck, shaping
from megatron_hybridep.testbed.launcher import LaunchResult, RankGroup, RankInfo
from megatron_hybridep.testbed.selfcheck import SelfCheckReport
from megatron_hybridep.testbed.sh import TestbedError, preflight, sh

# loss-based like Linux's default Cubic, and always allowed in a namespace (Cubic need not be: here only
# "reno bbr" are in tcp_allowed_congestion_control); on these ~1 ms round trips the two behave alike
CONGESTION_DEFAULT = "reno"
CONGESTION_SYSCTL = Path("/proc/sys/net/ipv4/tcp_congestion_control")
CONGESTION_ALLOWED = Path("/proc/sys/net/ipv4/tcp_allowed_congestion_control")
RTO_MIN_SYSCTL = Path("/proc/sys/net/ipv4/tcp_rto_min_us")  # per namespace, Linux >= 6.11
DC_DEV = "wan0"  # the DC's uplink interface inside its namespace (GLOO_SOCKET_IFNAME)
BRIDGE = "br0"
MAX_DCS = 250


def _switch_port(dc: int) -> str:
    return f"dc{dc}"


@dataclass(frozen=True)
class LinkCounters:
    """Traffic through one DC uplink; tx = leaving the DC, rx = entering it."""

    dc: int
    tx_bytes: int
    rx_bytes: int
    tx_packets: int
    rx_packets: int

    def __sub__(self, other: LinkCounters) -> LinkCounters:
        return LinkCounters(self.dc, self.tx_bytes - other.tx_bytes, self.rx_bytes - other.rx_bytes,
                            self.tx_packets - other.tx_packets, self.rx_packets - other.rx_packets)


@dataclass
class TestbedConfig:
    """Shape of the emulated network. Rates in Mbit/s (None = unshaped), times in ms."""

    __test__ = False  # pytest: not a test class

    dcs: int = 2
    ranks_per_dc: int = 1  # default for launch()
    rate_mbit: float | None | list[float | None] = 100.0  # one value for all DCs, or one per DC
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    burst_ms: float | None = None  # HTB bucket of every shaped end as ms at the rate; None: >= 70 KB (shaping.py)
    # queue before each uplink's rate limit as ms at the rate; None or 0: the kernel's 1000 packets (shaping.py)
    queue_ms: float | str | None = None
    # TCP congestion control of the DC namespaces; None or "host": the host's default (this machine: BBR)
    congestion: str | None = CONGESTION_DEFAULT
    # TCP's minimum retransmission timeout in the DC namespaces, ms; None: the kernel's 200 ms
    # (docs/testbed.md "Queue and TCP": a queue of up to 1.2 s in time fires it spuriously)
    rto_min_ms: float | None = None
    fabric_mbit: float | None = None  # each DC's internal fabric (lo, shared by its ranks); None = unshaped
    subnet: str = "10.77.0"  # a /24 that exists only inside our namespaces; DC i is .(i+1)
    prefix: str | None = None  # default "hep-<pid>"
    persistent: bool = False  # kept up after the owner exits (`hybridep testbed up`)

    def rates(self) -> list[float | None]:
        if isinstance(self.rate_mbit, list | tuple):
            if len(self.rate_mbit) != self.dcs:
                raise TestbedError(f"rate_mbit has {len(self.rate_mbit)} values for {self.dcs} DCs")
            return [shaping.parse_rate_mbit(r) for r in self.rate_mbit]
        return [shaping.parse_rate_mbit(self.rate_mbit)] * self.dcs

    def fabric(self) -> float | None:
        """The DC fabric's rate in Mbit/s (None = unshaped)."""
        try:
            return shaping.parse_rate_mbit(self.fabric_mbit)
        except TestbedError as exc:
            raise TestbedError(f"fabric_mbit (--fabric): {exc}") from None

    def validate(self) -> None:
        if not 1 <= self.dcs <= MAX_DCS:
            raise TestbedError(f"dcs must be in 1..{MAX_DCS}, got {self.dcs}")
        if self.ranks_per_dc < 1:
            raise TestbedError(f"ranks_per_dc must be >= 1, got {self.ranks_per_dc}")
        parts = self.subnet.split(".")
        if len(parts) != 3 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise TestbedError(f"subnet must be the first three octets of a /24, got {self.subnet!r}")
        if self.delay_ms < 0 or self.jitter_ms < 0:
            raise TestbedError("delay and jitter must not be negative")
        if self.jitter_ms > 0 and self.delay_ms == 0:
            raise TestbedError("jitter needs a delay (netem varies the delay by +- jitter)")
        shaping.parse_burst_ms(self.burst_ms)
        if self.congestion is not None and not re.fullmatch(r"[a-z0-9_]+", self.congestion):
            raise TestbedError(f"congestion (--congestion) must be a TCP congestion control name such as reno, or "
                               f"host for the host's default; got {self.congestion!r}")
        if self.rto_min_ms is not None and not 1 <= self.rto_min_ms <= 120_000:
            raise TestbedError(f"rto_min_ms (--rto-min-ms) must be 1..120000 ms, got {self.rto_min_ms:g}; fix: e.g. "
                               "--rto-min-ms 2000, or leave it out for the kernel's 200 ms")
        try:
            shaping.parse_queue_ms(self.queue_ms)
        except TestbedError as exc:
            raise TestbedError(f"queue_ms (--queue-ms): {exc}") from None
        self.rates()
        self.fabric()


class Testbed:
    """N emulated DCs on this machine. Context manager: always torn down, also on exceptions,
    SIGINT, SIGTERM and SIGHUP (and at interpreter exit when used without `with`)."""

    __test__ = False  # pytest: not a test class

    def __init__(self, config: TestbedConfig | None = None, **overrides: object) -> None:
        # a copy: the caller's config object is never changed
        config = dataclasses.replace(config or TestbedConfig(), **overrides)
        config.validate()
        self.config = config
        self.prefix = netns.validate_prefix(config.prefix or f"hep-{os.getpid()}")
        self.config.prefix = self.prefix
        self._shapes: dict[tuple[int, str], shaping.LinkShape] = {}
        self._wan_down: set[int] = set()
        self._is_up = False
        self._owned = True  # False for attach(): leaving `with` does not tear it down
        self._owner_pid = os.getpid()
        self._lock = threading.Lock()  # set_rate may be called from another thread
        self._old_handlers: dict[int, object] = {}
        self._deferred_signal: int | None = None

    # ------------------------------------------------------------------------------ naming
    @property
    def dcs(self) -> int:
        return self.config.dcs

    @property
    def switch_netns(self) -> str:
        return f"{self.prefix}-sw"

    def netns(self, dc: int) -> str:
        """Name of DC `dc`'s network namespace."""
        self._check_dc(dc)
        return f"{self.prefix}-dc{dc}"

    def address(self, dc: int) -> str:
        """DC `dc`'s IPv4 address (shared by all its ranks)."""
        self._check_dc(dc)
        return f"{self.config.subnet}.{dc + 1}"

    @property
    def interface(self) -> str:
        """The uplink interface inside every DC namespace (what gloo binds to)."""
        return DC_DEV

    def _check_dc(self, dc: int) -> None:
        if not 0 <= dc < self.dcs:
            raise TestbedError(f"no DC {dc}: the testbed has DCs 0..{self.dcs - 1}")

    def _ends(self, dc: int) -> list[tuple[str, str]]:
        """(namespace, device) of both ends of DC dc's uplink."""
        return [(self.netns(dc), DC_DEV), (self.switch_netns, _switch_port(dc))]

    # ----------------------------------------------------------------------------- lifecycle
    def up(self) -> Testbed:
        """Create namespaces, links, addresses and shaping. Tears down what it made on failure."""
        if self._is_up:
            return self
        preflight()
        netns.reap_stale()  # leftovers of killed runs; never touches live owners' testbeds
        if netns.testbed_netns(self.prefix):
            raise TestbedError(
                f"a testbed with prefix {self.prefix} already exists. "
                f"Fix: `hybridep testbed down --prefix {self.prefix}`"
            )
        self._is_up = True  # from here on, down() has something to clean
        if not self.config.persistent:
            atexit.register(self.down)
        try:
            self._write_state()  # first, so a crash mid-way still leaves a findable owner
            self._build()
            self._write_state()
        except BaseException:
            self._deferred_mode = True  # a second Ctrl-C must not cut the cleanup short
            self.down()
            raise
        return self

    def _build(self) -> None:
        sw = self.switch_netns
        netns.create_netns(sw)
        sh(["ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge"])
        sh(["ip", "-n", sw, "link", "set", BRIDGE, "up"])
        rates = self.config.rates()
        netem_checked = False
        for dc in range(self.dcs):
            ns, port = self.netns(dc), _switch_port(dc)
            netns.create_netns(ns)
            # create the pair inside the switch namespace, peer straight into the DC: nothing
            # ever appears in the root namespace
            sh(["ip", "-n", sw, "link", "add", port, "type", "veth", "peer", "name", DC_DEV, "netns", ns])
            sh(["ip", "-n", sw, "link", "set", port, "master", BRIDGE])
            sh(["ip", "-n", sw, "link", "set", port, "up"])
            sh(["ip", "-n", ns, "addr", "add", f"{self.address(dc)}/24", "dev", DC_DEV])
            sh(["ip", "-n", ns, "link", "set", DC_DEV, "up"])
            self._set_congestion(ns)
            self._set_rto_min(ns)
            burst, queue = shaping.parse_burst_ms(self.config.burst_ms), shaping.parse_queue_ms(self.config.queue_ms)
            dc_shape = shaping.LinkShape(rates[dc], self.config.delay_ms, self.config.jitter_ms, burst, queue)
            if dc_shape.needs_netem and not netem_checked:
                if not shaping.netem_available(ns, DC_DEV):
                    raise shaping._netem_missing(TestbedError("Specified qdisc kind is unknown"))
                netem_checked = True
            self._apply(dc, ns, DC_DEV, dc_shape)
            self._apply(dc, sw, port, shaping.LinkShape(rates[dc], burst_ms=burst, queue_ms=queue))
            if (fabric := self.config.fabric()) is not None:
                # lo carries 64 KB packets: the default >= 70 KB bucket, never the wire-size setting
                shaping.apply(ns, "lo", shaping.LinkShape(fabric))

    def congestion(self) -> str | None:
        """The TCP congestion control the DC namespaces run (None: the host's default)."""
        cc = self.config.congestion
        return None if cc in (None, "host") else cc

    def _set_congestion(self, ns: str) -> None:
        if (cc := self.congestion()) is None:
            return
        try:
            netns.in_netns(ns, lambda: CONGESTION_SYSCTL.write_text(cc))
        except OSError as exc:
            allowed = CONGESTION_ALLOWED.read_text().strip() if CONGESTION_ALLOWED.exists() else "?"
            why = ("this kernel has no such algorithm" if exc.errno == errno.ENOENT else
                   f"a namespace may use only tcp_allowed_congestion_control's: {allowed}")
            raise TestbedError(f"congestion (--congestion): cannot run TCP {cc} in the DC namespaces: {why}. Fix: "
                               f"--congestion {CONGESTION_DEFAULT}, or --congestion host") from None

    def _set_rto_min(self, ns: str) -> None:
        if self.config.rto_min_ms is None:
            return
        try:
            netns.in_netns(ns, lambda: RTO_MIN_SYSCTL.write_text(str(round(self.config.rto_min_ms * 1000))))
        except OSError as exc:
            raise TestbedError(f"rto_min_ms (--rto-min-ms): cannot set {RTO_MIN_SYSCTL} in the DC namespaces "
                               f"({exc.strerror}; it needs Linux >= 6.11). Fix: leave --rto-min-ms out") from None

    def _apply(self, dc: int, ns: str, dev: str, shape: shaping.LinkShape) -> None:
        if shape.rate_mbit is not None or shape.needs_netem:
            shaping.apply(ns, dev, shape)
        self._shapes[(dc, ns)] = shape

    def down(self) -> None:
        """Kill everything running in the namespaces and remove them (idempotent)."""
        if not self._is_up:
            return
        try:
            atexit.unregister(self.down)
        except Exception:  # noqa: BLE001 - best effort
            pass
        self._is_up = False
        netns.teardown_prefix(self.prefix)

    def __enter__(self) -> Testbed:
        self._deferred_mode, self._deferred_signal = False, None
        self._install_signal_handlers()
        try:
            return self.up()
        except BaseException:
            self._restore_signal_handlers()
            raise

    def __exit__(self, *exc_info: object) -> None:
        # signals during teardown are deferred, not allowed to cut it short
        self._deferred_mode = True
        try:
            if self._owned:
                self.down()
        finally:
            self._restore_signal_handlers()
        if self._deferred_signal is not None:
            raise SystemExit(128 + self._deferred_signal)

    # signal handling: turn SIGTERM/SIGHUP into SystemExit so `with` blocks unwind and tear down
    _SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)
    _deferred_mode = False

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self._deferred_mode:
            self._deferred_signal = signum
            return
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        raise SystemExit(128 + signum)

    def _install_signal_handlers(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return  # only the main thread may set handlers; teardown still runs via __exit__
        for sig in self._SIGNALS:
            self._old_handlers[sig] = signal.signal(sig, self._on_signal)

    def _restore_signal_handlers(self) -> None:
        for sig, handler in self._old_handlers.items():
            signal.signal(sig, handler)  # type: ignore[arg-type]
        self._old_handlers.clear()

    # ------------------------------------------------------------------------------ state
    def _write_state(self) -> None:
        netns.write_state(
            self.prefix,
            {
                "prefix": self.prefix,
                "owner_pid": self._owner_pid,
                "persistent": self.config.persistent,
                "created": time.time(),
                "config": asdict(self.config),
                "rates_mbit": self.rates(),
            },
        )

    @classmethod
    def attach(cls, prefix: str) -> Testbed:
        """A handle on a testbed that is already up (e.g. from `hybridep testbed up`).

        The handle does not own it: leaving a `with` block keeps it up; down() tears it down.
        """
        state = netns.read_state(prefix)
        if state is None or not netns.testbed_netns(prefix):
            raise TestbedError(f"no testbed with prefix {prefix} is up (see `hybridep testbed status`)")
        cfg = TestbedConfig(**state["config"])
        tb = cls(cfg)
        tb._is_up, tb._owned = True, False
        tb._owner_pid = state.get("owner_pid", os.getpid())
        burst, queue = shaping.parse_burst_ms(cfg.burst_ms), shaping.parse_queue_ms(cfg.queue_ms)
        for dc, rate in enumerate(state.get("rates_mbit") or cfg.rates()):
            tb._shapes[(dc, tb.netns(dc))] = shaping.LinkShape(rate, cfg.delay_ms, cfg.jitter_ms, burst, queue)
            tb._shapes[(dc, tb.switch_netns)] = shaping.LinkShape(rate, burst_ms=burst, queue_ms=queue)
        return tb

    # ---------------------------------------------------------------------------- shaping
    def rates(self) -> list[float | None]:
        """Current uplink rate of each DC in Mbit/s (None = unshaped)."""
        if not self._shapes:
            return self.config.rates()
        return [self._shapes[(dc, self.netns(dc))].rate_mbit for dc in range(self.dcs)]

    def set_rate(self, dc: int, mbit: float | str | None) -> None:
        """Change DC dc's uplink rate (both directions) while ranks run; None removes the limit."""
        rate = shaping.parse_rate_mbit(mbit)
        self._require_up()
        with self._lock:
            for ns, dev in self._ends(dc):
                self._shapes[(dc, ns)] = shaping.change_rate(ns, dev, self._shapes[(dc, ns)], rate)
            self._write_state()  # so `status` and attach() see the current rates

    def set_wan(self, dc: int, up: bool) -> None:
        """Cut DC dc off the WAN (up=False: its uplink drops every packet, both ways) or heal it.

        The uplink's switch-side port leaves the bridge: what DC dc sends ends in the switch
        namespace, nothing is forwarded to it, and both veth ends keep their carrier, addresses and
        shaping, so its hosts see a silent path (TCP retransmits), as with a 100% loss link. (tc
        netem loss needs sch_netem, which kernels without linux-modules-extra lack; bridge port
        states are ignored by some kernels.)"""
        self._require_up()
        port = _switch_port(dc)
        with self._lock:
            bridge = ["master", BRIDGE] if up else ["nomaster"]
            sh(["ip", "-n", self.switch_netns, "link", "set", "dev", port, *bridge])
            if up:
                self._wan_down.discard(dc)
            else:
                self._wan_down.add(dc)

    def wan_down(self) -> list[int]:
        """The DCs currently cut off the WAN."""
        return sorted(self._wan_down)

    @contextlib.contextmanager
    def outage(self, dc: int) -> Iterator[None]:
        """A WAN outage of DC dc for the duration of the block (healed on leaving it, also on errors).

            with tb.outage(1):
                group.wait_output("error", timeout_s=3)   # or any timer: the outage's length
        """
        self.set_wan(dc, False)
        try:
            yield
        finally:
            if self._is_up:
                self.set_wan(dc, True)

    def expected_mbit(self, src_dc: int, dst_dc: int) -> float | None:
        """The rate a flow src -> dst should get: min of both uplinks (inside a DC: the fabric); None unshaped."""
        if src_dc == dst_dc:
            return self.config.fabric()
        rates = [r for r in (self.rates()[src_dc], self.rates()[dst_dc]) if r is not None]
        return min(rates) if rates else None

    def link_counters(self) -> list[LinkCounters]:
        """Bytes/packets through each DC's uplink so far (from the DC side's wan0).

        Same-DC traffic goes over lo, so these count exactly the cross-DC traffic of a DC:
        snapshot before and after a run and subtract (LinkCounters supports `-`)."""
        self._require_up()
        out = []
        for dc in range(self.dcs):
            raw = sh(["ip", "-n", self.netns(dc), "-j", "-s", "link", "show", "dev", DC_DEV]).stdout
            stats = json.loads(raw)[0]["stats64"]
            out.append(LinkCounters(dc, stats["tx"]["bytes"], stats["rx"]["bytes"], stats["tx"]["packets"],
                                    stats["rx"]["packets"]))
        return out

    def _require_up(self) -> None:
        if not self._is_up:
            raise TestbedError("the testbed is not up (use it as a context manager or call up())")

    # ----------------------------------------------------------------------- launch / check
    def ranks(self, ranks_per_dc: int | None = None) -> list[RankInfo]:
        return launcher.rank_layout(self, ranks_per_dc or self.config.ranks_per_dc)

    def start(self, cmd: Sequence[str] | Callable[[RankInfo], Sequence[str]], **options: Any) -> RankGroup:
        """Start the ranks and return at once; ``options`` as launcher.RankGroup's (ranks_per_dc, env,
        timeout_s, stream, log_dir, cwd, fail_fast)."""
        self._require_up()
        return launcher.start(self, cmd, **options)

    def launch(self, cmd: Sequence[str] | Callable[[RankInfo], Sequence[str]], **options: Any) -> LaunchResult:
        """Run the ranks to completion (or timeout) and return exit codes and output; options as start's."""
        return self.start(cmd, **options).wait()

    def selfcheck(self, *, seconds: float = 1.0, tolerance: float = 0.10,
                  intra_factor: float = 5.0, two_way_tolerance: float = 0.5) -> SelfCheckReport:
        """Measure cross-DC (one-way and two-way) and intra-DC throughput against the configured rates."""
        self._require_up()
        return selfcheck.selfcheck(self, seconds=seconds, tolerance=tolerance, intra_factor=intra_factor,
                         two_way_tolerance=two_way_tolerance)

    def describe(self) -> str:
        rates = ", ".join("unshaped" if r is None else f"{r:g}" for r in self.rates())
        burst = shaping.parse_burst_ms(self.config.burst_ms)
        extra = "" if burst is None else f", HTB burst {burst:g} ms"
        queue = shaping.parse_queue_ms(self.config.queue_ms)
        extra += ", queue: the kernel's 1000 packets" if queue is None else f", queue {queue:g} ms"
        extra += f", TCP {self.congestion() or 'of the host'}"
        if self.config.rto_min_ms is not None:
            extra += f" (minimum RTO {self.config.rto_min_ms:g} ms)"
        if self.config.delay_ms:
            extra += f", delay {self.config.delay_ms:g} ms"
            if self.config.jitter_ms:
                extra += f" +- {self.config.jitter_ms:g} ms"
        if (fabric := self.config.fabric()) is not None:
            extra += f", DC fabric {fabric:g} Mbit/s (shared by a DC's ranks)"
        return (f"testbed {self.prefix}: {self.dcs} DCs x {self.config.ranks_per_dc} ranks, "
                f"uplink Mbit/s [{rates}]{extra}")


__all__ = ["LinkCounters", "Testbed", "TestbedConfig", "TestbedError"]
