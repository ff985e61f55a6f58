"""HybridEP's runtime: takes a Plan (plan/) and tensors, and moves experts and tokens with
torch.distributed. Nothing here imports Megatron; megatron/ wires it into Megatron-Core's MoE layer.

- context.py: the job-wide runtime (plans, process groups, active plan, MoE layers in order), held
  with the process's other mutable state (measurement, layer counter, heartbeat) in process_context()
- groups.py: a plan's process groups (domains: expert all-gather; rails: token all-to-all)
- migration.py, borrowed.py: gather domain peers' experts, return their gradients to the owners
- replication.py: hot-expert replicas (plan.replicas)
- compression.py: the expert codec (weight_codec.py, shared_expert.py, error_feedback.py; its wire
  format is plan/wire.py)
- scheduler.py: re-plans while training from what instrument.py measures (plan/phases.py names)
- numerics.py: finite-value checks; logs.py: warnings once
"""
