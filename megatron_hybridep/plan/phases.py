"""The one vocabulary of iteration phases, shared by the cost model (plan/cost.py), the simulator
(sim/), the runtime's measurements (runtime/instrument.py Stats) and the bench. Members are strings
(``StrEnum``), so dict keys, CSV columns and JSON written with them read as before.

Two granularities use the same names: the exposed-time phases (``EXPOSED``: the cost model and the
simulator report these, and they sum to the iteration time) and the collectives the runtime times
one call at a time. A token all-to-all is measured per call as TOKEN_DISPATCH / TOKEN_COMBINE (its
backward transposes as TOKEN_A2A_BWD), priced per direction as TOKEN_A2A_FWD / TOKEN_A2A_BWD, and per
topology level (and by the bench's prediction) as TOKEN_A2A, both directions together. Torch-free."""

from __future__ import annotations

from enum import StrEnum


class Phase(StrEnum):
    PRE_COMPUTE = "pre_compute"                        # attention, router, norms: forward + backward
    EXPERT_COMPUTE = "expert_compute"                  # expert MLPs: forward + backward
    TOKEN_A2A = "token_a2a"                            # every token all-to-all, both directions
    TOKEN_A2A_FWD = "token_a2a_fwd"                    # forward dispatch + combine
    TOKEN_A2A_BWD = "token_a2a_bwd"                    # their transposes in the backward pass
    TOKEN_DISPATCH = "token_dispatch"                  # one measured dispatch all-to-all
    TOKEN_COMBINE = "token_combine"                    # one measured combine all-to-all
    EXPERT_ALLGATHER = "expert_allgather"              # borrowed expert copies gathered in a domain
    GRAD_RETURN = "grad_return"                        # their gradients returned to the owners
    SHARED_SYNC = "shared_sync"                        # shared-expert gradients across the domain
    DENSE_GRAD_ALLREDUCE = "dense_grad_allreduce"      # non-expert gradients across data parallelism
    EXPERT_GRAD_ALLREDUCE = "expert_grad_allreduce"    # expert gradients across expert-data parallelism
    REPLICA_WEIGHTS = "replica_weights"                # hot replicas' weights sent to their hosts
    REPLICA_GRAD_RETURN = "replica_grad_return"        # and their gradients sent back
    PIPELINE_BUBBLE = "pipeline_bubble"                # stages idle while the pipeline fills and drains
    PIPELINE_SEND = "pipeline_send"                    # what activation / gradient sends between stages add


# exposed-time phases, in the order they are reported; they sum to the iteration time
EXPOSED: tuple[Phase, ...] = (
    Phase.PRE_COMPUTE, Phase.EXPERT_COMPUTE, Phase.TOKEN_A2A_FWD, Phase.TOKEN_A2A_BWD, Phase.EXPERT_ALLGATHER,
    Phase.GRAD_RETURN, Phase.SHARED_SYNC, Phase.DENSE_GRAD_ALLREDUCE, Phase.EXPERT_GRAD_ALLREDUCE)
# what hot replicas add to EXPOSED (plan/hot.py)
REPLICA: tuple[Phase, ...] = (Phase.REPLICA_WEIGHTS, Phase.REPLICA_GRAD_RETURN)
# what pipeline parallelism adds to EXPOSED (plan/pipeline.py; only with PP > 1)
PIPELINE: tuple[Phase, ...] = (Phase.PIPELINE_BUBBLE, Phase.PIPELINE_SEND)
# the runtime's collectives the training step waits on (the rest are prefetched or overlapped)
BLOCKING: tuple[Phase, ...] = (Phase.TOKEN_DISPATCH, Phase.TOKEN_COMBINE, Phase.TOKEN_A2A_BWD, Phase.GRAD_RETURN)

__all__ = ["BLOCKING", "EXPOSED", "PIPELINE", "REPLICA", "Phase"]
