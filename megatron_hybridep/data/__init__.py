"""Training data sources: the built-in synthetic corpus, and real text as byte tokens in Megatron's
indexed-dataset format (text: format and preparation; austen: the Debian-packaged novels; prepare:
the command; windows: batches for benchmark loops). Megatron's mock and indexed datasets are used
through megatron.core.datasets."""
