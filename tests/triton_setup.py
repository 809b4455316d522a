"""The device for Triton kernel tests: CUDA when present, else Triton's CPU interpreter.

tests/conftest.py sets ``TRITON_INTERPRET=1`` without CUDA before anything imports triton; a test
module imports ``DEVICE`` from here (before importing triton or our kernels) so that a run which
imported triton too early fails loudly instead of trying to compile kernels for a missing GPU.
"""

from __future__ import annotations

import os
import sys

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise RuntimeError("triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot be "
                           "interpreted on CPU: set the variable before anything imports triton")
    os.environ["TRITON_INTERPRET"] = "1"
