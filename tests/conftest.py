import getpass
import os
import tempfile
import warnings

# Megatron warns at import about missing TransformerEngine/Apex: expected on CPU.
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
# torch.compile's on-disk cache (Megatron compiles its expert-bias update) is not keyed on
# ATEN_CPU_CAPABILITY: AVX2 code cached by one run fails to build under =default. One cache per
# capability (the exactness tests run under several, docs/testing.md).
if os.environ.get("ATEN_CPU_CAPABILITY"):
    os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", os.path.join(
        tempfile.gettempdir(), f"torchinductor_{getpass.getuser()}_{os.environ['ATEN_CPU_CAPABILITY']}"))


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` need CUDA: without it they are skipped, never errors (`pytest -m gpu`
    selects just them on a GPU machine)."""
    gpu = [item for item in items if item.get_closest_marker("gpu")]
    if not gpu:
        return
    import pytest
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (marker gpu); run `pytest -m gpu` on a GPU machine")
    for item in gpu:
        item.add_marker(skip)
