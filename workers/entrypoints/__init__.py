"""In-process entry points of the inference library: ``LLM`` (generate, chat, embed)."""
