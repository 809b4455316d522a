"""The CPU's linear layers and decode steps: weight-only int8 / int4 quantization (``quantization``),
few-row dense matmuls and the compiled layer loop.

``linear``: ``QuantizedLinear``, which runs torch's packed CPU kernels at low row counts and a
dense bfloat16 copy of the same quantized weights above them; ``apply``: ``quantize_model``, which
swaps a loaded decoder's linears for quantized ones; ``plan``: what an engine quantizes (``auto``
read from a GGUF's tensor types); ``dense``: ``GemvLinear`` and ``use_gemv`` (dense weights, 1-8
rows); ``layer_loop``: ``LayerLoop`` and ``use_layer_loop`` (a decode step's layers in one compiled
call). The setting itself, its modes and checks, is
``batchinfer.workers.quantization_config`` (``EngineConfig`` reads it without loading torch).
"""
