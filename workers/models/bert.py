"""Encoder models (BERT, RoBERTa, XLM-RoBERTa) over packed ragged sequences, for embeddings.

A step is a flat batch of whole sequences (no padding, no batch dimension, no KV cache):
``forward(input_ids [T], positions [T], cu_seqlens [S+1]) -> [T, C]`` last hidden states.
Attention is bidirectional within each sequence, through the kernels contract
(``varlen_attention(causal=False)``).

The block is transformers' ``BertLayer``: post-LayerNorm residuals, exact-erf GELU MLP.
Embeddings are word + absolute position + token type 0, then LayerNorm. RoBERTa / XLM-R number
positions from ``pad_token_id + 1`` (and give a pad token inside the text position
``pad_token_id``), as transformers' ``create_position_ids_from_input_ids``. The pooler (a dense
layer over [CLS], for next-sentence prediction) is not used by sentence embedders and not loaded.

Parameter layout differs from the checkpoint in one place: ``qkv`` stacks query, key, value rows.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from torch import nn

from batchinfer.kernels import varlen_attention
from batchinfer.workers.models.pooling import ENCODER_ARCHITECTURES

_MODEL_TYPES = {"bert": "BertModel", "roberta": "RobertaModel", "xlm-roberta": "XLMRobertaModel"}
_ACTIVATIONS = {"gelu": "none", "gelu_new": "tanh", "gelu_pytorch_tanh": "tanh"}  # -> F.gelu approximate
_PREFIXES = ("bert.", "roberta.", "model.")
_SKIPPED = re.compile(r"^(pooler\.|cls\.|lm_head\.|embeddings\.position_ids$)")
_LAYER_NAMES = {  # transformers' names inside encoder.layer.N -> ours inside layers.N
    "attention.output.dense": "attn_out", "attention.output.LayerNorm": "attn_norm",
    "intermediate.dense": "up", "output.dense": "down", "output.LayerNorm": "mlp_norm",
}
_QKV = {"query": 0, "key": 1, "value": 2}


@dataclass(frozen=True)
class EncoderConfig:
    """What the encoder needs from a transformers ``BertConfig`` / ``RobertaConfig``."""

    architecture: str
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    intermediate_size: int
    max_position_embeddings: int
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    hidden_act: str = "gelu"
    pad_token_id: int = 0
    torch_dtype: str | None = None

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def roberta_positions(self) -> bool:
        return self.architecture != "BertModel"

    @property
    def max_len(self) -> int:
        """The longest input: RoBERTa's first ``pad_token_id + 1`` position rows are never used."""
        offset = self.pad_token_id + 1 if self.roberta_positions else 0
        return self.max_position_embeddings - offset

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> EncoderConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise FileNotFoundError(f"{path}: config.json not found in model directory {model_dir}")
        try:
            config = json.loads(path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}: invalid JSON at line {e.lineno}: {e.msg}") from None
        return cls.from_dict(config, source=str(path))

    @classmethod
    def from_dict(cls, config: dict[str, Any], source: str = "config") -> EncoderConfig:
        names = config.get("architectures") or [_MODEL_TYPES.get(str(config.get("model_type")), "")]
        arch = next((n for n in names if n in ENCODER_ARCHITECTURES), None)
        if arch is None:
            raise ValueError(f"{source}: unsupported encoder architecture {', '.join(map(str, names))}; "
                             f"supported: {', '.join(ENCODER_ARCHITECTURES)}")
        act = config.get("hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"{source}: hidden_act {act!r} is not supported; "
                             f"supported: {', '.join(_ACTIVATIONS)}")
        kind = config.get("position_embedding_type", "absolute")
        if kind != "absolute":
            raise ValueError(f"{source}: position_embedding_type {kind!r} is not supported (only 'absolute')")
        if config.get("is_decoder") or config.get("add_cross_attention"):
            raise ValueError(f"{source}: decoder / cross-attention BERT configs are not supported")

        def need(key: str) -> int:
            if config.get(key) is None:
                raise ValueError(f"{source}: required field {key!r} is missing")
            return int(config[key])

        hidden, heads = need("hidden_size"), need("num_attention_heads")
        if hidden % heads:
            raise ValueError(f"{source}: hidden_size {hidden} is not a multiple of "
                             f"num_attention_heads {heads}")
        return cls(architecture=arch, vocab_size=need("vocab_size"), hidden_size=hidden,
                   num_hidden_layers=need("num_hidden_layers"), num_attention_heads=heads,
                   intermediate_size=need("intermediate_size"),
                   max_position_embeddings=int(config.get("max_position_embeddings", 512)),
                   type_vocab_size=int(config.get("type_vocab_size", 2)),
                   layer_norm_eps=float(config.get("layer_norm_eps", 1e-12)), hidden_act=act,
                   pad_token_id=int(pad if (pad := config.get("pad_token_id")) is not None
                                    else (0 if arch == "BertModel" else 1)),
                   torch_dtype=config.get("torch_dtype") or config.get("dtype"))


class EncoderLayer(nn.Module):
    """``BertLayer``: x = LN(x + attn(x)); x = LN(x + down(gelu(up(x))))."""

    def __init__(self, config: EncoderConfig):
        super().__init__()
        C, inner = config.hidden_size, config.intermediate_size
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        self.qkv = nn.Linear(C, 3 * C)
        self.attn_out = nn.Linear(C, C)
        self.attn_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.up = nn.Linear(C, inner)
        self.down = nn.Linear(inner, C)
        self.mlp_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
        self.approximate = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, backend: str | None) -> torch.Tensor:
        T, C = x.shape
        q, k, v = self.qkv(x).view(T, 3, self.num_heads, self.head_dim).unbind(1)  # each [T, H, D]
        o = varlen_attention(q, k, v, cu_seqlens, causal=False, backend=backend)  # [T, H, D]
        x = self.attn_norm(x + self.attn_out(o.reshape(T, C)))
        h = F.gelu(self.up(x), approximate=self.approximate)  # [T, I]
        return self.mlp_norm(x + self.down(h))


class BertModel(nn.Module):
    """Token ids of whole packed sequences -> last hidden states [T, C] (RoBERTa: ``RobertaModel``)."""

    def __init__(self, config: EncoderConfig, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu"):
        super().__init__()
        self.config = config
        C = config.hidden_size
        with torch.device("meta"):  # allocated uninitialised below: the loader fills every tensor
            self.word_embeddings = nn.Embedding(config.vocab_size, C)
            self.position_embeddings = nn.Embedding(config.max_position_embeddings, C)
            self.token_type_embeddings = nn.Embedding(config.type_vocab_size, C)
            self.embed_norm = nn.LayerNorm(C, eps=config.layer_norm_eps)
            self.layers = nn.ModuleList(EncoderLayer(config) for _ in range(config.num_hidden_layers))
        self.to(dtype).to_empty(device=device)
        self.backend: str | None = None  # kernels backend; None = best for the device

    @property
    def dtype(self) -> torch.dtype:
        return self.word_embeddings.weight.dtype

    @property
    def device(self) -> torch.device:
        return self.word_embeddings.weight.device

    @property
    def hidden_size(self) -> int:
        return self.config.hidden_size

    def position_ids(self, input_ids: torch.Tensor, positions: torch.Tensor,
                     cu_seqlens: torch.Tensor) -> torch.Tensor:  # [T]
        """Rows of the position table: ``positions`` for BERT; RoBERTa counts non-pad tokens
        from ``pad_token_id + 1`` and gives pad tokens ``pad_token_id``."""
        if not self.config.roberta_positions:
            return positions
        pad = self.config.pad_token_id
        real = (input_ids != pad).long()  # [T]
        counts = real.cumsum(0)
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        # [S]: real tokens before each sequence
        before = torch.cat([counts.new_zeros(1), counts])[cu_seqlens[:-1].long()]
        counts = counts - torch.repeat_interleave(before, lengths)
        return counts * real + pad

    def forward(
        self,
        input_ids: torch.Tensor,  # [T] int64, whole sequences concatenated
        positions: torch.Tensor,  # [T] int64, index of each token in its sequence
        cu_seqlens: torch.Tensor,  # [S + 1] int32, sequence offsets
    ) -> torch.Tensor:  # [T, C]
        pos = self.position_ids(input_ids, positions, cu_seqlens)
        x = self.word_embeddings(input_ids) + self.position_embeddings(pos)
        x = x + self.token_type_embeddings.weight[0]  # [T, C]: every token is of type 0
        x = self.embed_norm(x)
        for layer in self.layers:
            x = layer(x, cu_seqlens, self.backend)
        return x


RobertaModel = BertModel  # the same network; EncoderConfig.roberta_positions switches the numbering
XLMRobertaModel = BertModel


def _our_name(name: str) -> tuple[str, int | None] | None:
    """(our parameter name, q/k/v part) of a checkpoint tensor; None = not used."""
    for prefix in _PREFIXES:
        name = name.removeprefix(prefix)
    if _SKIPPED.search(name):
        return None
    name = name.replace(".gamma", ".weight").replace(".beta", ".bias")  # TF-era LayerNorm names
    if name.startswith("embeddings."):
        rest = name.removeprefix("embeddings.")
        if rest.startswith("LayerNorm."):
            return "embed_norm." + rest.removeprefix("LayerNorm."), None
        return rest, None
    m = re.fullmatch(r"encoder\.layer\.(\d+)\.(.+)\.(weight|bias)", name)
    if m is None:
        return name, None  # reported as unexpected by the loader
    layer, inner, kind = m.groups()
    if inner.startswith("attention.self."):
        part = inner.removeprefix("attention.self.")
        if part in _QKV:
            return f"layers.{layer}.qkv.{kind}", _QKV[part]
    if inner in _LAYER_NAMES:
        return f"layers.{layer}.{_LAYER_NAMES[inner]}.{kind}", None
    return name, None


def load_encoder(model_dir: str | Path, dtype: torch.dtype = torch.float32,
                 device: str | torch.device = "cpu") -> BertModel:
    """Build the encoder of a Hugging Face folder and load its safetensors weights (``bert.``-
    prefixed or bare names). ``ValueError`` for an unexpected, missing or misshapen tensor."""
    from batchinfer.workers.models.loader import weight_files

    model_dir = Path(model_dir)
    config = EncoderConfig.from_dir(model_dir)
    model = BertModel(config, dtype=dtype, device=device)
    params = dict(model.named_parameters())
    pending = {(n, p) for n in params for p in ((0, 1, 2) if ".qkv." in n else (None,))}
    C = config.hidden_size
    with torch.no_grad():
        for path in weight_files(model_dir):
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                    target = _our_name(name)
                    if target is None:
                        continue
                    pname, part = target
                    if pname not in params:
                        raise ValueError(f"{path.name}: unexpected tensor {name!r} for {config.architecture}")
                    dest = params[pname].data if part is None else params[pname].data[part * C:(part + 1) * C]
                    tensor = f.get_tensor(name)
                    if tuple(dest.shape) != tuple(tensor.shape):
                        raise ValueError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(dest.shape)} from config.json")
                    dest.copy_(tensor)
                    pending.discard((pname, part))
    if pending:
        missing = sorted(n + ("" if p is None else f" ({'qkv'[p]} part)") for n, p in pending)
        raise ValueError(f"{model_dir}: checkpoint lacks tensors for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return model.eval().requires_grad_(False)
