"""EngineConfig's parts: each holds exactly its fields, together they cover every flat field
once, and each agrees with the flat config it is read from."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from batchinfer.workers.engine_config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelLoadConfig,
    ParallelConfig,
    StepSchedulerConfig,
    StructuredConfig,
)
from batchinfer.workers.speculative_config import SpeculativeConfig
from batchinfer.workers.structured_params import StructuredLimits

# part attribute -> (its class, its fields in order); a field reads the flat field of its name
# unless RENAMED says otherwise.
PARTS = {
    "model_load": (ModelLoadConfig, ["model", "dtype", "attention_backend", "enforce_eager", "seed",
                                     "quantization"]),
    "cache": (CacheConfig, ["block_size", "num_kv_blocks", "kv_cache_memory", "gpu_memory_utilization",
                            "enable_prefix_caching"]),
    "scheduler": (StepSchedulerConfig, ["max_num_batched_tokens", "max_num_seqs", "max_model_len"]),
    "parallel": (ParallelConfig, ["tensor_parallel_size", "tp_port", "tp_timeout_s", "devices"]),
    "lora": (LoRAConfig, ["lora_modules", "enable_lora", "max_loras", "max_cpu_loras", "max_lora_rank"]),
    "structured": (StructuredConfig, ["backend", "jump_forward", "grammar_cache_size", "grammar_threads",
                                      "limits"]),
}
RENAMED = {"devices": "device", "backend": "structured_outputs_backend", "limits": "structured_limits"}
# Flat fields that hold a frozen config of their own, which the component reads as is.
WHOLE = {"speculative_config": SpeculativeConfig}

# Every flat field set away from its default (but the device: CPUs only), so that a part reading
# the wrong field shows.
NON_DEFAULT = dict(model="some/model", dtype="bfloat16", device="cpu", block_size=8, num_kv_blocks=77,
                   kv_cache_memory=12345, gpu_memory_utilization=0.5, max_num_batched_tokens=333,
                   max_num_seqs=7,
                   enable_prefix_caching=False, max_model_len=99, attention_backend="sdpa", seed=42,
                   enforce_eager=True, structured_outputs_backend="xgrammar", jump_forward=False,
                   grammar_cache_size=3, grammar_threads=2,
                   structured_limits=StructuredLimits(max_spec_bytes=1000),
                   tensor_parallel_size=2, tp_port=29555, tp_timeout_s=5.0, lora_modules={},
                   enable_lora=False, max_loras=2, max_cpu_loras=5, max_lora_rank=8,
                   speculative_config={"method": "ngram", "num_speculative_tokens": 3},
                   quantization="auto")  # int8 / int4 refuse tensor_parallel_size 2


def test_each_part_holds_exactly_its_fields_and_the_parts_cover_every_flat_field_once():
    flat = [f.name for f in dataclasses.fields(EngineConfig)]
    covered = []
    for name, (cls, fields) in PARTS.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
        assert [f.name for f in dataclasses.fields(cls)] == fields, name
        covered += [RENAMED.get(f, f) for f in fields]
    for name, cls in WHOLE.items():
        assert dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen, name  # type: ignore[attr-defined]
    assert sorted(covered + list(WHOLE)) == sorted(flat)
    assert set(NON_DEFAULT) == set(flat)


def test_the_parts_agree_with_the_flat_config():
    config = EngineConfig(**NON_DEFAULT)
    for name, (cls, fields) in PARTS.items():
        part = getattr(config, name)
        assert type(part) is cls
        for field in fields:
            if field != "devices":  # derived: one per rank
                assert getattr(part, field) == getattr(config, RENAMED.get(field, field)), (name, field)
    assert config.parallel.devices == ("cpu", "cpu")  # one per rank
    assert config.model_load.dtype is torch.bfloat16
    assert config.structured.limits.max_spec_bytes == 1000
    assert config.speculative_config == SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.cache.block_size = 4  # type: ignore[misc]


def test_a_part_follows_the_flat_field_it_reads():
    config = EngineConfig(model="m", lora_modules={"a": "/adapters/a"})
    assert config.lora.enabled and config.lora_enabled and config.lora.lora_modules == {"a": "/adapters/a"}
    assert not EngineConfig(model="m").lora.enabled
    assert EngineConfig(model="m", enable_lora=True).lora.enabled
    config.max_num_seqs = 3  # the flat config stays the one users (and LLM(**kwargs)) set
    assert config.scheduler.max_num_seqs == 3
