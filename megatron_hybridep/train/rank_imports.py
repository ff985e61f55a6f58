"""What every rank imports, which the fork servers import once: train/launch.py's for local ranks,
the testbed's warm host (testbed/warm_host.py) for ranks in DC namespaces. Torch-free, so a launcher
can name the list without importing it.

Each rank then starts in ~0.1 s instead of re-importing torch and Megatron (~9 CPU-s on these machines).
quiet_imports first, so its warning filters cover those imports; megatron.training too: pretrain_moe's
ranks run its loop and checkpointing (1 CPU-s more per rank); warm_ranks last: the start-up work every
rank would repeat (its parser, lazy imports; ~0.7 CPU-s).
"""

PRELOAD = ["megatron_hybridep.train.quiet_imports", "torch", "torch.distributed",
           "megatron.core.transformer.moe.moe_layer", "megatron.core.models.gpt.gpt_model",
           "megatron.core.distributed", "megatron.core.optimizer", "megatron.training.training",
           "megatron_hybridep.train.warm_ranks"]
