"""Compiled CPU kernels, built on first use with ``torch.utils.cpp_extension`` (a C++ compiler and
ninja needed; without them the callers' torch paths serve). ``decode``: decode attention read
straight from the paged KV cache's block table (``kernels/cpu_attention.py`` calls it)."""
