"""Megatron's parser (megatron/arguments.py): the class sources Megatron reads for its flags' help are
read once per process, and the ranks' fork server reads them before it forks (train/warm_ranks.py)."""

import inspect
import os

from megatron_hybridep.train.launch import run_ranks

PRESET = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "configs", "presets", "cpu_demo.yaml")


def _flags(parser):
    return sorted((a.dest, tuple(a.option_strings), str(a.help), repr(a.default), repr(a.choices))
                  for a in parser._actions)


def _no_source(obj):
    raise AssertionError(f"read the source of {obj} again")


def test_a_second_parser_reads_no_class_source_and_has_the_same_flags(monkeypatch):
    from megatron_hybridep.megatron.arguments import build_parser

    first = build_parser()
    monkeypatch.setattr(inspect, "getsource", _no_source)
    second = build_parser()
    assert _flags(second) == _flags(first)
    # the help Megatron writes from a config dataclass field's docstring is there both times
    topk = [a.help for p in (first, second) for a in p._actions if a.dest == "moe_router_topk"]
    assert topk[0] and topk[0] == topk[1]


def _parse_without_source(ctx):
    from megatron_hybridep.megatron.arguments import parse

    inspect.getsource = _no_source  # this rank's process only
    args = parse(["--num-layers", "2", "--expert-model-parallel-size", "2"],
                 default_config=PRESET)
    return args.num_layers, args.expert_model_parallel_size


def test_ranks_parse_without_reading_class_sources():
    assert run_ranks(_parse_without_source, 2, timeout=120) == [(2, 2), (2, 2)]
