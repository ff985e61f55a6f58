"""`hybridep` command line: one subcommand per module, imported only when used."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing add_arguments(parser) and run(args) -> int
SUBCOMMANDS = {
    "plan": ("megatron_hybridep.plan.cli", "pick expert domains for a topology and model"),
    "simulate": ("megatron_hybridep.sim.cli", "simulate HybridEP vs EP at scale"),
    "testbed": ("megatron_hybridep.testbed.cli", "emulated multi-DC network (namespaces + tc)"),
    "bench": ("megatron_hybridep.bench.cli", "benchmark HybridEP against Megatron EP on the testbed"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="hybridep", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    wanted = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == wanted:
            try:
                modules[name] = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                parser.error(f"'hybridep {name}' is not available in this build ({exc})")
            modules[name].add_arguments(p)
    args = parser.parse_args(argv)
    return int(modules[args.command].run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
