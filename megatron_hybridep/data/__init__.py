"""Training data sources: the built-in synthetic corpus (Megatron's mock and indexed datasets are
used through megatron.core.datasets)."""
