"""``GemvLinear``: an ``nn.Linear`` whose few-row calls on the CPU take the compiled GEMV.

At a decode step of one to eight sequences a linear layer multiplies one to eight rows by its whole
weight: the step is bound by how fast the weights stream in, and ``kernels/cpu_ext/gemv.cpp``
(which prefetches them) reads them at 1.3-3x the rate of torch's matmul at these row counts
(docs/benchmarks.md, "The layer loop"). ``use_gemv`` swaps a loaded decoder's dense projections
and LM head for this class (the same parameters, not copies); more rows, other dtypes, or a library
that did not build take ``nn.Linear``'s own path. Same weights and float32 sums either way: outputs
differ in the order of the additions only.
"""

from __future__ import annotations

import torch
from torch import nn

from batchinfer.kernels.cpu_ext import gemv
from batchinfer.workers.models.decoder import Decoder
from batchinfer.workers.quant.apply import projections, tied_head


class GemvLinear(nn.Linear):
    """``nn.Linear`` (``[..., K] -> [..., N]``) with calls of at most ``gemv.MAX_ROWS`` rows on
    the compiled GEMV when ``gemv.supports`` them."""

    @classmethod
    def sharing(cls, linear: nn.Linear) -> GemvLinear:
        """A ``GemvLinear`` holding ``linear``'s own weight and bias parameters."""
        module = cls.__new__(cls)
        nn.Module.__init__(module)
        module.in_features, module.out_features = linear.in_features, linear.out_features
        module.weight = linear.weight
        module.bias = linear.bias
        return module

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        x2 = x.reshape(-1, self.in_features)  # [M, K]
        if x2.shape[0] <= gemv.MAX_ROWS and gemv.supports(x2, self.weight):
            return gemv.linear(x2, self.weight, self.bias).reshape(*x.shape[:-1], self.out_features)
        return nn.functional.linear(x, self.weight, self.bias)


def _swap(linear: nn.Module) -> nn.Module:
    return GemvLinear.sharing(linear) if type(linear) is nn.Linear else linear


def use_gemv(decoder: Decoder) -> int:
    """Swap ``decoder``'s dense ``nn.Linear`` projections (attention, dense MLP) and LM head for
    ``GemvLinear`` in place (a tied head gets one sharing the embedding's weight; a decoder built
    without a head keeps none); returns how many.
    Nothing happens off the CPU, for a dtype ``gemv`` does not take, or with tensor parallelism
    (its row-parallel layers call ``linear.weight`` directly). Quantized layers are left alone."""
    if decoder.device.type != "cpu" or decoder.dtype not in gemv.WEIGHT_DTYPES or decoder.tp is not None:
        return 0
    swapped = 0
    for holder, name in projections(decoder):
        new = _swap(getattr(holder, name))
        swapped += new is not getattr(holder, name)
        setattr(holder, name, new)
    if decoder.lm_head is None and decoder.config.tie_word_embeddings:  # tied: reads the embedding's weight
        decoder.lm_head = GemvLinear.sharing(tied_head(decoder))
        swapped += 1
    elif type(decoder.lm_head) is nn.Linear:
        decoder.lm_head = GemvLinear.sharing(decoder.lm_head)
        swapped += 1
    return swapped
