"""Readable logs: rank-identical warnings once, and the CPU run's Megatron argument table only on request."""

from __future__ import annotations

import logging
import warnings

import torch.distributed as dist

from megatron_hybridep.runtime import logs


def _levels(caplog, rank: int | None, monkeypatch) -> list[int]:
    monkeypatch.setattr(dist, "is_initialized", lambda: rank is not None)
    monkeypatch.setattr(dist, "get_rank", lambda *a, **k: rank)
    log = logging.getLogger("hybridep.test_logs")
    caplog.clear()
    with caplog.at_level(logging.DEBUG, logger=log.name):
        logs.warn_once(log, "plan %s is slower", "x")
    return [r.levelno for r in caplog.records if r.getMessage() == "plan x is slower"]


def test_warn_once_warns_on_rank_zero_only(caplog, monkeypatch):
    assert _levels(caplog, None, monkeypatch) == [logging.WARNING]  # no process group: one process
    assert _levels(caplog, 0, monkeypatch) == [logging.WARNING]
    assert _levels(caplog, 3, monkeypatch) == [logging.DEBUG]


def test_known_harmless_warnings_are_filtered():
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        logs.quiet_known_warnings()
        warnings.warn("Transformer Engine and Apex are not installed. Falling back", UserWarning, stacklevel=1)
        warnings.warn("something else", UserWarning, stacklevel=1)
    assert [str(w.message) for w in seen] == ["something else"]


def test_torchs_no_cuda_runtime_line_is_dropped():
    logs.quiet_known_warnings()
    log = logging.getLogger("torch.utils.cpp_extension")
    line = logging.makeLogRecord({"msg": "No CUDA runtime is found, using CUDA_HOME='%s'", "args": ("/usr/local",)})
    assert not log.filter(line)
    assert log.filter(logging.makeLogRecord({"msg": "Emitting ninja build file"}))


def test_cpu_loop_drops_megatron_argument_table(capsys):
    from megatron_hybridep.train.cpu_loop import _without_args_table

    def validate_args(args):
        print("using world size: 4")
        print("------------------------ arguments ------------------------")
        print("  adam_beta1 ...................................... 0.9")
        print("-------------------- end of arguments ---------------------")
        print("using torch.float32 for parameters ...")

    _without_args_table(validate_args, None)
    assert capsys.readouterr().out.splitlines() == ["using world size: 4", "using torch.float32 for parameters ..."]


def test_importing_logs_installs_nothing_and_the_fork_servers_preload_does():
    import subprocess
    import sys

    code = ("import warnings; n = len(warnings.filters); import megatron_hybridep.runtime.logs; "
            "a = len(warnings.filters); import megatron_hybridep.train.quiet_imports; "
            "print(a - n, len(warnings.filters) - a)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out[0] == "0" and int(out[1]) == len(logs.HARMLESS)
