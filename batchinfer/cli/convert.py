"""``batchinfer convert FILE.gguf OUTDIR``: a GGUF checkpoint -> a Hugging Face model folder.

The folder is what ``LLM(model=OUTDIR)``, ``batchinfer worker --model OUTDIR`` and transformers'
``from_pretrained(OUTDIR)`` load: ``model.safetensors`` (or shards + index) with the tensors
dequantized into one dtype, ``config.json`` from the GGUF metadata (the same mapping the GGUF
loader uses, ``workers/models/gguf/hf_config.py``), and the tokenizer rebuilt from the metadata
(``tokenizer.json``, ``tokenizer_config.json`` with the chat template, ``generation_config.json``).

One tensor is dequantized at a time and each shard is written as soon as it is full, so memory
stays near one shard (``--shard-size``) whatever the model's size. Every file is written under a
temporary name and renamed, so an interrupted conversion never leaves a file that looks whole.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

DTYPES = ("auto", "float16", "bfloat16", "float32")
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
FLOAT16_MAX = 65504.0


def convert(source: str | Path, outdir: str | Path, dtype: str = "auto", force: bool = False,
            shard_bytes: int = 5 * 10**9, say: Callable[[str], None] = lambda msg: None) -> Path:
    """Write the Hugging Face folder of GGUF checkpoint ``source`` into ``outdir``; return ``outdir``.

    ``dtype``: ``auto`` (bfloat16 when the file holds BF16 tensors, else float16: exact for F16
    tensors and the usual quantized blocks, half float32's size), ``float16``, ``bfloat16`` or
    ``float32``. A non-empty ``outdir`` is refused unless ``force`` (then the files this command
    writes are replaced and earlier weight files removed). ``FileExistsError`` for that,
    ``FileNotFoundError`` / ``ValueError`` naming what is wrong with the file.
    """
    import torch

    from batchinfer.workers.models.gguf import GGUFFile, hf_config
    from batchinfer.workers.models.gguf.tokenizer import tokenizer_files

    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise FileExistsError(f"{outdir} exists and is not a folder")
    if outdir.is_dir() and any(outdir.iterdir()) and not force:
        raise FileExistsError(f"{outdir} is not empty; give --force to write into it anyway")
    gguf = GGUFFile(source)  # FileNotFoundError / ValueError name the file
    config, generation = hf_config(gguf)
    files = tokenizer_files(gguf)  # before any weight is written: a bad tokenizer fails fast
    if dtype == "auto":
        has_bf16 = any(t.tensor_type.name == "BF16" for t in gguf.tensors.values())
        dtype = "bfloat16" if has_bf16 else "float16"
    torch_dtype = getattr(torch, dtype)
    outdir.mkdir(parents=True, exist_ok=True)
    for old in [*outdir.glob("model*.safetensors"), outdir / INDEX_FILE]:
        old.unlink(missing_ok=True)  # a previous layout (single vs sharded) must not linger

    say(f"{gguf.path.name}: {config['architectures'][0]}, {len(gguf.tensors)} tensors -> {dtype}")
    tensors = _hf_tensors(gguf, config, torch_dtype)
    weights = _write_weights(outdir, tensors, _sizes(gguf, config, torch_dtype), shard_bytes)
    config = {**config, "torch_dtype": dtype}
    _write(outdir / "config.json", (json.dumps(config, indent=2) + "\n").encode())
    tokenizer_generation = json.loads(files.get("generation_config.json", b"{}"))
    files["generation_config.json"] = (json.dumps({**generation, **tokenizer_generation}, indent=2)
                                       + "\n").encode()
    for name, data in files.items():
        _write(outdir / name, data)
    say(f"wrote {', '.join(weights)}, config.json, {', '.join(files)} to {outdir}")
    return outdir


def _hf_tensors(gguf: Any, config: dict[str, Any], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The GGUF file's tensors under their Hugging Face names, dequantized one at a time into ``dtype``
    (llama.cpp's q/k row permutation undone)."""
    import torch

    from batchinfer.workers.models.gguf import dequantize, hf_name, needs_unpermute, unpermute_qk

    arch = gguf.architecture
    heads = {"q": config["num_attention_heads"],
             "k": config.get("num_key_value_heads") or config["num_attention_heads"]}
    for t in gguf.tensors.values():
        try:
            name = hf_name(t.name, arch)
        except ValueError as e:
            raise ValueError(f"{gguf.path.name}: {e}") from None
        tensor = dequantize(t, torch.float32)
        part = needs_unpermute(t.name, arch)
        if part is not None:
            tensor = unpermute_qk(tensor, heads[part])
        if dtype == torch.float16 and tensor.numel() and float(tensor.abs().max()) > FLOAT16_MAX:
            raise ValueError(f"{gguf.path.name}: tensor {t.name} ({name}) holds values beyond float16's "
                             "range; give --dtype bfloat16 or float32")
        yield name, tensor.to(dtype).contiguous()


def _sizes(gguf: Any, config: dict[str, Any], dtype: torch.dtype) -> list[int]:
    """Bytes of each tensor in ``dtype``, in file order (to plan the shards before writing any)."""
    import torch

    size = torch.empty((), dtype=dtype).element_size()
    return [int(t.n_elements) * size for t in gguf.tensors.values()]


def _write_weights(outdir: Path, tensors: Iterator[tuple[str, torch.Tensor]], sizes: list[int],
                   shard_bytes: int) -> list[str]:
    """One ``model.safetensors``, or shards of at most ``shard_bytes`` (a bigger tensor gets a shard of
    its own) and their index, as transformers' ``save_pretrained`` lays them out; the file names."""
    plan: list[int] = []  # tensors per shard
    filled = 0
    for size in sizes:
        if plan and filled + size <= shard_bytes:
            plan[-1] += 1
            filled += size
        else:
            plan.append(1)
            filled = size
    if len(plan) <= 1:
        names = [SINGLE_FILE]
    else:
        names = [f"model-{i + 1:05d}-of-{len(plan):05d}.safetensors" for i in range(len(plan))]
    weight_map: dict[str, str] = {}
    it = iter(tensors)
    for fname, count in zip(names, plan or [0], strict=True):
        shard = dict(next(it) for _ in range(count))
        _save(shard, outdir / fname)
        weight_map.update(dict.fromkeys(shard, fname))
    if len(names) > 1:
        index = {"metadata": {"total_size": sum(sizes)}, "weight_map": weight_map}
        _write(outdir / INDEX_FILE, (json.dumps(index, indent=2) + "\n").encode())
        names.append(INDEX_FILE)
    return names


def _save(tensors: dict[str, torch.Tensor], dest: Path) -> None:
    from safetensors.torch import save_file

    tmp = dest.with_name(f".{dest.name}.tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, dest)


def _write(dest: Path, data: bytes) -> None:
    tmp = dest.with_name(f".{dest.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, dest)
