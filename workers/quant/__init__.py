"""Weight-only int8 / int4 quantization of a decoder's linear layers on the CPU (``quantization``).

``linear``: ``QuantizedLinear``, which runs torch's packed CPU kernels at low row counts and a
dense bfloat16 copy of the same quantized weights above them; ``apply``: ``quantize_model``, which
swaps a loaded decoder's linears for quantized ones; ``plan``: what an engine quantizes (``auto``
read from a GGUF's tensor types). The setting itself, its modes and checks, is
``batchinfer.workers.quantization_config`` (``EngineConfig`` reads it without loading torch).
"""
