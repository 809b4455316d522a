"""Hugging Face model directory (safetensors, single or sharded) or GGUF file -> ``Decoder`` with its weights.

Checkpoint tensors are copied one at a time into the decoder's parameters, fusing q/k/v into
``qkv_proj`` and gate/up into ``gate_up_proj`` on the way, so peak host memory stays near one
tensor. Only safetensors and GGUF files are read (never pickled ``.bin`` files), and no code from
the model directory is ever imported. A GGUF file's tensors are dequantized one at a time
(``workers/models/gguf/``) and renamed to the Hugging Face names, so both paths share one loop.

With a ``TPGroup`` (``tp``) each rank builds its shard of the decoder and reads only its rows or
columns of each sharded tensor (``ShardPlan.source``) through safetensors' ``get_slice``: no
process ever holds a whole sharded tensor. A GGUF tensor is dequantized whole (on the rank's
device, one tensor at a time; quantized blocks span rows) and then sliced.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from batchinfer.workers.models.decoder import Decoder
from batchinfer.workers.models.gguf import (
    GGUFFile,
    dequantize,
    gguf_path,
    hf_config,
    hf_name,
    needs_unpermute,
    unpermute_qk,
)
from batchinfer.workers.models.gguf.names import CONFIG_TENSORS, has_norm_offset, split_stacked
from batchinfer.workers.models.model_config import ModelConfig
from batchinfer.workers.models.moe import checkpoint_target, part_bounds
from batchinfer.workers.models.sharding import ShardPlan
from batchinfer.workers.parallel.group import TPGroup
from batchinfer.workers.progress import bytes_progress

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_DTYPES = {
    "float32": torch.float32, "float": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "half": torch.float16, "fp16": torch.float16,
}
# Checkpoint projection -> (our fused parameter, which part of it).
_FUSED = {
    "self_attn.q_proj": ("self_attn.qkv_proj", "q"),
    "self_attn.k_proj": ("self_attn.qkv_proj", "k"),
    "self_attn.v_proj": ("self_attn.qkv_proj", "v"),
    "mlp.gate_proj": ("mlp.gate_up_proj", "gate"),
    "mlp.up_proj": ("mlp.gate_up_proj", "up"),
}
_SKIPPED = re.compile(r"rotary_emb\.inv_freq$")  # buffers some old checkpoints saved


def resolve_dtype(dtype: torch.dtype | str, config: ModelConfig) -> torch.dtype:
    """A torch dtype from a dtype or a name; ``"auto"`` = the checkpoint's ``torch_dtype`` (else float32)."""
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPES.values():
            raise ValueError(f"dtype {dtype} is not supported; use float32, bfloat16 or float16")
        return dtype
    name = str(dtype).removeprefix("torch.")
    if name == "auto":
        name = str(config.torch_dtype or "float32").removeprefix("torch.")
    if name not in _DTYPES:
        raise ValueError(f"dtype {dtype!r} is not supported; use auto, float32, bfloat16 or float16")
    return _DTYPES[name]


def weight_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a model directory, checking that every shard the index lists exists."""
    index = model_dir / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a valid safetensors index ({e})") from None
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        for f in files:
            if not f.is_file():
                raise FileNotFoundError(f"{f}: shard listed in {INDEX_FILE} is missing")
        return files
    single = model_dir / SINGLE_FILE
    if single.is_file():
        return [single]
    raise FileNotFoundError(
        f"{model_dir}: no {SINGLE_FILE} or {INDEX_FILE} (only safetensors checkpoints are supported)"
    )


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | str = torch.float32,
    device: str | torch.device = "cpu",
    progress: bool = True,
    lm_head: bool = True,
    tp: TPGroup | None = None,
) -> Decoder:
    """Build the decoder of a Hugging Face directory or a GGUF checkpoint and load its weights.

    ``model_dir``: a folder with ``config.json`` + safetensors, a ``.gguf`` file, or a folder
    holding exactly one ``.gguf`` (and no safetensors). GGUF tensors are dequantized into ``dtype``
    on ``device``; ``"auto"`` is float32 for them (a GGUF file names no torch dtype).

    ``progress`` shows a bytes progress bar on stderr when stderr is a terminal. Raises
    ``FileNotFoundError`` for a missing config / weights file / shard and ``ValueError`` for an
    unsupported architecture or GGUF tensor type, a missing or unexpected tensor, or a shape mismatch.
    ``lm_head=False`` (embedders): no LM head is built, and a checkpoint's ``lm_head.weight`` is skipped.
    ``tp``: a tensor-parallel group; the decoder is this rank's shard (``ValueError`` when the group's
    size cannot split the model's heads, KV heads or intermediate size).
    """
    model_dir = Path(model_dir)
    gguf = _open_gguf(model_dir)  # None: a Hugging Face folder
    if gguf is None:
        if not model_dir.is_dir():
            raise FileNotFoundError(f"{model_dir}: model directory not found")
        config = ModelConfig.from_dir(model_dir)
        files = weight_files(model_dir)
    else:
        config = ModelConfig.from_dict(*hf_config(gguf), source=str(gguf.path))
    model = Decoder(config, dtype=resolve_dtype(dtype, config), device=device, lm_head=lm_head, tp=tp)
    params = dict(model.named_parameters())
    shard = model.shard  # None: the whole model
    sizes = _fused_sizes(config if shard is None else shard.local_config())
    pending = {(name, part) for name in params for part in sizes.get(name.split(".", 2)[-1], [None])}

    if gguf is None:
        total = sum(f.stat().st_size for f in files)
        tensors = _tensors(files) if shard is None else _sharded(_lazy_tensors(files), config, shard)
    else:
        total, tensors = _gguf_tensors(gguf, config, resolve_dtype(dtype, config), device)
        if shard is not None:
            tensors = _sharded(((p, n, t.shape, t.__getitem__) for p, n, t in tensors), config, shard)
    if shard is not None:
        total //= shard.size  # about what this rank reads
    with torch.no_grad(), bytes_progress("loading weights", total, quiet=not progress) as bar:
        for path, name, tensor in tensors:
            bar.advance(tensor.numel() * tensor.element_size())
            target = _target(name, config)
            if target is None or (target[0] == "lm_head.weight" and "lm_head.weight" not in params):
                continue
            pname, part = target
            if pname not in params:
                raise ValueError(f"{path.name}: unexpected tensor {name!r} for {config.architecture} "
                                 f"(no parameter {pname!r}; does config.json match the weights?)")
            dest = _slice(params[pname], pname, part, sizes)
            if tuple(dest.shape) != tuple(tensor.shape):
                raise ValueError(f"{path.name}: tensor {name!r} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(dest.shape)} from config.json")
            dest.copy_(tensor)
            # A checkpoint that is already fused (Phi-3's qkv_proj, gate_up_proj) fills every part.
            parts: list[str | None] = [part] if part else list(sizes.get(pname.split(".", 2)[-1], {}))
            pending.difference_update({(pname, p) for p in parts or [None]})
    if pending:
        missing = sorted(f"{p}" + (f" ({part} part)" if part else "") for p, part in pending)
        raise ValueError(f"{model_dir}: checkpoint lacks tensors for {', '.join(missing[:8])}"
                         + (f" and {len(missing) - 8} more" if len(missing) > 8 else ""))
    return model.eval().requires_grad_(False)


def _tensors(files: list[Path]) -> Iterator[tuple[Path, str, torch.Tensor]]:
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield path, name, f.get_tensor(name)


# (file, checkpoint name, the tensor's full shape, read(index) -> that part of the tensor)
LazyTensor = tuple[Path, str, tuple[int, ...], Callable[[tuple[slice, ...]], torch.Tensor]]


def _lazy_tensors(files: list[Path]) -> Iterator[LazyTensor]:
    """Each safetensors tensor unread: ``read`` fetches only the indexed part (``get_slice``)."""
    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                part = f.get_slice(name)
                yield path, name, tuple(part.get_shape()), part.__getitem__


def _sharded(tensors: Iterator[LazyTensor], config: ModelConfig,
             shard: ShardPlan) -> Iterator[tuple[Path, str, torch.Tensor]]:
    """This rank's part of each checkpoint tensor (ignored tensors are never read)."""
    for path, name, shape, read in tensors:
        target = _target(name, config)
        if target is None:
            continue
        src = shard.source(*target)
        if src is None:  # replicated: the whole tensor
            yield path, name, read(tuple(slice(None) for _ in shape))
            continue
        if len(shape) <= src.dim or shape[src.dim] != src.full:
            expected = "?" if len(shape) <= src.dim else src.full
            raise ValueError(f"{path.name}: tensor {name!r} has shape {tuple(shape)}, expected {expected} "
                             f"along dimension {src.dim} from config.json")
        lead = tuple(slice(None) for _ in range(src.dim))
        pieces = [read((*lead, slice(a, b))) for a, b in src.ranges if b > a]
        if src.pad_to is not None:  # the last rank's vocabulary rows beyond V: zeros
            have = sum(p.shape[src.dim] for p in pieces)
            if have < src.pad_to or not pieces:
                like = pieces[0] if pieces else read((*lead, slice(0, 1)))
                pad = list(like.shape)
                pad[src.dim] = src.pad_to - have
                pieces.append(like.new_zeros(pad))
        yield path, name, pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=src.dim)


def _open_gguf(path: Path) -> GGUFFile | None:
    """The GGUF checkpoint ``path`` names (a .gguf file, a folder holding one), else None."""
    found = gguf_path(path)
    return None if found is None else GGUFFile(found)


def _gguf_tensors(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype,
                  device: str | torch.device) -> tuple[int, Iterator[tuple[Path, str, torch.Tensor]]]:
    """(bytes after dequantization, the tensors under Hugging Face names, dequantized on ``device``).

    Lazy: one tensor is dequantized at a time, straight into ``dtype`` on the decoder's device.
    """
    arch = gguf.architecture
    heads = {"q": config.num_attention_heads, "k": config.num_key_value_heads}
    size = torch.empty((), dtype=dtype).element_size()
    total = sum(t.n_elements for t in gguf.tensors.values() if t.name not in CONFIG_TENSORS) * size

    def tensors() -> Iterator[tuple[Path, str, torch.Tensor]]:
        for t in gguf.tensors.values():
            if t.name in CONFIG_TENSORS:  # Phi-3's LongRoPE factors: already in the config
                continue
            try:
                name = hf_name(t.name, arch)
            except ValueError as e:
                raise ValueError(f"{gguf.path.name}: {e}") from None
            tensor = dequantize(t, dtype, device)
            part = needs_unpermute(t.name, arch)
            if part is not None:  # llama.cpp interleaved q/k rows for its RoPE: restore HF's order
                tensor = unpermute_qk(tensor, heads[part])
            if has_norm_offset(t.name, arch):  # Gemma: llama.cpp stored w + 1 for the (1 + w) norm
                tensor = tensor - 1
            for hf, piece in split_stacked(name, tensor):  # MoE: [E, ...] -> one tensor per expert
                yield gguf.path, hf, piece

    return total, tensors()


def _target(name: str, config: ModelConfig) -> tuple[str, str | None] | None:
    """Our (parameter name, fused part) for a checkpoint tensor name; None = ignore it."""
    if _SKIPPED.search(name):
        return None
    if name == "lm_head.weight":
        return None if config.tie_word_embeddings else (name, None)  # tied: the embedding serves
    name = name.removeprefix("model.")
    expert = checkpoint_target(name)  # one expert's tensor -> its slice of the stacked w13 / w2
    if expert is not None:
        return expert
    match = re.fullmatch(r"(layers\.\d+\.)(\w+\.\w+)\.(weight|bias)", name)
    if match and match.group(2) in _FUSED:
        fused, part = _FUSED[match.group(2)]
        return f"{match.group(1)}{fused}.{match.group(3)}", part
    return name, None


def _fused_sizes(config: ModelConfig) -> dict[str, dict[str, tuple[int, ...]]]:
    """Row ranges of each part inside a fused parameter, keyed by the name after ``layers.N.``."""
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    inter = config.intermediate_size
    qkv: dict[str, tuple[int, ...]] = {"q": (0, q), "k": (q, q + kv), "v": (q + kv, q + 2 * kv)}
    gate_up: dict[str, tuple[int, ...]] = {"gate": (0, inter), "up": (inter, 2 * inter)}
    return {
        "self_attn.qkv_proj.weight": qkv, "self_attn.qkv_proj.bias": qkv,
        "mlp.gate_up_proj.weight": gate_up, "mlp.gate_up_proj.bias": gate_up,
        **part_bounds(config),  # MoE: (expert, start, end) of stacked experts; the shared expert's gate/up
    }


def _slice(param: torch.Tensor, pname: str, part: str | None, sizes) -> torch.Tensor:
    if part is None:
        return param.data
    bounds = sizes[pname.split(".", 2)[-1]].get(part)
    if bounds is None:  # e.g. experts.9 in a checkpoint whose config.json says 8 experts
        raise ValueError(f"checkpoint tensor for {pname!r} part {part!r} has no place in the model "
                         "built from config.json (does config.json match the weights?)")
    if len(bounds) == 3:  # (expert, start, end): rows of one expert in a stacked MoE parameter
        expert, start, end = bounds
        return param.data[expert, start:end]
    start, end = bounds
    return param.data[start:end]
