"""The one place that knows which megatron-core versions this plugin supports, and which optional
NVIDIA extensions (TransformerEngine, a fused wgrad kernel) it uses."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version
from typing import Any

from packaging.version import Version

# Integration points (MoELayer.__init__ dispatcher selection, token dispatcher API, the CUDA
# hard-codings patched by cpu_runtime) were checked against 0.19.2; 0.17/0.18 share that API.
SUPPORTED = (Version("0.17.0"), Version("0.20.0"))  # [min, max)
TESTED = "0.19.2"


def megatron_core_version() -> Version:
    try:
        return Version(version("megatron-core"))
    except PackageNotFoundError:
        pass
    try:  # a Megatron-LM checkout on PYTHONPATH has no pip metadata
        from megatron.core.package_info import __version__

        return Version(__version__)
    except ImportError as exc:
        raise ImportError(
            "megatron-core is not installed; install the pinned environment with ./scripts/test "
            "or `pip install megatron-core==0.19.2`"
        ) from exc


def check_megatron_version() -> Version:
    """Fail clearly on a megatron-core outside the supported range."""
    v = megatron_core_version()
    lo, hi = SUPPORTED
    if not (lo <= v < hi):
        raise ImportError(
            f"megatron-core {v} is not supported by megatron-hybridep (supported: >={lo},<{hi}; "
            f"tested: {TESTED}). Fix: pip install 'megatron-core=={TESTED}'"
        )
    return v


def transformer_engine_version() -> Version | None:
    """TransformerEngine's version (the `gpu` extra), or None when it is not importable."""
    try:
        import transformer_engine
    except Exception:  # noqa: BLE001 - a broken build (e.g. compiled for another torch) counts as absent
        return None
    try:
        return Version(version("transformer-engine"))
    except PackageNotFoundError:  # a source build may carry only the module's own version
        return Version(str(getattr(transformer_engine, "__version__", "0")).split("+")[0])


def check_transformer_impl(transformer_impl: str) -> None:
    """Fail before any collective when the chosen layer implementation cannot be built here."""
    if transformer_impl == "transformer_engine" and transformer_engine_version() is None:
        raise ImportError(
            "--transformer-impl transformer_engine needs TransformerEngine, which is not importable. "
            "Fix: pip install --no-build-isolation '.[gpu]' (docs/gpu.md), or pass --transformer-impl local")


def use_wgrad_kernel(kernel: Any) -> None:
    """Point Megatron's local linear layers at a fused wgrad kernel with Apex's
    ``fused_weight_gradient_mlp_cuda`` interface (--gradient-accumulation-fusion without Apex:
    megatron_hybridep.testing.fused_wgrad's stand-in). Call before the model is built."""
    from megatron.core.tensor_parallel import layers

    layers.fused_weight_gradient_mlp_cuda = kernel
    layers._grad_accum_fusion_available = True
