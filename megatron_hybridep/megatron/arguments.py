"""Command line of pretrain_moe.py: Megatron's own arguments (megatron.training.arguments, so every
standard flag keeps its meaning) plus the plugin's flags, and YAML presets (--config) that set any
flag, with the command line overriding them."""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

from megatron_hybridep.plan.workload import (
    EARLY_RETURN_RATIO,
    GRAD_VALUE_BYTES,
    QUALITY_GRAD_RATIO,
    QUALITY_MAX_COMPRESSED_DOMAIN,
    QUALITY_WEIGHT_RATIO,
)

HYBRIDEP_CHOICE = "hybridep"


class PresetError(ValueError):
    """A --config preset that cannot be applied; names the key and the fix."""


def _checked(text: str, convert: Callable[[str], Any], kind: str, ok: Callable[[Any], bool], bad: str,
             fix: str) -> Any:
    """An argparse type's body: ``convert(text)`` (else "'text' is not <kind>"), then ``ok(value)``
    (else ``bad``, formatted with text and value); each message ends with the fix (argparse names the flag)."""
    try:
        value = convert(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {kind}; fix: {fix}") from None
    if not ok(value):
        raise argparse.ArgumentTypeError(f"{bad.format(text=text, value=value)}; fix: {fix}")
    return value


def _count(text: str) -> int:
    """argparse type: an integer >= 0."""
    return _checked(text, int, "an integer", lambda v: v >= 0, "{value} is negative", "an integer >= 0 (0 = off)")


def _positive(text: str) -> int:
    value = _count(text)
    if value == 0:
        raise argparse.ArgumentTypeError("must be >= 1; fix: the number of iterations a switch must pay back in")
    return value


def _seconds(text: str) -> float:
    """argparse type: seconds >= 0."""
    return _checked(text, float, "a number", lambda v: 0 <= v < float("inf"), "{text} is not finite and >= 0",
                    "seconds >= 0 (0 = off)")


def _cap(text: str) -> float:
    """argparse type: a ratio cap, 0 (none) or >= 1."""
    return _checked(text, float, "a number", lambda v: v == 0 or 1 <= v < float("inf"),
                    "{text} is not 0 or a finite ratio >= 1", "0 (no cap) or a ratio >= 1")


def _early_return(text: str) -> float | None:
    """argparse type of --hybridep-early-grad-return: auto (None: the default where it applies), 0 or off,
    or a ratio >= 1."""
    if text.strip().lower() == "auto":
        return None
    if text.strip().lower() == "off":
        return 0.0
    return _checked(text, float, "auto, off or a number", lambda v: v == 0 or 1 <= v < float("inf"),
                    "{text} is not auto, 0 or a finite ratio >= 1", "auto, 0 (off) or a ratio >= 1")


def add_hybridep_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Megatron extra-args provider: the plugin's flags, and 'hybridep' as a dispatcher choice."""
    _allow_hybridep_dispatcher(parser)
    _escape_bad_help(parser)
    g = parser.add_argument_group("HybridEP", "expert placement across data centres (megatron-hybridep)")
    g.add_argument("--config", default=None, help="YAML preset setting any flag (command-line flags win)")
    g.add_argument("--hybridep-topology", default=None,
                   help="topology YAML (configs/topologies/), or 'slurm' to derive it from the allocation "
                        "plus --hybridep-dc-map; default: 2 DCs x (world/2) ranks with the CPU demo's links")
    g.add_argument("--hybridep-dc-map", default=None, help="YAML mapping hostnames/patterns to DCs (with slurm)")
    g.add_argument("--hybridep-plan", default="auto",
                   help="auto (the planner's choice), ep (S=1: Megatron's EP), replicated (EP inside each DC, "
                        "experts replicated across DCs), or a plan JSON file from 'hybridep plan --out'")
    g.add_argument("--hybridep-layout", choices=("off", "auto"), default="off",
                   help="auto: the layout planner picks TP/PP/EP for the same global batch (hybridep plan --layout "
                        "auto) and the job runs it, unless the command line fixes one of them; then it only "
                        "prints the flags it would set")
    g.add_argument("--hybridep-compression-ratio", type=float, default=1.0,
                   help="expert weight compression for migration (1 = exact)")
    g.add_argument("--hybridep-grad-compression-ratio", type=float, default=1.0,
                   help="compression of borrowed experts' gradients returned to owners (1 = exact)")
    g.add_argument("--hybridep-max-compression-ratio", type=_cap, default=QUALITY_WEIGHT_RATIO,
                   help="cap on --hybridep-compression-ratio (0 = none): at 50x the shipped weights cost up to 2%% "
                        "in loss on a seed alone and 3.9%% with compressed gradients (docs/compression.md); raise it "
                        "to accept that cost")
    g.add_argument("--hybridep-max-grad-compression-ratio", type=_cap, default=QUALITY_GRAD_RATIO,
                   help="cap on --hybridep-grad-compression-ratio (0 = none): over 1,200 steps on real text the "
                        "returned gradients at 10x cost +0.9%% in loss at equal steps over 8 seeds and up to 2.7%% "
                        "on one, at 4x (with weights at 10x, bf16 values) +0.2%% and at most 1.4%% "
                        "(docs/compression.md); raise it to accept that cost")
    g.add_argument("--hybridep-max-compressed-domain", type=_count, default=QUALITY_MAX_COMPRESSED_DOMAIN,
                   metavar="S",
                   help="with compression, plan no domain of more than S ranks (default %(default)s, 0 = no cap): a "
                        "domain of S ranks computes 1 - 1/S of the routed tokens on compressed copies, and the loss "
                        "cost grew with that share (+1.0%% at 2 ranks, +2.6%% at 4; docs/compression.md)")
    g.add_argument("--hybridep-grad-compression-values", choices=tuple(GRAD_VALUE_BYTES), default="bf16",
                   help="kept values of compressed returned gradients: bf16 (default: error feedback keeps the "
                        "rounding, so nothing is lost; 2 bytes per kept value instead of 4, plus the index: at 4x a "
                        "bitmap, half a byte per kept value) "
                        "or same (the gradient's own dtype)")
    g.add_argument("--hybridep-grad-compression-warmup", type=_count, default=0, metavar="STEPS",
                   help="returned gradients start exact and reach --hybridep-grad-compression-ratio after STEPS "
                        "optimizer steps, the ratio growing geometrically (Deep Gradient Compression's warm-up)")
    g.add_argument("--hybridep-shared-refresh-interval", type=int, default=10,
                   help="optimizer steps between refreshes of the shared expert used by compression (0 = never)")
    g.add_argument("--hybridep-no-shared-expert", action="store_true",
                   help="compress experts as plain top-k, without the shared expert (the paper's ablation)")
    g.add_argument("--hybridep-residual-base", choices=("copy", "shared"), default="copy",
                   help="what compressed migration sends the top-k residual against: 'copy' (the copy the peers "
                        "already hold, seeded from the shared expert; copies converge to the owners' weights) or "
                        "'shared' (the shared expert every time, the paper's scheme)")
    g.add_argument("--hybridep-throughput-tflops", type=float, default=None,
                   help="achieved TFLOP/s per rank for the cost model (default: 0.05 on CPU, 300 on GPU)")
    g.add_argument("--hybridep-collective-overhead-ms", type=float, default=0.0, metavar="MS",
                   help="fixed cost of one collective call for the cost model (default 0: not priced; the "
                        "testbed's gloo ranks, 4 on 2 cores, measure ~2; on NCCL it is the topology's latency_us)")
    g.add_argument("--hybridep-replan-interval", type=_count, default=0,
                   help="iterations between re-planning decisions from measured routing and bandwidth; the "
                        "job prebuilds groups for every HybridEP candidate plan (0 = plan once at start-up)")
    g.add_argument("--hybridep-replan-horizon", type=_positive, default=100,
                   help="iterations over which a switch must pay back its cost")
    g.add_argument("--hybridep-replan-replicas", type=_count, default=0,
                   help="hot-expert replicas per rank the scheduler may add to a prebuilt plan when measured "
                        "routing makes them pay (exact copies, no new groups; 0 = off)")
    g.add_argument("--hybridep-borrowed-copies", choices=("auto", "iteration", "microbatch"), default="auto",
                   help="'iteration': gather borrowed experts once per optimizer step, keep them for every "
                        "micro-batch and return their gradients once; 'microbatch': gather and return in every "
                        "micro-batch (less memory); auto: iteration when the held copies fit the memory limit")
    g.add_argument("--hybridep-async-grad-return", action="store_true",
                   help="with borrowed copies per iteration: launch the return of their gradients in the last "
                        "backward and collect it before Megatron's reduction (overlaps the rest of the backward; "
                        "the cost model still prices it blocking)")
    g.add_argument("--hybridep-early-grad-return", type=_early_return, default=None, metavar="auto|RATIO",
                   help="with compressed returned gradients held for the iteration: launch the first M-1 "
                        "micro-batches' return in the (M-1)th backward, so it crosses the link during the last "
                        "micro-batch, and return the rest at element ratio RATIO (a smaller payload at the step's "
                        f"end; error feedback keeps what it leaves); auto (default): {EARLY_RETURN_RATIO:g} where "
                        f"the returned gradients are compressed at most {QUALITY_GRAD_RATIO:g}x (the quality cap) and "
                        "held for an iteration of M > 1, else off; 0 = off")
    g.add_argument("--hybridep-layout-independent-init", action="store_true",
                   help="draw every weight from --seed and its global layer and expert index, so every TP/PP/EP "
                        "layout starts from the same model (Megatron's own init differs per stage and EP rank); "
                        "for comparing layouts by loss")
    g.add_argument("--hybridep-fp64", action="store_true",
                   help="CPU only: float64 parameters and gradients (exactness checks against alltoall)")
    g.add_argument("--hybridep-log-plan", action="store_true", help="print every candidate plan at start-up")
    g.add_argument("--hybridep-print-args", action="store_true",
                   help="CPU runs: print Megatron's table of every argument at start-up (off: ~500 lines)")
    g.add_argument("--hybridep-stall-timeout", type=_seconds, default=None,
                   help="seconds without progress after which a rank counts as stalled and the job fails naming "
                        "it (default: max(60, 10 x median measured step, 3 x predicted step); 0 = off; under "
                        "torchrun/srun it sets torch.distributed's collective timeout)")
    g.add_argument("--hybridep-max-restarts", type=_count, default=0,
                   help="after a dead or stalled rank or a failed collective, restart every rank from the last "
                        "complete checkpoint (--save) up to N times (default 0: the job fails); under torchrun "
                        "use torchrun --max-restarts N (docs/reliability.md)")
    g.add_argument("--hybridep-nproc", type=int, default=4,
                   help="ranks to launch on this machine when not started by torchrun/srun (CPU, gloo)")
    g.add_argument("--hybridep-synthetic-data", action="store_true",
                   help="train on the built-in learnable Markov corpus (default when no --data-path/--mock-data)")
    return parser


def _escape_bad_help(parser: argparse.ArgumentParser) -> None:
    """argparse %-formats help text; a few Megatron help strings contain a bare '%' (e.g. '10%')
    and would crash --help. Escape only those."""
    for action in parser._actions:
        if action.help and "%" in action.help:
            try:
                action.help % {**vars(action), "prog": parser.prog}
            except (ValueError, TypeError, KeyError):
                action.help = action.help.replace("%", "%%")


def _allow_hybridep_dispatcher(parser: argparse.ArgumentParser) -> None:
    for action in parser._actions:  # argparse has no public lookup by option string
        if "--moe-token-dispatcher-type" in action.option_strings:
            if action.choices is not None and HYBRIDEP_CHOICE not in action.choices:
                action.choices = [*action.choices, HYBRIDEP_CHOICE]
            return
    raise RuntimeError("Megatron's parser has no --moe-token-dispatcher-type; unsupported megatron-core version")


def _read_field_docs_once() -> None:
    """Megatron writes its config dataclasses' flags' help from their source (inspect.getsource and
    ast.parse per class, ~0.3 CPU-s per parser, and every parse builds two). The source cannot change
    within a process: read it once per class. Only a cost; a Megatron without the method is left alone."""
    from megatron.training import argument_utils

    factory = getattr(argument_utils, "ArgumentGroupFactory", None)
    read = getattr(factory, "_get_field_docstrings", None)
    if read is None or hasattr(read, "__wrapped__"):
        return
    docs: dict[type, dict[str, str]] = {}

    @functools.wraps(read)
    def once(self: Any, src_cfg_class: type) -> dict[str, str]:
        if src_cfg_class not in docs:
            docs[src_cfg_class] = read(self, src_cfg_class)
        return dict(docs[src_cfg_class])  # a copy: callers may update what they get

    factory._get_field_docstrings = once


def build_parser() -> argparse.ArgumentParser:
    from megatron.training.arguments import add_megatron_arguments

    _read_field_docs_once()
    parser = argparse.ArgumentParser(description="Megatron-Core MoE pretraining with HybridEP", allow_abbrev=False)
    return add_hybridep_args(add_megatron_arguments(parser))


def preset_to_argv(preset: dict[str, Any], parser: argparse.ArgumentParser, source: str) -> list[str]:
    """Turn {flag_name: value} into argv tokens; unknown keys are an error naming the fix."""
    by_dest = {}
    for action in parser._actions:
        for opt in action.option_strings:
            if opt.startswith("--"):
                by_dest.setdefault(opt[2:].replace("-", "_"), (opt, action))
    argv: list[str] = []
    for key, value in preset.items():
        norm = str(key).replace("-", "_")
        if norm not in by_dest:
            close = [k for k in by_dest if norm in k or k in norm][:3]
            raise PresetError(f"{source}: unknown key {key!r}; fix: use a flag name of pretrain_moe.py --help "
                              f"(without '--'){', e.g. ' + ', '.join(close) if close else ''}")
        opt, action = by_dest[norm]
        if action.nargs == 0:  # store_true / store_false
            if not isinstance(value, bool):
                raise PresetError(f"{source}: {key} is a switch; fix: set it to true or false")
            if value:  # the key names the flag itself: true passes it (also for --no-* switches)
                argv.append(opt)
            continue
        if value is None:
            continue
        values = value if isinstance(value, list) else [value]
        argv += [opt, *[str(v) for v in values]]
    return argv


def load_preset(path: str) -> dict[str, Any]:
    """The preset with its ``base:`` chain (plan/presets.py's load_settings, which the planner reads too)."""
    from megatron_hybridep.plan.errors import PlanError
    from megatron_hybridep.plan.presets import load_settings

    try:
        return load_settings(path)
    except PlanError as exc:
        raise PresetError(f"--config {exc}") from None


def parse(argv: Sequence[str], default_config: str | None = None) -> argparse.Namespace:
    """Megatron args + plugin args, with --config presets applied under the command line."""
    parser = build_parser()
    pre = argparse.ArgumentParser(add_help=False)
    pre.add_argument("--config", default=None)
    known, _ = pre.parse_known_args(list(argv))
    config = known.config or default_config
    tokens = list(argv)
    if config:
        tokens = preset_to_argv(load_preset(config), parser, config) + tokens
    # Megatron's parse_args reads sys.argv and post-processes (rank/world size from the env, MSC...).
    from megatron.training.arguments import parse_args

    saved, sys.argv = sys.argv, ["pretrain_moe.py", *tokens]
    try:
        args = parse_args(extra_args_provider=add_hybridep_args)
    finally:
        sys.argv = saved
    args.config = config
    args.argv = tokens
    from megatron_hybridep.megatron.supported import check

    check(args)  # combinations that cannot run fail here, before any process or collective
    return args
