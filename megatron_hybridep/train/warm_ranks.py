"""Imported last by the ranks' fork server (train/launch.py PRELOAD), which can only import modules:
does once there the start-up work every forked rank would otherwise repeat (~0.7 CPU-s per rank,
about a third of a short test run's CPU time):

- Megatron's argument parser: each rank parses its flags, and a cold build reads Megatron's config
  classes' sources (megatron/arguments.py keeps what it read for the process);
- the imports a rank makes lazily (Megatron's optimizer on first use, the CPU loop).
"""

import megatron.core.models.mimo  # noqa: F401 - get_megatron_optimizer imports it on first use

import megatron_hybridep.train.cpu_loop  # noqa: F401
from megatron_hybridep.megatron.arguments import build_parser

build_parser()
