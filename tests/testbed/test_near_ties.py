"""benchmarks/near_ties.py: the near-tie tally over recorded bench reports (pure text parsing)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HEAD = ("pt tokens  traffic  system      plan              median ms     [min-max]  vs EP  pred ms    err  uncal\n"
        + "-" * 80 + "\n")


def _load():
    spec = importlib.util.spec_from_file_location("near_ties", REPO / "benchmarks" / "near_ties.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _row(pt, tokens, system, plan, measured, predicted):
    return (f"{pt:2d} {tokens:6d}    1.0MB  {system:11s} {plan:17s} {measured:>9s} [1-2]  1.00x  {predicted:>9s} "
            "+1.0%  +1.0%     1.0/1.0\n")


def test_a_near_tie_is_counted_with_its_measured_winner(tmp_path, capsys):
    nt = _load()
    report = HEAD + "".join([
        _row(0, 32, "alltoall EP", "ep", "2,562", "2,539"),       # priced 1% slower than H-c: a near-tie
        _row(0, 32, "HybridEP-c", "domains dc2 gpu1", "2,293", "2,513"),
        _row(0, 32, "replicated", "replicated", "2,668", "2,698"),  # priced 7% slower: not a near-tie
        _row(1, 1024, "replicated", "replicated", "3,988", "3,862"),
        _row(1, 1024, "HybridEP", "domains dc2 gpu1", "4,100", "3,807"),  # Megatron measured faster
        _row(1, 1024, "PP per DC", "PP2 EP2", "10.1s", "10.0s"),
    ])
    ties = nt.near_ties(report, 0.05)
    assert ties == [("32", "HybridEP-c", "alltoall EP", 2293.0, 2513.0, 2562.0, 2539.0),
                    ("1024", "HybridEP", "replicated", 4100.0, 3807.0, 3988.0, 3862.0)]
    assert nt.near_ties(report, 0.10)[1][2] == "replicated" and len(nt.near_ties(report, 0.10)) == 3
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "report.txt").write_text(report)
    (tmp_path / "old_report.txt").write_text(report)
    assert nt.main([str(tmp_path), str(tmp_path / "run")]) == 0  # a folder given twice: counted once
    out = capsys.readouterr().out
    assert "2 reports" in out
    assert "HybridEP-c HybridEP faster at 2: by 1.12-1.12x" in out
    assert "HybridEP   Megatron faster at 2: by 1.03-1.03x" in out
