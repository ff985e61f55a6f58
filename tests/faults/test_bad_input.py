"""Bad input to pretrain_moe.py through its local launcher: one line naming the flag and the fix,
no traceback, and no rank started when the parent can tell (issue 16, section 3)."""

import os
import re

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _main(argv, capsys, monkeypatch):
    import pretrain_moe
    from megatron_hybridep.train import launch

    started = []
    monkeypatch.setattr(launch, "run_ranks", lambda *a, **k: started.append(a) or pytest.fail("ranks started"))
    rc = pretrain_moe.main(argv)
    out = capsys.readouterr()
    return rc, out.out, out.err, started


@pytest.mark.parametrize("argv, words", [
    (["--train-iters", "3"], ["lr_warmup_steps < self.lr_decay_steps", "--lr-warmup-iters 20", "--train-iters 3",
                              "fix"]),
    (["--hybridep-plan", "{bad_json}"], ["--hybridep-plan", "not valid JSON", "fix"]),
    (["--hybridep-topology", "{missing}"], ["--hybridep-topology", "fix"]),
    (["--hybridep-nproc", "3"], ["3 ranks", "fix"]),
    (["--num-experts", "6"], ["fix"]),
    (["--config", "{missing}"], ["--config", "not found", "fix"]),
])
def test_bad_input_is_one_line_before_any_rank(argv, words, tmp_path, capsys, monkeypatch):
    bad = tmp_path / "plan.json"
    bad.write_text('{"domains": ')
    argv = [a.format(bad_json=bad, missing=tmp_path / "missing.yaml") for a in argv]
    rc, out, err, started = _main(argv, capsys, monkeypatch)
    assert rc == 2 and not started
    # (torch's C++ log line at first import is not ours: pretrain_moe.py itself silences it)
    lines = [x for x in err.splitlines() if x.strip() and not re.match(r"[WI]\d{4} ", x)]
    assert len(lines) == 1 and lines[0].startswith("pretrain_moe.py: error: "), err
    assert "Traceback" not in err + out
    for w in words:
        assert w in lines[0], lines[0]


def test_bad_flag_value_is_argparse_one_liner(capsys, monkeypatch):
    rc, _, err, started = _main(["--hybridep-stall-timeout", "-5"], capsys, monkeypatch)
    assert rc == 2 and not started
    assert "argument --hybridep-stall-timeout" in err and "fix" in err and "Traceback" not in err


def test_internal_failure_names_where_it_came_from_and_keeps_the_traceback(capsys, monkeypatch):
    """Not bad input (here as torch's CUDA check inside Megatron once failed the parent's preflight):
    still one line, but naming where it was raised, with the full traceback in a file."""
    from megatron_hybridep.train import cpu_loop

    def no_driver(*args, **kwargs):
        raise RuntimeError("Found no NVIDIA driver on your system.")

    monkeypatch.setattr(cpu_loop, "plan_job", no_driver)
    rc, out, err, started = _main([], capsys, monkeypatch)
    assert rc == 1 and not started
    lines = [x for x in err.splitlines() if x.strip() and not re.match(r"[WI]\d{4} ", x)]
    assert len(lines) == 1 and "Traceback" not in err + out, err
    assert "RuntimeError: Found no NVIDIA driver" in lines[0], lines[0]
    assert "tests/faults/test_bad_input.py:" in lines[0] and "in no_driver()" in lines[0], lines[0]
    report = lines[0].rsplit("full traceback: ", 1)[1].rstrip(")")
    text = open(report).read()
    os.unlink(report)
    assert "Traceback" in text and "in preflight" in text and "in no_driver" in text, text


def test_error_only_a_rank_can_see_is_printed_once(tmp_path, capsys):
    import pretrain_moe

    rc = pretrain_moe.main(["--train-iters", "2", "--lr-warmup-iters", "1", "--hybridep-nproc", "2",
                            "--expert-model-parallel-size", "2", "--global-batch-size", "8",
                            "--load", str(tmp_path / "nothing"), "--exit-on-missing-checkpoint"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("pretrain_moe.py: error")]
    assert rc == 1 and len(lines) == 1, err
    assert "rank 0:" in lines[0] and "--load" in lines[0] and "fix" in lines[0] and "Traceback" not in err
    report = lines[0].rsplit("report: ", 1)[1].rstrip(")")
    assert "Traceback" in open(report).read()  # the full reports are kept, in a file
    os.unlink(report)
