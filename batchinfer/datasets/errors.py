"""The one error of an input that cannot be read as a whole, in a module without pyarrow.

Every CLI command maps :class:`InputError` to exit 7 (``cli/context.py``), so the class must load
without the readers: ``status`` or ``--help`` never pay for pyarrow. The readers raise it under
every name they export it by (:mod:`batchinfer.datasets.listing`, :mod:`batchinfer.datasets.source`,
:mod:`batchinfer.client.inputs`): it is this very class everywhere.
"""

from __future__ import annotations

__all__ = ["InputError"]


class InputError(ValueError):
    """The input as a whole cannot be read (missing, unreachable, not tabular, bad filter, no file
    matches, empty): one sentence naming it. A single bad line or row is an error row instead."""
