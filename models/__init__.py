"""Model families, their configs, shared layers and the checkpoint loader."""
from models.registry import load_model_config, supported_architectures

__all__ = ["load_model_config", "supported_architectures"]
