"""batchinfer: job-queue batch inference for large language models on Redis Streams.

The public API is imported lazily, so ``import batchinfer`` stays cheap (no torch) for the
queue-side tools::

    from batchinfer import LLM, SamplingParams   # in-process engine
    from batchinfer import StructuredOutputsParams  # SamplingParams(structured_outputs=...)
    from batchinfer import LoRARequest            # LLM.generate(..., lora_request=...)
    from batchinfer import Client                 # the queue client
    from batchinfer import ModelNotServed         # Client.request's timeout for an unserved model
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

_LAZY = {
    "LLM": "batchinfer.workers.entrypoints.llm",
    "SamplingParams": "batchinfer.workers.sampling_params",
    "StructuredOutputsParams": "batchinfer.workers.structured_params",
    "LoRARequest": "batchinfer.workers.lora_request",
    "Client": "batchinfer.client.client",
    "ModelNotServed": "batchinfer.client.client",
}

__all__ = ["LLM", "Client", "LoRARequest", "ModelNotServed", "SamplingParams", "StructuredOutputsParams",
           "__version__"]

if TYPE_CHECKING:
    from batchinfer.client.client import Client, ModelNotServed
    from batchinfer.workers.entrypoints.llm import LLM
    from batchinfer.workers.lora_request import LoRARequest
    from batchinfer.workers.sampling_params import SamplingParams
    from batchinfer.workers.structured_params import StructuredOutputsParams


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'batchinfer' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip __getattr__
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
