"""`hybridep bench`: HybridEP against Megatron EP on the emulated testbed (testbed/), driven by the
training harness (train/). See docs/bench.md.

- cli.py: the command; config.py: options and the traffic sweep
- session.py: the parent's side of the control protocol (shaping, planner); control.py: the socket
- worker.py: one rank (python -m megatron_hybridep.bench.worker)
- predict.py: cost model -> predicted step per point; analysis.py, report.py: rows, targets, CSV/PNG
"""
