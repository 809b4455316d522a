"""Models from Hugging Face directories: ``load_model`` -> ``Decoder`` (Llama, Mistral, Qwen2, Qwen3)."""

from batchinfer.workers.models.decoder import Decoder
from batchinfer.workers.models.loader import load_model
from batchinfer.workers.models.model_config import SUPPORTED_ARCHITECTURES, ModelConfig

__all__ = ["SUPPORTED_ARCHITECTURES", "Decoder", "ModelConfig", "load_model"]
