"""megatron-hybridep: HybridEP expert placement for Megatron-Core MoE training across data centres.

Importing the package is cheap and never touches CUDA, torch.distributed or Megatron; the Megatron
integration is registered by :func:`megatron_hybridep.megatron.register` (pretrain_moe.py calls it).
"""

__version__ = "0.1.0"
