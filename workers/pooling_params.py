"""``PoolingParams``: how one embedding request's vectors are pooled, truncated and returned.

Names follow vLLM's ``PoolingParams`` and the OpenAI embeddings API. Like ``SamplingParams``, every
field is validated in ``__post_init__`` and every error is a ``ValueError`` whose message starts
with the field's name, so the queue can quote it back in an error row. What the *model* allows
(``dimensions`` no larger than its width, Matryoshka truncation at all) is checked where the model
is known: the scheduler's intake and the embedding engine.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

#: How token states become one vector: ``mean`` over the input's tokens, the first token's state
#: (``cls``), or the last token's (``last``, decoder embedders).
POOLING_TYPES = ("mean", "cls", "last")
#: How a vector leaves the system in OpenAI's output line (the row itself always holds float32).
ENCODING_FORMATS = ("float", "base64")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


@dataclass
class PoolingParams:
    """Pooling parameters of one embedding request (every input of the request shares them)."""

    dimensions: int | None = None  # Matryoshka truncation to the first N dimensions; None: full width
    normalize: bool | None = None  # L2-normalise; None: as the model's files say (else True)
    pooling_type: str | None = None  # "mean" | "cls" | "last"; None: as the model's files say
    truncate_prompt_tokens: int | None = None  # keep the last N tokens of a longer input; None: refuse it
    encoding_format: str = "float"  # "float" | "base64": the OpenAI output line's form

    FIELDS: ClassVar[tuple[str, ...]]  # the allowed field names, set below the class

    def __post_init__(self) -> None:
        if self.dimensions is not None and (not _is_int(self.dimensions) or self.dimensions < 1):
            raise ValueError(f"dimensions must be a positive integer, got {self.dimensions!r}")
        if self.normalize is not None and not isinstance(self.normalize, bool):
            raise ValueError(f"normalize must be true or false, got {self.normalize!r}")
        if self.pooling_type is not None:
            kind = self.pooling_type.lower() if isinstance(self.pooling_type, str) else None
            if kind not in POOLING_TYPES:
                raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, "
                                 f"got {self.pooling_type!r}")
            self.pooling_type = kind
        t = self.truncate_prompt_tokens
        if t is not None and (not _is_int(t) or t < 1):
            raise ValueError(f"truncate_prompt_tokens must be a positive integer, got {t!r}")
        if self.encoding_format not in ENCODING_FORMATS:
            raise ValueError(f"encoding_format must be one of {', '.join(ENCODING_FORMATS)}, "
                             f"got {self.encoding_format!r}")

    def to_dict(self) -> dict[str, Any]:
        """Every field, JSON-ready (what a batch entry carries)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> PoolingParams:
        """Validate a mapping; an unknown key is a ``ValueError`` naming it."""
        d = dict(d or {})
        unknown = sorted(set(d) - set(cls.FIELDS))
        if unknown:
            raise ValueError(f"{unknown[0]} is not a pooling parameter (known: {', '.join(cls.FIELDS)})")
        return cls(**d)


PoolingParams.FIELDS = tuple(f.name for f in fields(PoolingParams))
