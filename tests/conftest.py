import os
import warnings

# Megatron warns at import about missing TransformerEngine/Apex: expected on CPU.
warnings.filterwarnings("ignore", message=".*Transformer Engine.*")
warnings.filterwarnings("ignore", message=".*Apex is not installed.*")
os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
