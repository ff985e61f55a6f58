"""SLURM launch: the topology and plan pretrain_moe.py derives from an allocation plus a DC map, and
the sbatch template (scripts/slurm/pretrain_moe.sbatch) run with stand-ins for srun and scontrol.

The allocation: 4 nodes in 2 DCs (gpu-e01, gpu-e02 in east; gpu-w01, gpu-w02 in west, matched by
configs/slurm/dc_map.example.yaml) with 8 tasks (GPUs) per node: 32 ranks, levels dc x node x gpu.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_hybridep.megatron.arguments import parse
from megatron_hybridep.plan.plan import PlanError
from megatron_hybridep.train.planning import choose, topology_for
from tests.helpers import with_args

REPO = Path(__file__).resolve().parents[2]
SBATCH = REPO / "scripts" / "slurm" / "pretrain_moe.sbatch"
DC_MAP = REPO / "configs" / "slurm" / "dc_map.example.yaml"
CPU_PRESET = REPO / "configs" / "presets" / "cpu_demo.yaml"

HOSTS = ["gpu-e01", "gpu-e02", "gpu-w01", "gpu-w02"]
ALLOCATION = {"SLURM_JOB_NODELIST": "gpu-e[01-02],gpu-w[01-02]", "SLURM_NTASKS_PER_NODE": "8",
              "SLURM_TASKS_PER_NODE": "8(x4)", "SLURM_JOB_NUM_NODES": "4", "SLURM_NNODES": "4",
              "SLURM_NTASKS": "32", "SLURM_JOB_ID": "4242", "SLURM_CPUS_PER_TASK": "8"}
WORLD = 32

# A model whose routed tokens outweigh its experts (4 MiB of fp32 activations per rank and layer
# against 1 MiB per expert), with EP over all 32 ranks: across a 10 Gbit/s WAN the planner should
# move experts (domains that span the DCs) rather than tokens.
MODEL = ("--num-layers 2 --hidden-size 256 --ffn-hidden-size 512 --num-attention-heads 4 --seq-length 2048 "
         "--max-position-embeddings 2048 --micro-batch-size 1 --num-experts 32 --moe-router-topk 2 "
         "--moe-token-dispatcher-type hybridep --expert-model-parallel-size 32 --tokenizer-type NullTokenizer "
         "--vocab-size 256 --transformer-impl local --hybridep-throughput-tflops 300").split()


@pytest.fixture
def allocation(monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The environment SLURM sets for the allocation (and nothing left over from a real one)."""
    for key in list(os.environ):
        if key.startswith("SLURM_"):
            monkeypatch.delenv(key)
    for key, value in ALLOCATION.items():
        monkeypatch.setenv(key, value)
    return dict(ALLOCATION)


@pytest.fixture(scope="module")
def slurm_args() -> argparse.Namespace:
    # parse() does not read SLURM_*: the allocation is read when the topology is derived.
    return parse([*MODEL, "--hybridep-topology", "slurm", "--hybridep-dc-map", str(DC_MAP)])


def test_topology_from_the_allocation(allocation, slurm_args):
    topo = topology_for(slurm_args, WORLD)
    assert topo.level_names == ("dc", "node", "gpu")
    assert [lv.count for lv in topo.levels] == [2, 2, 8]
    assert topo.world_size == WORLD
    assert topo.name == "slurm:east,west" and str(DC_MAP) in topo.source
    # link parameters from the DC map's levels block
    assert [lv.bandwidth_gbps for lv in topo.levels] == [10, 200, 900]


def test_plan_for_the_allocation(allocation, slurm_args):
    auto = choose(slurm_args, WORLD)
    result = auto.result
    assert result is not None and auto.plan == result.best == result.chosen.plan
    assert auto.plan.level_names == ("dc", "node", "gpu") and auto.plan.level_counts == (2, 2, 8)
    # Over the slow WAN the planner moves experts: each domain spans the two DCs, so the token
    # all-to-all (the rails) stays inside a DC, and it predicts a gain over Megatron's plain EP.
    assert auto.plan.kind == "domains" and auto.plan.domain_sizes[0] == 2
    assert auto.dispatcher == "hybridep" and auto.megatron_ep_size == WORLD
    assert result.speedup(result.chosen) > 1.0

    ep = choose(with_args(slurm_args, hybridep_plan="ep"), WORLD)
    assert ep.plan.domain_sizes == (1, 1, 1) and ep.plan.label == "ep (S=1)" and ep.result is None

    replicated = choose(with_args(slurm_args, hybridep_plan="replicated"), WORLD)
    assert replicated.plan.kind == "replicated"
    assert (replicated.dispatcher, replicated.megatron_ep_size) == ("alltoall", 16)  # EP inside each DC


def test_slurm_without_a_dc_map_names_the_fix(allocation, slurm_args):
    with pytest.raises(PlanError, match=r"--hybridep-topology slurm needs --hybridep-dc-map FILE.*fix: see "
                                        r"configs/slurm/dc_map.example.yaml"):
        topology_for(with_args(slurm_args, hybridep_dc_map=None), WORLD)


def test_allocation_and_job_size_must_agree(allocation, slurm_args, monkeypatch):
    with pytest.raises(PlanError, match=r"2 dc x 2 node x 8 gpu = 32 ranks but the job has 16 ranks"):
        topology_for(slurm_args, 16)
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu-e01,gpu-w01,gpu-e02,gpu-w02")  # DCs interleaved
    with pytest.raises(PlanError, match=r"not contiguous.*gpu-e02"):
        topology_for(slurm_args, WORLD)


# ---- the sbatch template -------------------------------------------------------------------------
def test_sbatch_is_valid_bash():
    result = subprocess.run(["bash", "-n", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    header = [line for line in SBATCH.read_text().splitlines() if line.startswith("#SBATCH")]
    assert "#SBATCH --ntasks-per-node=8" in header and "#SBATCH --gpus-per-node=8" in header  # a task per GPU


def stand_ins(bin_dir: Path, out: Path) -> None:
    """scontrol prints the allocation's hosts; srun records its arguments and rendezvous env."""
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f'[ "$1 $2" = "show hostnames" ] && [ "$3" = "$SLURM_JOB_NODELIST" ] || exit 3\n'
        f"printf '%s\\n' {' '.join(HOSTS)}\n")
    # srun also appends one line per call (restart count, max restarts, port) to srun.calls and exits
    # with the next code listed in srun.exits (0 once the list is used up)
    (bin_dir / "srun").write_text(
        "#!/bin/bash\n"
        f'printf "%s\\0" "$@" > {shlex.quote(str(out / "srun.args"))}\n'
        f'printf "%s\\n" "$MASTER_ADDR" "$MASTER_PORT" "$CUDA_DEVICE_MAX_CONNECTIONS" '
        f'> {shlex.quote(str(out / "srun.env"))}\n'
        'echo "$HYBRIDEP_RESTART_COUNT $HYBRIDEP_MAX_RESTARTS $MASTER_PORT"'
        f' >> {shlex.quote(str(out / "srun.calls"))}\n'
        f'exits={shlex.quote(str(out / "srun.exits"))}\n'
        '[ -s "$exits" ] || exit 0\n'
        'code=$(head -n 1 "$exits"); sed -i 1d "$exits"; exit "$code"\n')
    for f in bin_dir.iterdir():
        f.chmod(0o755)


def run_sbatch(tmp_path: Path, env_changes: dict[str, str | None], *script_args: str,
               mkdir: bool = True) -> subprocess.CompletedProcess:
    bin_dir, out = tmp_path / "bin", tmp_path / "out"
    out.mkdir(exist_ok=not mkdir)
    stand_ins(bin_dir, out)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update(ALLOCATION, PATH=f"{bin_dir}:{env['PATH']}", HYBRIDEP_REPO=str(REPO), PYTHON="python3",
               PRESET=str(CPU_PRESET), DC_MAP=str(DC_MAP))
    for k, v in env_changes.items():
        if v is None:
            env.pop(k, None)
        else:
            env[k] = v
    return subprocess.run(["bash", str(SBATCH), *script_args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=60)


def test_sbatch_launches_pretrain_moe_with_flags_it_accepts(tmp_path, allocation):
    extra = ["--num-experts", "32", "--expert-model-parallel-size", "32"]  # sbatch's own args go to pretrain_moe.py
    result = run_sbatch(tmp_path, {}, *extra)
    assert result.returncode == 0, result.stdout + result.stderr
    master_addr, master_port, max_connections = (tmp_path / "out" / "srun.env").read_text().splitlines()
    assert master_addr == "gpu-e01"  # the first host of SLURM_JOB_NODELIST
    assert master_port == str(20000 + 4242 % 20000) and max_connections == "1"

    argv = (tmp_path / "out" / "srun.args").read_text().split("\0")[:-1]
    launcher, command = argv[:argv.index("python3")], argv[argv.index("python3") + 1:]
    assert "--kill-on-bad-exit=1" in launcher and "--distribution=block" in launcher
    assert command[0] == str(REPO / "pretrain_moe.py")
    flags = command[1:]
    assert flags[-len(extra):] == extra

    # Every flag of the srun command line is one pretrain_moe.py accepts (parse exits on unknown ones).
    args = parse(flags)
    assert (args.hybridep_topology, args.hybridep_dc_map, args.config) == ("slurm", str(DC_MAP), str(CPU_PRESET))
    assert (args.num_experts, args.expert_model_parallel_size) == (32, 32)  # command line over the preset
    choice = choose(args, int(allocation["SLURM_NTASKS"]))
    assert choice.topology.name == "slurm:east,west" and choice.topology.world_size == WORLD
    assert choice.plan.level_counts == (2, 2, 8)


@pytest.mark.parametrize(("change", "message"), [
    ({"PRESET": None}, r"PRESET: is not set; fix: PRESET=configs/presets/<model>.yaml"),
    ({"DC_MAP": "no-such-map.yaml"}, r"error: no-such-map.yaml not found"),
    ({"HYBRIDEP_REPO": "/nonexistent"}, r"pretrain_moe.py not found; fix: submit from the megatron-hybridep"),
])
def test_sbatch_stops_with_a_message(tmp_path, change, message):
    result = run_sbatch(tmp_path, change)
    assert result.returncode != 0
    assert re.search(message, result.stderr), result.stderr
    assert not (tmp_path / "out" / "srun.args").exists()


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_sbatch_shellcheck():
    result = subprocess.run(["shellcheck", "-S", "warning", str(SBATCH)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout


def _calls(tmp_path: Path) -> list[str]:
    return (tmp_path / "out" / "srun.calls").read_text().splitlines()


def test_sbatch_reruns_a_failed_step_with_the_restart_count(tmp_path, allocation):
    """--hybridep-max-restarts 2: the step fails once (a fault, exit 1) and is run again with
    HYBRIDEP_RESTART_COUNT=1 (pretrain_moe.py then loads --save) on the next port; the flag goes on."""
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "srun.exits").write_text("1\n")
    flags = ["--save", "ckpt", "--save-interval", "10", "--hybridep-max-restarts", "2"]
    result = run_sbatch(tmp_path, {}, *flags, mkdir=False)
    assert result.returncode == 0, result.stdout + result.stderr
    port = 20000 + 4242 % 20000
    assert _calls(tmp_path) == [f"0 2 {port}", f"1 2 {port + 1}"]
    assert re.search(r"\[sbatch\] restart 1/2: the srun step failed with exit code 1 after \d+ s; running it again",
                     result.stderr), result.stderr
    argv = (tmp_path / "out" / "srun.args").read_text().split("\0")[:-1]
    assert argv[-len(flags):] == flags
    # what pretrain_moe.py does with that environment: resume from --save, the flag agreeing with the loop
    from megatron_hybridep.train import restart

    args = parse(argv[argv.index("python3") + 2:])
    restart.check_launched(args, {"HYBRIDEP_MAX_RESTARTS": "2"})
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "latest_checkpointed_iteration.txt").write_text("10")
    args.save = str(tmp_path / "ckpt")
    assert restart.resume_on_restart(args, {"HYBRIDEP_RESTART_COUNT": "1"}) == 1 and args.load == args.save


@pytest.mark.parametrize(("max_restarts", "exits", "calls", "message"), [
    ("1", "1\n1\n", 2, r"the srun step failed with exit code 1; after 1 restart\(s\)"),
    ("3", "2\n", 1, r"exit code 2 is bad input, a rerun would repeat it"),
    (None, "1\n", 1, None),  # no restarts asked for: the step's failure is the job's, as before
])
def test_sbatch_stops_when_restarts_are_used_up_or_pointless(tmp_path, allocation, max_restarts, exits, calls,
                                                             message):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "srun.exits").write_text(exits)
    flags = [] if max_restarts is None else [f"--hybridep-max-restarts={max_restarts}"]
    result = run_sbatch(tmp_path, {}, *flags, mkdir=False)
    assert result.returncode == int(exits[0]) and len(_calls(tmp_path)) == calls, result.stderr
    if message:
        assert re.search(message, result.stderr), result.stderr
    else:
        assert "[sbatch] error" not in result.stderr and "restart" not in result.stderr


def test_sbatch_rejects_a_bad_restart_count(tmp_path, allocation):
    result = run_sbatch(tmp_path, {}, "--hybridep-max-restarts", "many")
    assert result.returncode == 1 and "--hybridep-max-restarts 'many'; fix: an integer >= 0" in result.stderr
    assert not (tmp_path / "out" / "srun.args").exists()
