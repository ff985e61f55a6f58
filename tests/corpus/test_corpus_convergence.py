"""benchmarks/convergence.py on real text: --data-path / --corpus, the model-size flags, the summary
statistics, and one tiny run on a prepared file (4 CPU ranks, 2 steps)."""

from __future__ import annotations

import csv
import importlib.util
import os
import statistics
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


# Imported by name from benchmarks/ on sys.path: the ranks are spawned processes that unpickle
# convergence.train by its module name (spawn hands them this sys.path).
sys.path.append(str(ROOT / "benchmarks"))
conv = importlib.import_module("convergence")


def test_default_stays_the_markov_corpus_and_the_toy_model():
    a = conv.parse_args([])
    assert not a.text and a.data_path is None and a.corpus is None and a.vocab == 64
    assert a.model == dict(num_layers=2, num_experts=8, top_k=2, seq_length=64, lr=3e-3)
    assert a.schedule is None and a.domain == (2, 1)
    assert conv.load_text(a) is None


def test_text_flags_set_the_byte_vocabulary_and_model_flags_reach_the_model():
    a = conv.parse_args(["--corpus", "book.txt", "--layers", "4", "--experts", "16", "--seq-length", "128"])
    assert a.text and a.corpus == "book.txt" and a.vocab == 256
    assert a.model == dict(num_layers=4, num_experts=16, top_k=2, seq_length=128, lr=3e-3)
    b = conv.parse_args(["--data-path", "/x/austen", "--vocab", "512"])
    assert b.text and b.data_path == "/x/austen" and b.vocab == 512


@pytest.mark.parametrize("argv, message", [
    (["--corpus", "a.txt", "--data-path", "p"], "not allowed with argument"),
    (["--corpus", "a.txt", "--vocab", "64"], "needs --vocab 256 or more"),
    (["--experts", "6"], "multiple of the 4 ranks"),
    (["--topk", "9"], "--topk between 1 and --experts"),
    (["--lr-warmup-iters", "10"], "need --lr-decay-style linear or cosine"),
    (["--min-lr", "1e-4"], "need --lr-decay-style linear or cosine"),
    (["--lr-decay-style", "cosine", "--steps", "10", "--lr-warmup-iters", "10"], "--lr-warmup-iters must be"),
    (["--domain", "1,1"], "--domain must be DC,GPU"),
    (["--domain", "4,1"], "--domain must be DC,GPU"),
    (["--domain", "two"], "--domain must be DC,GPU"),
])
def test_bad_flag_combinations_are_refused(argv, message, capsys):
    with pytest.raises(SystemExit):
        conv.parse_args(argv)
    assert message in capsys.readouterr().err


def test_missing_data_is_an_error_naming_the_fix_before_any_rank_starts(tmp_path, capsys):
    assert conv.main(["--data-path", str(tmp_path / "none")]) == 2
    assert "scripts/prepare_corpus" in capsys.readouterr().err
    assert conv.main(["--corpus", str(tmp_path / "none.txt")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_lr_schedule_is_megatrons_warmup_then_decay_over_the_run():
    """--lr-decay-style: Megatron's scheduler from 0 over the warm-up to --lr, then down to --min-lr
    (default lr / 10) at the last step; the floor also reaches the optimizer's parameter groups."""
    from types import SimpleNamespace

    a = conv.parse_args(["--steps", "20", "--lr", "2e-3", "--lr-decay-style", "cosine", "--lr-warmup-iters", "4"])
    assert a.schedule == dict(style="cosine", warmup=4, min_lr=2e-4) and a.model["min_lr"] == 2e-4
    groups = [{"lr": 0.0, "max_lr": a.lr, "min_lr": a.model["min_lr"], "weight_decay": 0.0}]
    sched = conv.lr_schedule(SimpleNamespace(param_groups=groups), a.lr, a.steps, **a.schedule)
    seen = [groups[0]["lr"]]
    for _ in range(a.steps):
        sched.step(1)
        seen.append(groups[0]["lr"])
    assert seen[0] == 0.0 and seen[2] == pytest.approx(1e-3) and seen[4] == pytest.approx(2e-3)
    assert seen[12] == pytest.approx(2e-4 + 0.5 * 1.8e-3)  # half-way through the cosine
    assert seen[20] == pytest.approx(2e-4) and all(x >= y for x, y in zip(seen[4:], seen[5:], strict=False))
    assert conv.parse_args(["--lr-decay-style", "linear", "--min-lr", "0"]).schedule["min_lr"] == 0.0


def test_steps_to_the_same_loss_counts_each_seed_against_its_own_reference():
    """A system whose curve is alltoall's stretched 1.25x in steps needs 1.25x the steps; one that
    stays above the target is 'never' and left out of the mean, which says so."""
    steps, window = 100, 1  # a longer trailing mean would lag both curves by a few steps
    ref = [5.0 - 0.03 * i for i in range(steps)]
    slow = [5.0 - 0.03 * i / 1.25 for i in range(steps)]
    curves = {("alltoall", 1): ref, ("alltoall", 2): ref, ("slow", 1): slow, ("slow", 2): slow,
              ("stuck", 1): slow, ("stuck", 2): [5.0] * steps}
    out = conv.steps_to_same_loss(curves, ["alltoall", "slow", "stuck"], [1, 2], steps, window, 0.8)
    assert "loss at step 80" in out
    slow_line, stuck_line = out.splitlines()[-2:]
    assert "reached 2/2; 1.250x +- 0.000" in slow_line
    assert "reached 1/2; those: 1.250x" in stuck_line and "never" in stuck_line
    with pytest.raises(SystemExit):
        conv.parse_args(["--target-at", "1"])


def test_flatness_is_the_drop_over_the_runs_last_fifth_per_seed():
    """A curve still falling linearly drops by its slope over the tail; a flat one by 0."""
    steps, window = 100, 1
    falling = [5.0 - 0.01 * i for i in range(steps)]  # step 80: 4.21, step 100: 4.01
    curves = {("alltoall", 1): falling, ("alltoall", 2): [2.0] * steps}
    out = conv.flatness(curves, ["alltoall"], [1, 2], steps, window)
    assert "last 20 steps" in out and "step 80 -> 100" in out
    drop = (4.21 - 4.01) / 4.21 * 100
    assert f"alltoall         {drop / 2:.2f}% ({drop:.2f}, 0.00)" in out


def test_interval_is_the_t_interval_of_the_mean():
    lo, hi = conv.interval95([1.0, 2.0, 3.0])  # mean 2, sd 1, t(2) = 4.303
    assert lo == pytest.approx(2 - 4.303 / 3**0.5) and hi == pytest.approx(2 + 4.303 / 3**0.5)
    values = [0.1 * i for i in range(40)]  # past the table: the normal 1.96
    lo, hi = conv.interval95(values)
    assert hi - lo == pytest.approx(2 * 1.96 * statistics.stdev(values) / 40**0.5)


@pytest.mark.slow
def test_tiny_run_on_a_text_file(tmp_path, capsys):
    text = "".join(f"Paragraph {i}: the quick brown fox jumps over the lazy dog.\n\n" for i in range(200))
    (tmp_path / "fox.txt").write_text(text)
    out, cache = tmp_path / "out", tmp_path / "cache"
    rc = conv.main(["--corpus", str(tmp_path / "fox.txt"), "--cache-dir", str(cache), "--out", str(out),
                    "--steps", "2", "--window", "1", "--systems", "alltoall"])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "byte unigram entropy" in printed and "Megatron alltoall EP" in printed
    [prefix] = [p[:-4] for p in os.listdir(cache) if p.endswith(".bin")]
    assert prefix.startswith("fox-")
    with open(out / f"convergence_{prefix}_random_50x.csv") as f:
        rows = list(csv.reader(f))
    assert rows[0] == ["step", "alltoall@1234"] and len(rows) == 3
    assert all(0 < float(r[1]) < 10 for r in rows[1:])  # a byte model starts near ln(256) = 5.5


def test_ratio_systems_name_the_codec_settings():
    w, g, both, cold = (conv.system_config(s) for s in ("w10", "g50", "w50g50", "w10-cold"))
    assert (w.compression_ratio, w.grad_compression_ratio, w.exact_first_gather) == (10, 1, True)
    assert (g.compression_ratio, g.grad_compression_ratio) == (1, 50)
    assert (both.compression_ratio, both.grad_compression_ratio) == (50, 50)
    assert not cold.exact_first_gather
    assert conv.system_config("alltoall") is None and conv.system_config("-cold") is None
    # bare names keep the gradient's fp32 values (the curves recorded before); -b16: the runtime's default
    assert g.grad_values == "same" and conv.system_config("w10g4-b16").grad_values == "bf16"
    with pytest.raises(SystemExit):
        conv.parse_args(["--systems", "alltoall,x10"])


def test_earlier_curves_are_reused_not_rerun(tmp_path, capsys):
    """--from-csv: runs an earlier CSV holds are not repeated (no rank starts here); a suffix
    renames its systems, so a run from before a codec change can sit beside a new one."""
    steps = 3
    path = tmp_path / "old.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "alltoall@1", "w10@1", "alltoall@2", "w10@2"])
        for i in range(steps):
            w.writerow([i + 1, 2.0, 2.2, 2.0, 2.1])
    assert conv.load_curves(f"{path}:-cold", steps)[("w10-cold", 2)] == [2.1] * steps
    rc = conv.main(["--steps", str(steps), "--window", "1", "--seeds", "1,2", "--systems", "alltoall,w10-cold",
                    "--from-csv", f"{path}:-cold", "--from-csv", str(path), "--out", str(tmp_path / "out")])
    assert rc == 0
    printed = capsys.readouterr().out
    assert "HybridEP weights 10x, cold start" in printed and "+7.50% +- 3.54" in printed  # +10%, +5%


def test_recorded_only_refuses_to_train_a_missing_curve(tmp_path, capsys):
    """A table meant to come from recorded curves must not start ranks when one is missing."""
    path = tmp_path / "old.csv"
    with open(path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "alltoall@1", "w10@1"])
        for i in range(3):
            w.writerow([i + 1, 2.0, 2.2])
    argv = ["--steps", "3", "--window", "1", "--seeds", "1", "--from-csv", str(path), "--recorded-only",
            "--out", str(tmp_path / "out")]
    assert conv.main([*argv, "--systems", "alltoall,w10,g10"]) == 2
    assert "--recorded-only: the --from-csv files hold no g10@1; fix" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()
    assert conv.main([*argv, "--systems", "alltoall,w10"]) == 0
