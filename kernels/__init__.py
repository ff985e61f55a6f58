"""Triton kernels with torch reference paths (validated on CPU under TRITON_INTERPRET=1).

Imported as ``megatron_hybridep.kernels`` (megatron_hybridep/kernels/__init__.py), never as a
top-level ``kernels``: that name belongs to another package on the index."""
