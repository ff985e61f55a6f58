"""The codec's Triton kernels (with torch reference paths), imported as ``megatron_hybridep.kernels``.

Their source stays in the repository's top-level kernels/ folder (the project's layout), but is
not importable as a top-level ``kernels``: that name is another project's on the package index.
In a checkout (PYTHONPATH or ``pip install -e .``) this package points its path at that folder; a
built wheel holds the folder's files here instead (pyproject.toml's package-dir), so this file is
only used from a checkout."""

import os

__path__ = [os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "kernels")]
