"""Pooling (workers/models/pooling.py): the pure functions against naive loops, and what a folder's
files say."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from tiny_embedders import make_tiny_embedding_model

from batchinfer.workers.models.pooling import PoolingConfig, embedding_kind, finish, is_embedding_model, pool
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.pooling_params import PoolingParams


def packed(lengths: list[int], width: int = 8, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    return torch.randn(int(cu[-1]), width, generator=gen), cu


@pytest.mark.parametrize("kind", ["mean", "cls", "last"])
def test_pool_matches_a_naive_loop(kind: str) -> None:
    lengths = [1, 5, 17, 2, 40]
    hidden, cu = packed(lengths)
    naive = []
    for s, e in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        seq = hidden[s:e]
        naive.append({"mean": seq.mean(0), "cls": seq[0], "last": seq[-1]}[kind])
    got = pool(hidden, cu, kind)
    assert got.shape == (len(lengths), hidden.shape[1]) and got.dtype == torch.float32
    torch.testing.assert_close(got, torch.stack(naive), rtol=1e-6, atol=1e-6)


def test_pool_reads_bfloat16_as_float32_and_refuses_unknown_kinds() -> None:
    hidden, cu = packed([3, 4])
    got = pool(hidden.bfloat16(), cu, "mean")
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, pool(hidden.bfloat16().float(), cu, "mean"))
    with pytest.raises(ValueError, match="pooling_type"):
        pool(hidden, cu, "max")


def test_finish_truncates_before_normalising() -> None:
    vectors = torch.randn(3, 16, generator=torch.Generator().manual_seed(1)) * 5
    out = finish(vectors, 4, normalize=True)
    assert out.shape == (3, 4)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(3))
    torch.testing.assert_close(out, vectors[:, :4] / vectors[:, :4].norm(dim=-1, keepdim=True))
    torch.testing.assert_close(finish(vectors, 16, normalize=False), vectors)


def _write(path: Path, data: object) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data), encoding="utf-8")


def test_sentence_transformers_files_set_the_defaults(tmp_path: Path) -> None:
    bert = PoolingConfig.from_dir(make_tiny_embedding_model(tmp_path / "bert"), default_type="cls")
    assert (bert.pooling_type, bert.normalize, bert.matryoshka) == ("mean", True, False)
    roberta = PoolingConfig.from_dir(make_tiny_embedding_model(tmp_path / "rob", "roberta"), "mean")
    assert (roberta.pooling_type, roberta.normalize) == ("cls", False)  # no Normalize module
    qwen = PoolingConfig.from_dir(make_tiny_embedding_model(tmp_path / "qwen", "qwen3"), "mean")
    assert (qwen.pooling_type, qwen.normalize) == ("last", True)


def test_without_sentence_transformers_files_the_defaults_are_vllms(tmp_path: Path) -> None:
    folder = make_tiny_embedding_model(tmp_path / "bert")
    (folder / "modules.json").unlink()
    for default in ("cls", "last"):
        config = PoolingConfig.from_dir(folder, default)
        assert (config.pooling_type, config.normalize, config.source) == (default, True, "defaults")


def test_unsupported_pooling_modes_are_refused(tmp_path: Path) -> None:
    folder = make_tiny_embedding_model(tmp_path / "bert")
    _write(folder / "1_Pooling" / "config.json", {"pooling_mode_max_tokens": True})
    with pytest.raises(ValueError, match="pooling_mode_max_tokens"):
        PoolingConfig.from_dir(folder, "cls")
    _write(folder / "1_Pooling" / "config.json", {"pooling_mode": "lasttoken"})
    assert PoolingConfig.from_dir(folder, "cls").pooling_type == "last"


def test_resolve_applies_overrides_and_checks_dimensions() -> None:
    config = PoolingConfig("mean", True)
    assert config.resolve(PoolingParams(), 64) == ("mean", True, 64)
    params = PoolingParams(pooling_type="CLS", normalize=False, dimensions=64)
    assert config.resolve(params, 64) == ("cls", False, 64)
    with pytest.raises(ValueError, match="^dimensions: this model does not support Matryoshka"):
        config.resolve(PoolingParams(dimensions=32), 64)
    with pytest.raises(ValueError, match="^dimensions 65 is larger"):
        config.resolve(PoolingParams(dimensions=65), 64)


def test_matryoshka_from_config_json(tmp_path: Path) -> None:
    listed = make_tiny_embedding_model(tmp_path / "listed", matryoshka_dimensions=[16, 32, 64])
    config = PoolingConfig.from_dir(listed, "cls")
    assert config.matryoshka and config.matryoshka_dimensions == (16, 32, 64)
    assert config.resolve(PoolingParams(dimensions=32), 64)[2] == 32
    with pytest.raises(ValueError, match="^dimensions 24 is not one of"):
        config.resolve(PoolingParams(dimensions=24), 64)
    free = PoolingConfig.from_dir(make_tiny_embedding_model(tmp_path / "free", is_matryoshka=True), "cls")
    assert free.resolve(PoolingParams(dimensions=24), 64)[2] == 24
    with pytest.raises(ValueError, match="matryoshka_dimensions must be a list"):
        PoolingConfig.from_dir(make_tiny_embedding_model(tmp_path / "bad", matryoshka_dimensions=[0]), "cls")


def test_embedding_kind_from_the_folder(tmp_path: Path) -> None:
    assert embedding_kind(make_tiny_embedding_model(tmp_path / "bert")) == "encoder"
    assert embedding_kind(make_tiny_embedding_model(tmp_path / "xlmr", "xlm-roberta")) == "encoder"
    assert embedding_kind(make_tiny_embedding_model(tmp_path / "qwen", "qwen3")) == "decoder"
    llama = make_tiny_model(tmp_path / "llama")
    assert not is_embedding_model(llama)
    _write(llama / "modules.json", [{"idx": 0, "type": "sentence_transformers.models.Transformer"}])
    assert embedding_kind(llama) == "decoder"  # a decoder folder with sentence-transformers files
    assert not is_embedding_model(tmp_path / "missing")
