"""Triton kernels with torch reference paths (validated on CPU under TRITON_INTERPRET=1)."""
