"""sim/ is pure Python + numpy: importing it (and running its CLI module) never loads torch."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_sim_does_not_import_torch():
    code = ("import sys\n"
            "import megatron_hybridep.sim, megatron_hybridep.sim.cli, megatron_hybridep.sim.sweep, "
            "megatron_hybridep.sim.validate, megatron_hybridep.sim.paper, megatron_hybridep.sim.plot\n"
            "bad = [m for m in sys.modules if m == 'torch' or m.startswith(('torch.', 'megatron.'))]\n"
            "assert not bad, bad\n")
    env = dict(os.environ, PYTHONPATH=ROOT)
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=ROOT)
