"""benchmarks/time_to_loss.py's arithmetic (no testbed): the log it parses, the target and the
wall clock it counts."""

import importlib.util
from pathlib import Path

import pytest


@pytest.fixture(scope="module")
def ttl():
    path = Path(__file__).resolve().parents[2] / "benchmarks" / "time_to_loss.py"
    spec = importlib.util.spec_from_file_location("time_to_loss", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _line(i: int, loss: float, ms: float) -> str:  # train/reporting.py's per-iteration line
    return (f" iter {i:5d}/6 | loss {loss:7.4f} | step {ms:7.1f} ms | {1000:9.0f} tok/s | lr 3.00e-04 | "
            f"grad-norm {0.5:6.3f} | inter-DC 8.39 MB/iter | exposed comm {1.0:6.1f} ms | plan ep (S=1)")


def test_steps_and_seconds_to_the_target(ttl):
    log = "\n".join(_line(i, loss, ms) for i, loss, ms in
                    ((1, 5.0, 9000.0), (2, 4.0, 1000.0), (3, 3.0, 1000.0), (4, 2.0, 1200.0), (5, 1.0, 1000.0)))
    rows = ttl.parse_log(log)
    assert rows[0] == (1, 5.0, 9.0) and len(rows) == 5
    assert ttl.smooth([4.0, 2.0, 0.0], 2) == [4.0, 3.0, 1.0]
    hit = ttl.to_target(rows, target=2.5, window=2, warmup=1)
    # smoothed: 5, 4.5, 3.5, 2.5, 1.5 -> iteration 4; the first step counts as a typical one (1 s)
    assert hit["steps"] == 4 and hit["seconds"] == pytest.approx(1.0 + 1.0 + 1.0 + 1.2)
    assert hit["final"] == 1.5
    assert ttl.to_target(rows, target=0.5, window=2, warmup=1)["steps"] is None  # never reached


def test_every_system_trains_with_the_overlap_flag_and_the_same_data(ttl):
    table = ttl.systems(2, 4, 50.0, 10.0)
    assert set(table) == {"ep", "replicated", "hybridep", "hybridep-c", "pp", "auto", "auto-c"}
    assert "--overlap-grad-reduce" in ttl.MODEL
    assert table["hybridep-c"][-10:] == ["--hybridep-compression-ratio", "50", "--hybridep-grad-compression-ratio",
                                         "10", "--hybridep-max-compression-ratio", "0",
                                         "--hybridep-max-grad-compression-ratio", "0",  # what is asked, past the caps
                                         "--hybridep-grad-compression-values", "bf16"]  # the runtime's default
    assert table["auto-c"] == [*table["auto"], *table["hybridep-c"][-10:]]  # the planner prices the same ratios
    assert ttl.systems(2, 4)["hybridep-c"][-10:-6] == ["--hybridep-compression-ratio", "10",
                                                       "--hybridep-grad-compression-ratio", "4"]  # the default
    assert ttl.systems(2, 4, grad_values="same")["hybridep-c"][-1] == "same"  # the runs recorded before
    assert table["pp"][:2] == ["--moe-token-dispatcher-type", "alltoall"] and "--pipeline-model-parallel-size" in \
        table["pp"]


def test_the_target_is_the_references_loss_at_a_fraction_of_its_run(ttl):
    import argparse

    # pp: loss 5, 4, 3, 2 in 1 s steps; slow: loss 5, 4.5, 4, 3.5 in 0.5 s steps (converges more slowly)
    pp = [(i + 1, 5.0 - i, 1.0) for i in range(4)]
    slow = [(i + 1, 5.0 - 0.5 * i, 0.5) for i in range(4)]
    args = argparse.Namespace(reference="pp", target_at=0.5, iters=4, window=1, warmup=0, dcs=2, ranks_per_dc=2,
                              rate=10.0, global_batch=16, data_path="x", seed=1, repeats=1)
    text, numbers = ttl.report({"pp": [pp], "slow": [slow]}, args)
    assert numbers["target"] == 4.0 and numbers["reference"] == "pp"  # pp's loss at iteration 2
    assert numbers["systems"]["slow"]["steps"] == 3 and numbers["systems"]["slow"]["seconds"] == 1.5
    assert numbers["systems"]["pp"]["seconds"] == 2.0
    assert numbers["systems"]["slow"]["final_vs_ref_pct"] == pytest.approx((3.5 / 2.0 - 1) * 100)
    assert "| slow | 0.50 | 3 | 1.5 | 1.33x |" in text


def test_the_report_names_the_plan_that_ran(ttl):
    log = ("[layout] running TP1 PP1 EP4 DP4\n"
           "[pretrain_moe] plan: domains dc2 gpu1; domains [[0, 2], [1, 3]]; rails [[0, 1]]\n")
    assert ttl.chosen(log) == "TP1 PP1 EP4 DP4 / domains dc2 gpu1"  # three-word labels too
    assert ttl.chosen("[pretrain_moe] plan: ep (S=1); domains [[0]]") == "ep (S=1)"
    assert ttl.chosen("Megatron alltoall") == ""


def test_model_flags_follow_the_models_own(ttl, monkeypatch):
    import argparse

    from megatron_hybridep.testbed import launcher

    seen = {}

    class Testbed:
        def launch(self, cmd, **_):
            seen["cmd"] = [str(c) for c in cmd]
            raise RuntimeError("stop here")

    monkeypatch.setattr(launcher, "python_cmd", lambda *a: list(a))
    args = argparse.Namespace(model_flags="--hidden-size 32 --micro-batch-size 8", global_batch=16, iters=4, seed=1,
                              data_path="x", timeout=1)
    with pytest.raises(RuntimeError, match="stop here"):
        ttl.run_one(Testbed(), ["--expert-model-parallel-size", "4"], args, Path("t.yaml"), Path("unused.log"))
    cmd = seen["cmd"]
    model_end = cmd.index(ttl.MODEL[-1]) + 1
    assert cmd[model_end:model_end + 4] == ["--hidden-size", "32", "--micro-batch-size", "8"]  # later flags win
    assert cmd[-2:] == ["--expert-model-parallel-size", "4"]


def test_each_runs_log_is_kept(ttl, monkeypatch, tmp_path):
    """The logging rank's output (plan, phases, WAN bytes per iteration) stays beside the results."""
    import argparse

    from megatron_hybridep.testbed import launcher

    log = "\n".join(["[pretrain_moe] plan: domains dc2 gpu1; x", *(_line(i, 5.0 - i, 1000.0) for i in (1, 2))])

    class Result:
        ok, outputs = True, ["rank 1: nothing logged", log]

    class Testbed:
        def launch(self, cmd, **_):
            return Result()

    monkeypatch.setattr(launcher, "python_cmd", lambda *a: list(a))
    args = argparse.Namespace(model_flags="", global_batch=16, iters=2, seed=1, data_path="x", timeout=1)
    rows = ttl.run_one(Testbed(), [], args, Path("t.yaml"), tmp_path / "hybridep_repeat0.log")
    assert [r[0] for r in rows] == [1, 2]
    assert (tmp_path / "hybridep_repeat0.log").read_text() == log  # the rank that logged, not the first


@pytest.mark.parametrize(("flags", "burst"), [([], None), (["--burst-ms", "1"], 1.0)])
def test_the_links_burst_reaches_the_testbed(ttl, monkeypatch, tmp_path, flags, burst):
    """--burst-ms shapes the uplinks as `hybridep bench` does (a link that banks no idle time);
    without it the testbed's default bucket (>= 70 KB) stays, as in the runs recorded before."""
    import megatron_hybridep.testbed as testbed

    seen = {}

    def fake(config):
        seen["config"] = config
        raise RuntimeError("stop here")

    monkeypatch.setattr(testbed, "Testbed", fake)
    with pytest.raises(RuntimeError, match="stop here"):
        ttl.main([*flags, "--data-path", "x", "--out", str(tmp_path)])
    assert seen["config"].burst_ms == burst and seen["config"].rate_mbit == 50.0


def test_early_grad_return_reaches_the_compressed_systems_only(ttl):
    table = ttl.systems(2, 4, early=16.0)
    for name in ("hybridep-c", "auto-c"):
        assert table[name][-2:] == ["--hybridep-early-grad-return", "16"]
    assert all("--hybridep-early-grad-return" not in table[n] for n in ("ep", "replicated", "hybridep", "pp", "auto"))
    assert "--hybridep-early-grad-return" not in ttl.systems(2, 4)["hybridep-c"]  # pretrain_moe.py's auto
    assert ttl.systems(2, 4, early=0.0)["hybridep-c"][-2:] == ["--hybridep-early-grad-return", "0"]  # off, asked


def test_recorded_runs_join_the_table_only_when_comparable(ttl, tmp_path):
    import argparse
    import json

    same = {k: 1 for k in ttl.SAME_RUN} | {"model_flags": "--hidden-size 32", "burst_ms": None}
    path = tmp_path / "results.json"
    path.write_text(json.dumps({"args": same, "runs": {"replicated": [[[1, 5.0, 9.0], [2, 4.0, 9.5]]],
                                                       "hybridep-c": [[[1, 5.0, 5.0], [2, 4.1, 5.0]]]}}))
    args = argparse.Namespace(**same)
    got = ttl.recorded_runs([str(path)], args, {"hybridep-c"})
    assert got == {"replicated": [[(1, 5.0, 9.0), (2, 4.0, 9.5)]],
                   "hybridep-c (recorded)": [[(1, 5.0, 5.0), (2, 4.1, 5.0)]]}
    args.seed = 2  # other batches: the losses are not comparable
    with pytest.raises(SystemExit, match="seed was 1, this run has 2"):
        ttl.recorded_runs([str(path)], args, set())
