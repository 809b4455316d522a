"""GGUF checkpoints (llama.cpp's single-file format): reader, dequantizers, names, config.

``load_model`` and ``ModelConfig.from_dir`` use this package when given a ``.gguf`` file or a
folder holding one; nothing here imports the decoder or ``ModelConfig`` (no import circles).
"""

from batchinfer.workers.models.gguf.dequant import SUPPORTED_TYPES, dequantize, dequantize_bytes
from batchinfer.workers.models.gguf.hf_config import ARCHITECTURES, hf_config
from batchinfer.workers.models.gguf.names import hf_name, needs_unpermute, unpermute_qk
from batchinfer.workers.models.gguf.reader import GGUFFile, gguf_path, is_gguf

__all__ = [
    "ARCHITECTURES", "SUPPORTED_TYPES", "GGUFFile", "dequantize", "dequantize_bytes", "gguf_path",
    "hf_config", "hf_name", "is_gguf", "needs_unpermute", "unpermute_qk",
]
