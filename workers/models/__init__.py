"""Model definitions, configs and weight loading."""

from workers.models.config import ARCHITECTURES, ModelConfig, load_model_config, model_config_from_hf
from workers.models.decoder import CausalLM
from workers.models.loader import build_model

__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig", "build_model", "load_model_config", "model_config_from_hf"]
