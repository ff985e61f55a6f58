"""Property: a random mutation of a valid topology YAML, model YAML, plan JSON or --hybridep-* flag
either works or fails with one PlanError/argparse line naming the field, never another exception
(a traceback), and never starts a rank or a collective (issue 16, section 3)."""

import copy
import json
import math
import os
import re

import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from megatron_hybridep.plan.errors import PlanError
from megatron_hybridep.plan.plan import Plan
from megatron_hybridep.plan.topology import Topology
from megatron_hybridep.plan.workload import Workload

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOPOLOGY = yaml.safe_load(open(os.path.join(REPO, "configs", "topologies", "2dc_x_2.yaml")))
MODEL = yaml.safe_load(open(os.path.join(REPO, "configs", "models", "tiny-cpu.yaml")))
PLAN = json.loads(Plan.grid((2, 2), (2, 1), 8, ("dc", "gpu")).to_json())
BAD_VALUES = [None, -1, 0, 0.5, 1e30, math.nan, math.inf, "x", "", True, [], {}, [1, 2], {"a": 1}]
SETTINGS = settings(max_examples=150, deadline=2000, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


def _paths(value, prefix=()):
    """Every (path, key) into nested dicts/lists."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*prefix, k)
            yield from _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*prefix, i)
            yield from _paths(v, (*prefix, i))


@st.composite
def mutated(draw, valid):
    doc = copy.deepcopy(valid)
    path = draw(st.sampled_from(list(_paths(valid))))
    parent = doc
    for key in path[:-1]:
        parent = parent[key]
    how = draw(st.sampled_from(["delete", "replace", "add"]))
    if how == "delete":
        del parent[path[-1]]
    elif how == "replace":
        parent[path[-1]] = draw(st.sampled_from(BAD_VALUES) | st.integers(-5, 100))
    elif isinstance(parent, dict):
        parent["unexpected_key"] = 1
    else:
        parent.append(draw(st.sampled_from(BAD_VALUES)))
    return doc, path


def _names_a_field(message, path):
    keys = [str(k) for k in path if not isinstance(k, int)]
    return any(k in message for k in keys) or "unexpected_key" in message or re.search(r"\w+\.\w+|\w+\[\d+\]", message)


def _check(load, doc, path):
    try:
        load(doc)
    except PlanError as e:
        message = str(e)
        assert "\n" not in message.strip(), message
        assert _names_a_field(message, path), (message, path)


@SETTINGS
@given(mutated(TOPOLOGY))
def test_mutated_topology_works_or_names_the_field(case):
    _check(Topology.from_dict, *case)


@SETTINGS
@given(mutated(MODEL))
def test_mutated_model_works_or_names_the_field(case):
    _check(Workload.from_dict, *case)


@SETTINGS
@given(mutated(PLAN))
def test_mutated_plan_works_or_names_the_field(case):
    _check(Plan.from_dict, *case)


HYBRIDEP_FLAGS = ["--hybridep-topology", "--hybridep-plan", "--hybridep-compression-ratio",
                  "--hybridep-grad-compression-ratio", "--hybridep-grad-compression-warmup",
                  "--hybridep-grad-compression-values",
                  "--hybridep-shared-refresh-interval",
                  "--hybridep-residual-base", "--hybridep-throughput-tflops", "--hybridep-replan-interval",
                  "--hybridep-replan-horizon", "--hybridep-replan-replicas", "--hybridep-stall-timeout",
                  "--hybridep-nproc", "--hybridep-dc-map", "--hybridep-max-restarts"]
FLAG_VALUES = ["-1", "0", "0.5", "nan", "inf", "x", "", "3", "1e9", "/nonexistent.yaml", "slurm", "replicated"]


class _Launched(Exception):
    pass


# Each example parses Megatron's full argument set and plans (~seconds): few examples, no deadline.
@settings(max_examples=5, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(st.sampled_from(HYBRIDEP_FLAGS), st.sampled_from(FLAG_VALUES))
def test_mutated_hybridep_flag_works_or_is_one_line_before_any_rank(flag, value):
    import contextlib
    import io

    import pretrain_moe
    from megatron_hybridep.train import launch

    def launched(*args, **kwargs):
        raise _Launched  # valid input: the ranks would start now (none does here)

    saved, launch.run_ranks = launch.run_ranks, launched
    err, out = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
            rc = pretrain_moe.main([flag, value])
    except _Launched:
        return
    except SystemExit as e:  # argparse exits from inside parse_args
        rc = e.code
    finally:
        launch.run_ranks = saved
    lines = [x for x in err.getvalue().splitlines() if x.strip() and not re.match(r"[WI]\d{4} |usage:|  ", x)]
    assert rc == 2 and len(lines) == 1, (flag, value, err.getvalue())
    assert "Traceback" not in err.getvalue()
    assert flag in lines[0] or flag[2:].replace("-", "_") in lines[0], (flag, value, lines[0])


def test_a_world_the_ep_size_does_not_divide_names_both_flags(capsys):
    """--hybridep-nproc 3 with the preset's EP 4: the planner's "ep_size" is a flag's value."""
    import pretrain_moe

    assert pretrain_moe.main(["--hybridep-nproc", "3"]) == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert "--expert-model-parallel-size 4 with --hybridep-nproc 3" in line and "fix" in line, line
