"""Model files, torch-free: resolve `--model` to a local HF directory (converting GGUF once)
and parse its config. The HTTP front uses this before any worker (and torch) starts."""

from .hf_config import ModelConfig, UnsupportedModel
from .resolve import ModelNotFound, resolve_model

__all__ = ["ModelConfig", "ModelNotFound", "UnsupportedModel", "resolve_model"]
