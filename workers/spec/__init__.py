"""Speculative decoding: proposers of draft tokens (``ngram``, ``suffix``, ``prediction``, ``draft``)
and the engine's side of it (``decoder.py``); their configuration is
``batchinfer.workers.speculative_config``. The engine verifies every draft in one forward and keeps
only what the target itself samples, so no output changes."""
