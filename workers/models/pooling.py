"""Pooling: how token states become one vector per input, and what a model folder says about it.

``PoolingConfig.from_dir`` reads the sentence-transformers files when the folder has them, as
vLLM does: ``modules.json`` names the modules, the ``Pooling`` module's ``config.json`` gives the
mode (``pooling_mode_mean_tokens`` / ``cls_token`` / ``lasttoken``), and a ``Normalize`` module
means L2-normalised vectors. Without them the defaults are vLLM's: ``cls`` for encoders (BERT
family), ``last`` for decoders, normalised. Matryoshka truncation is allowed when config.json
says so (``matryoshka_dimensions`` or ``is_matryoshka``, the fields vLLM reads).

``pool`` and ``finish`` are pure tensor functions. ``embedding_kind`` reads JSON only (no torch),
so a worker can decide which engine to build before loading anything heavy.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batchinfer.workers.models.model_config import BASE_DECODERS, SUPPORTED_ARCHITECTURES
from batchinfer.workers.pooling_params import POOLING_TYPES, PoolingParams

if TYPE_CHECKING:
    import torch

#: Encoder architectures (workers/models/bert.py).
ENCODER_ARCHITECTURES = ("BertModel", "RobertaModel", "XLMRobertaModel")
_ST_POOLING = "sentence_transformers.models.Pooling"
_ST_NORMALIZE = "sentence_transformers.models.Normalize"
# sentence-transformers' Pooling flags -> our kinds; the others (max, mean_sqrt_len, weightedmean): refused.
_MODES = {"pooling_mode_mean_tokens": "mean", "pooling_mode_cls_token": "cls",
          "pooling_mode_lasttoken": "last"}
_UNSUPPORTED_MODES = ("pooling_mode_max_tokens", "pooling_mode_mean_sqrt_len_tokens",
                      "pooling_mode_weightedmean_tokens")


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"{path}: cannot be read as JSON ({e})") from None


def _architectures(model_dir: Path) -> list[str]:
    path = model_dir / "config.json"
    if not path.is_file():
        return []
    config = _read_json(path)
    names = config.get("architectures") if isinstance(config, dict) else None
    if not names and isinstance(config, dict):
        names = {"bert": ["BertModel"], "roberta": ["RobertaModel"],
                 "xlm-roberta": ["XLMRobertaModel"]}.get(str(config.get("model_type")), [])
    return [str(n) for n in names or []]


def embedding_kind(model_dir: str | Path) -> str | None:
    """``"encoder"``, ``"decoder"`` (a decoder run as an embedder), or None (a generation model).

    A folder is an embedding model when config.json names an encoder or a decoder base class
    (``Qwen3Model``: no LM head), or when it holds sentence-transformers' ``modules.json``.
    """
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        return None
    archs = _architectures(model_dir)
    if any(a in ENCODER_ARCHITECTURES for a in archs):
        return "encoder"
    if any(a in BASE_DECODERS for a in archs) or (archs and (model_dir / "modules.json").is_file()):
        return "decoder"
    return None


def check_supported(model_dir: str | Path) -> None:
    """``ValueError`` listing what is supported when an embedding folder's architecture is not."""
    archs = _architectures(Path(model_dir))
    known = (*ENCODER_ARCHITECTURES, *BASE_DECODERS, *SUPPORTED_ARCHITECTURES)
    if not any(a in known for a in archs):
        raise ValueError(f"{model_dir}: unsupported embedding architecture {', '.join(archs) or 'none'}; "
                         f"supported: {', '.join(known)}")


def is_embedding_model(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` should be served by the embedding engine (see ``embedding_kind``)."""
    return embedding_kind(model_dir) is not None


@dataclass(frozen=True)
class PoolingConfig:
    """A model's pooling defaults and what it allows; a request's ``PoolingParams`` override them."""

    pooling_type: str  # "mean" | "cls" | "last"
    normalize: bool
    matryoshka: bool = False  # whether fewer ``dimensions`` than the width may be asked for
    matryoshka_dimensions: tuple[int, ...] | None = None  # the allowed ones, when the model lists them
    source: str = "defaults"  # where the pooling came from (for logs and errors)

    @classmethod
    def from_dir(cls, model_dir: str | Path, default_type: str) -> PoolingConfig:
        """The folder's pooling: sentence-transformers files, else ``default_type`` and normalise."""
        model_dir = Path(model_dir)
        pooling_type, normalize, source = default_type, True, "defaults"
        modules_path = model_dir / "modules.json"
        if modules_path.is_file():
            modules = _read_json(modules_path)
            if not isinstance(modules, list) or not all(isinstance(m, dict) for m in modules):
                raise ValueError(f"{modules_path}: expected a list of module objects")
            types = [str(m.get("type", "")) for m in modules]
            normalize, source = _ST_NORMALIZE in types, str(modules_path)
            for m in modules:
                if m.get("type") == _ST_POOLING:
                    pooling_type = _st_pooling_mode(model_dir / str(m.get("path", "")) / "config.json")
        config = _read_json(model_dir / "config.json") if (model_dir / "config.json").is_file() else {}
        dims = config.get("matryoshka_dimensions") if isinstance(config, dict) else None
        if dims is not None and (not isinstance(dims, list)
                                 or not all(isinstance(d, int) and d > 0 for d in dims)):
            raise ValueError(f"{model_dir / 'config.json'}: matryoshka_dimensions must be a list of "
                             f"positive integers, got {dims!r}")
        matryoshka = dims is not None or bool(isinstance(config, dict) and config.get("is_matryoshka"))
        return cls(pooling_type, normalize, matryoshka, tuple(dims) if dims else None, source)

    def resolve(self, params: PoolingParams, width: int) -> tuple[str, bool, int]:
        """(pooling type, normalise, dimensions) for one request; ``ValueError`` naming the field."""
        dims = width if params.dimensions is None else params.dimensions
        if dims > width:
            raise ValueError(f"dimensions {dims} is larger than the model's embedding size {width}")
        if dims != width:
            if not self.matryoshka:
                raise ValueError(f"dimensions: this model does not support Matryoshka truncation, so "
                                 f"dimensions must be {width} (its embedding size) or left out, got {dims}")
            if self.matryoshka_dimensions is not None and dims not in self.matryoshka_dimensions:
                raise ValueError(f"dimensions {dims} is not one of the model's matryoshka_dimensions "
                                 f"{list(self.matryoshka_dimensions)}")
        kind = params.pooling_type or self.pooling_type
        normalize = self.normalize if params.normalize is None else params.normalize
        return kind, normalize, dims


def _st_pooling_mode(path: Path) -> str:
    if not path.is_file():
        raise FileNotFoundError(f"{path}: the Pooling module's config.json (in modules.json) is missing")
    config = _read_json(path)
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a JSON object")
    mode = config.get("pooling_mode")  # newer sentence-transformers may write the mode by name
    if isinstance(mode, str):
        kind = {"mean": "mean", "cls": "cls", "lasttoken": "last"}.get(mode)
        if kind is None:
            raise ValueError(f"{path}: pooling_mode {mode!r} is not supported; "
                             "supported: mean, cls, lasttoken")
        return kind
    chosen = [kind for flag, kind in _MODES.items() if config.get(flag)]
    unsupported = [flag for flag in _UNSUPPORTED_MODES if config.get(flag)]
    if unsupported or len(chosen) != 1:
        raise ValueError(f"{path}: exactly one of {', '.join(_MODES)} must be set "
                         f"(got {', '.join(chosen + unsupported) or 'none'}); "
                         f"supported pooling types: {', '.join(POOLING_TYPES)}")
    return chosen[0]


def pool(hidden: torch.Tensor, cu_seqlens: torch.Tensor, kind: str) -> torch.Tensor:
    """[T, C] token states of packed sequences -> [S, C] float32, one row per sequence.

    ``mean``: the average over the sequence's tokens; ``cls``: its first token; ``last``: its last.
    """
    import torch

    starts, ends = cu_seqlens[:-1].long(), cu_seqlens[1:].long()  # [S]
    if kind == "cls":
        return hidden[starts].float()
    if kind == "last":
        return hidden[ends - 1].float()
    if kind != "mean":
        raise ValueError(f"pooling_type must be one of {', '.join(POOLING_TYPES)}, got {kind!r}")
    lengths = (ends - starts).to(hidden.device)  # [S]
    seq_of = torch.repeat_interleave(torch.arange(len(lengths), device=hidden.device), lengths)  # [T]
    sums = torch.zeros(len(lengths), hidden.shape[1], dtype=torch.float32, device=hidden.device)
    sums.index_add_(0, seq_of, hidden.float())
    return sums / lengths[:, None].float()


def finish(vectors: torch.Tensor, dimensions: int, normalize: bool) -> torch.Tensor:
    """[N, C] pooled -> [N, dimensions]: Matryoshka truncation first, then L2 normalisation
    (the order of OpenAI and vLLM, so a truncated vector is unit length again)."""
    import torch.nn.functional as F

    out = vectors[:, :dimensions]
    return F.normalize(out, p=2.0, dim=-1) if normalize else out
