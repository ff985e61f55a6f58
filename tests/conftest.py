import os
import warnings

# Megatron warns at import about missing TransformerEngine/Apex: expected on CPU.
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")


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
