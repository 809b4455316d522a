"""Structured outputs: constrain a request's tokens to a JSON schema, regex, choice or grammar.

``params`` (what a request asks for; queue-side safe, no torch), ``backend`` (the grammar-library
contract), ``factory`` (``make_backend`` by name), ``llguidance_backend`` (the default) and
``xgrammar_backend`` (optional; with ``xgrammar_vocab``, our tokenizer as xgrammar sees it, and
``xgrammar_json``, where its JSON handling falls short), ``bitmask`` (applying masks to logits)
and ``manager`` (what the engine drives each step).
"""
