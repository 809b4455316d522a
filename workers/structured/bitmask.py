"""Applying a token bitmask to logits: disallowed tokens get ``-inf`` before any other processing.

bitmask int32 ``[R, W]`` (bit ``t % 32`` of word ``t // 32`` = token ``t`` allowed), as the
backends fill it. Columns of the logits past ``32 * W`` are padding of the model's vocabulary and
are masked too.
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np
import torch

_BITS: dict[torch.device, torch.Tensor] = {}  # device -> int32 [32]: 1 << i


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size]: True where the token is allowed (False past 32 * W)."""
    bits = _BITS.get(bitmask.device)
    if bits is None:
        bits = _BITS[bitmask.device] = torch.tensor([1 << i for i in range(31)] + [-(2**31)],
                                                    dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask.unsqueeze(-1) & bits).ne(0).flatten(1)  # [R, 32 * W]
    width = allowed.shape[1]
    if width >= vocab_size:
        return allowed[:, :vocab_size]
    return torch.nn.functional.pad(allowed, (0, vocab_size - width), value=False)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> None:
    """In place: ``logits[rows[i], t] = -inf`` where bit t of ``bitmask[i]`` is clear.

    logits [N, V] (any float dtype, any device); bitmask int32 [R, W] on the CPU or the logits'
    device; rows [R] int64 row indices into logits, None = all N rows (R == N).
    """
    if logits.device.type == "cpu" and bitmask.device.type == "cpu":
        banned = _banned_cpu(bitmask, logits.shape[1])
    else:
        banned = ~unpack_bitmask(bitmask.to(logits.device, non_blocking=True), logits.shape[1])  # [R, V]
    if rows is None:
        logits.masked_fill_(banned, float("-inf"))
    elif logits.device.type == "cpu":
        # Masking views in place is several times faster here than a gather + scatter of the rows:
        # each run of consecutive rows is one view.
        for start, first, length in _runs(rows.tolist()):
            logits[start:start + length].masked_fill_(banned[first:first + length], float("-inf"))
    else:
        rows = rows.to(logits.device)
        logits[rows] = logits[rows].masked_fill_(banned, float("-inf"))


def _runs(rows: list[int]) -> list[tuple[int, int, int]]:
    """Runs of consecutive values in ``rows``: (first value, its index in rows, length)."""
    runs: list[tuple[int, int, int]] = []
    for j, r in enumerate(rows):
        if runs and runs[-1][0] + runs[-1][2] == r:
            start, first, length = runs[-1]
            runs[-1] = (start, first, length + 1)
        else:
            runs.append((r, j, 1))
    return runs


def _banned_cpu(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bool [R, vocab_size], True where banned: numpy's unpackbits is ~20x faster than shifts here."""
    inverted = np.invert(bitmask.contiguous().numpy()).view(np.uint8)  # little-endian words -> bytes
    banned = np.unpackbits(inverted, axis=1, bitorder="little").view(np.bool_)  # [R, 32 * W]
    width = banned.shape[1]
    if width < vocab_size:
        banned = np.pad(banned, ((0, 0), (0, vocab_size - width)), constant_values=True)
    return torch.from_numpy(banned[:, :vocab_size])


def first_allowed(row: torch.Tensor, vocab_size: int, exclude: Iterable[int] = ()) -> int | None:
    """The lowest token a bitmask row (int32 ``[W]`` on the CPU) allows, ``exclude`` aside (EOS);
    None when it allows none. In numpy: no torch thread pool is woken for one row."""
    allowed = np.unpackbits(row.contiguous().numpy().view(np.uint8), bitorder="little")[:vocab_size]
    skip = [t for t in exclude if 0 <= t < len(allowed)]
    if skip:
        allowed[skip] = 0
    hits = np.flatnonzero(allowed)
    return int(hits[0]) if len(hits) else None
