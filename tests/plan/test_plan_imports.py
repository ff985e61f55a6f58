"""plan/ must work without torch, torch.distributed or Megatron (laptops, the simulator, the CLI)."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import sys
from megatron_hybridep.plan import choose_plan, Topology, Workload
import megatron_hybridep.plan.cli, megatron_hybridep.plan.slurm, megatron_hybridep.plan.pairs
topo = Topology.from_yaml('configs/topologies/2dc_x_2.yaml')
r = choose_plan(topo, Workload.from_yaml('configs/models/tiny-cpu.yaml'))
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine'))
print(r.best.label)
sys.exit(1 if bad else 0)
"""


def test_plan_imports_neither_torch_nor_megatron():
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


WALK = """
import importlib, pkgutil, sys
import megatron_hybridep.plan, megatron_hybridep.sim
names = [m.name for pkg in (megatron_hybridep.plan, megatron_hybridep.sim)
         for m in pkgutil.iter_modules(pkg.__path__, pkg.__name__ + '.')]
for name in names:
    importlib.import_module(name)
bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'megatron', 'transformer_engine'))
print(len(names), bad)
sys.exit(1 if bad or 'megatron_hybridep.plan.phases' not in names or 'megatron_hybridep.plan.wire' not in names else 0)
"""


def test_every_plan_and_sim_module_imports_without_torch():
    """Each module of plan/ and sim/ (phases and wire included), not only the ones the planner uses."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    proc = subprocess.run([sys.executable, "-c", WALK], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
