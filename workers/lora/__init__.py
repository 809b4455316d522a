"""Per-request LoRA adapters: PEFT folders loaded and checked (``adapter.py``), the stacked
weights the forward reads (``stack.py``), which adapters live where (``manager.py``)."""
