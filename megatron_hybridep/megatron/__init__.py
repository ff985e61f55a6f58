"""Megatron-Core glue: the only package that touches Megatron internals."""
