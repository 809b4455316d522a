"""Tensor parallelism on torch.distributed: one worker's model split across N ranks (NCCL on GPUs,
gloo on the CPU).

``group`` (the process group and its collectives, with timeouts), the model's sharding (in
``workers/models``: a ``Decoder`` built with a ``TPGroup`` holds its rank's slices), and the rank
processes that rank 0's engine drives each step.
"""
