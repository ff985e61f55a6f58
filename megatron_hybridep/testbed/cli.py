"""`hybridep testbed up|down|status|check`: the emulated multi-DC network from the shell.

    hybridep testbed up --dcs 2 --ranks-per-dc 2 --rate 100mbit     # stays up ("hep-up")
    hybridep testbed status
    hybridep testbed check                  # self-check the one that is up, or a temporary one
    hybridep testbed down                   # kept-up testbeds and leftovers of killed runs
"""

from __future__ import annotations

import argparse
import sys

from megatron_hybridep.testbed import netns, shaping
from megatron_hybridep.testbed.network import CONGESTION_DEFAULT, DC_DEV, Testbed, TestbedConfig
from megatron_hybridep.testbed.sh import TestbedError, preflight, sh

DEFAULT_PREFIX = "hep-up"


def _topology_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dcs", type=int, default=2, help="number of emulated DCs (default 2)")
    p.add_argument("--ranks-per-dc", type=int, default=1, help="ranks per DC, for launches (default 1)")
    p.add_argument("--rate", default="100mbit",
                   help="uplink rate of every DC, both directions: 100mbit, 1gbit, none (default 100mbit)")
    p.add_argument("--delay", default="0ms", help="one-way delay added to traffic leaving a DC, e.g. 5ms")
    p.add_argument("--jitter", default="0ms", help="+- delay variation, e.g. 1ms (needs --delay)")
    p.add_argument("--burst", default="default",
                   help="HTB bucket of each uplink as time at the rate, e.g. 1ms (a link that banks no idle "
                        "time); default: >= 70 KB, which lets the first 70 KB after an idle gap pass unshaped")
    p.add_argument("--queue", default="kernel",
                   help="queue before each uplink's rate limit as time at the rate, e.g. 50ms (at least "
                        f"{shaping.MIN_QUEUE_FRAMES} frames): a shallow-buffer link; default kernel: its 1000 packets "
                        "(1.2 s at 10 Mbit/s)")
    p.add_argument("--congestion", default=CONGESTION_DEFAULT,
                   help=f"TCP congestion control inside the DCs (default {CONGESTION_DEFAULT}: loss-based, as Linux's "
                        "default Cubic); host: the host's default (this machine's BBR, which the runs before "
                        "2026-11-27 had)")
    p.add_argument("--fabric", default="none",
                   help="each DC's internal fabric, shared by its ranks (lo inside the DC): e.g. 800mbit; "
                        "default none (unshaped, ~30 Gbit/s)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Register the testbed actions on the `hybridep testbed` parser."""
    sub = parser.add_subparsers(dest="testbed_action", required=True, metavar="{up,down,status,check}")
    up = sub.add_parser("up", help="bring the testbed up and leave it up")
    _topology_flags(up)
    up.add_argument("--prefix", default=DEFAULT_PREFIX, help=f"namespace prefix (default {DEFAULT_PREFIX})")

    down = sub.add_parser("down", help="tear down kept-up testbeds and leftovers of killed runs")
    down.add_argument("--prefix", help="tear down exactly this testbed")
    down.add_argument("--all", action="store_true",
                      help="also testbeds whose owner process is alive (other runs!)")

    status = sub.add_parser("status", help="namespaces, addresses, qdiscs")
    status.add_argument("--prefix", help="only this testbed")

    check = sub.add_parser("check", help="measure cross-DC and intra-DC throughput")
    _topology_flags(check)
    check.add_argument("--prefix", default=None,
                       help=f"check this testbed (default {DEFAULT_PREFIX} if it is up, else a temporary one "
                            "built from the flags above)")
    check.add_argument("--seconds", type=float, default=1.0, help="length of each measurement (default 1)")
    check.add_argument("--tolerance", type=float, default=0.10, help="cross-DC tolerance (default 0.10)")


def _config(args: argparse.Namespace, prefix: str | None, persistent: bool) -> TestbedConfig:
    return TestbedConfig(
        dcs=args.dcs,
        ranks_per_dc=args.ranks_per_dc,
        rate_mbit=shaping.parse_rate_mbit(args.rate),
        delay_ms=shaping.parse_time_ms(args.delay),
        jitter_ms=shaping.parse_time_ms(args.jitter),
        burst_ms=shaping.parse_burst_ms(args.burst),
        queue_ms=args.queue,
        congestion=args.congestion,
        fabric_mbit=shaping.parse_rate_mbit(args.fabric),
        prefix=prefix,
        persistent=persistent,
    )


def cmd_up(args: argparse.Namespace) -> int:
    tb = Testbed(_config(args, args.prefix, persistent=True))
    tb.up()
    print(tb.describe())
    for dc in range(tb.dcs):
        print(f"  dc{dc}: netns {tb.netns(dc)}  {tb.address(dc)} dev {tb.interface}")
    print(f"run a command in a DC: ip netns exec {tb.netns(0)} <cmd>")
    print(f"tear down: hybridep testbed down --prefix {tb.prefix}")
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    preflight()
    if args.prefix:
        targets = [netns.validate_prefix(args.prefix)]
    else:
        targets = []
        for prefix in netns.all_prefixes():
            state = netns.read_state(prefix) or {}
            if args.all or state.get("persistent") or netns.is_stale(prefix):
                targets.append(prefix)
            else:
                alive = netns.owner_alive(prefix)
                why = "its owner process is alive" if alive else "its owner is unknown"
                print(f"skipping {prefix}: {why} (use --prefix {prefix} or --all)")
    for prefix in targets:
        removed = netns.teardown_prefix(prefix)
        print(f"removed {prefix}: {', '.join(removed) or 'state only'}")
    if not targets:
        print("nothing to tear down")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    preflight()
    prefixes = [args.prefix] if args.prefix else netns.all_prefixes()
    if not prefixes:
        print("no testbed is up")
        return 0
    for prefix in prefixes:
        state = netns.read_state(prefix) or {}
        if not state and not netns.testbed_netns(prefix):
            print(f"{prefix}: not up")
            continue
        alive = netns.owner_alive(prefix)
        owner = f"owner pid {state.get('owner_pid', '?')} ({'alive' if alive else 'gone'})"
        kind = "kept up" if state.get("persistent") else ("LEFTOVER" if netns.is_stale(prefix) else "in use")
        names = sorted(netns.testbed_netns(prefix))
        print(f"{prefix}: {kind}, {owner}, rates Mbit/s {state.get('rates_mbit', '?')}")
        if not names:
            print("  (no namespaces: state file only)")
        for ns in names:
            addrs = sh(["ip", "-n", ns, "-br", "addr", "show"], check=False).stdout.strip()
            print(f"  netns {ns}")
            for line in addrs.splitlines():
                print(f"    {line}")
            devs = [DC_DEV] if not ns.endswith("-sw") else _switch_ports(ns)
            for dev in devs:
                for line in shaping.show(ns, dev).splitlines():
                    print(f"    {dev}: {line}")
    return 0


def _switch_ports(ns: str) -> list[str]:
    out = sh(["ip", "-n", ns, "-br", "link", "show", "type", "veth"], check=False).stdout
    return sorted(line.split("@")[0].split()[0] for line in out.splitlines() if line.strip())


def cmd_check(args: argparse.Namespace) -> int:
    preflight()
    prefix = args.prefix
    if prefix is None and netns.testbed_netns(DEFAULT_PREFIX):
        prefix = DEFAULT_PREFIX
    if prefix is not None:
        report = Testbed.attach(prefix).selfcheck(seconds=args.seconds, tolerance=args.tolerance)
    else:
        with Testbed(_config(args, None, persistent=False)) as tb:
            report = tb.selfcheck(seconds=args.seconds, tolerance=args.tolerance)
    print(report.format())
    return 0 if report.ok else 1


ACTIONS = {"up": cmd_up, "down": cmd_down, "status": cmd_status, "check": cmd_check}


def run(args: argparse.Namespace) -> int:
    """Dispatch `hybridep testbed <action>`; errors become a message and exit code 2."""
    try:
        return ACTIONS[args.testbed_action](args)
    except TestbedError as exc:
        print(f"hybridep testbed: error: {exc}", file=sys.stderr)
        return 2
