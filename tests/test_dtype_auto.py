"""``dtype="auto"``: bfloat16 on a CPU with native bfloat16 (avx512_bf16 / AMX), else float32.

The probe is overridden with ``BATCHINFER_CPU_BF16`` both ways, so that each answer is tested on any
machine; the un-overridden engine test checks that what this machine's probe says is what runs.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import torch
from daemons import Stack
from tiny_embedders import make_tiny_embedding_model

from batchinfer import LLM
from batchinfer.workers.auto_dtype import CPU_BF16_ENV, auto_dtype, checkpoint_dtype, cpu_has_bf16
from batchinfer.workers.engine.embedder import EmbeddingEngine
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.serve import build_engine, parse_engine_options

CPU = torch.device("cpu")


@pytest.mark.parametrize(("forced", "expected"), [("1", torch.bfloat16), ("0", torch.float32)])
def test_the_probe_override_decides_the_cpu_dtype(monkeypatch, forced: str, expected: torch.dtype) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, forced)
    assert cpu_has_bf16() is (forced == "1")
    assert auto_dtype(CPU, "no-such-model") is expected
    config = EngineConfig(model="no-such-model", dtype="auto")
    assert config.dtype is expected and config.model_load.dtype is expected
    assert config.to_dict()["dtype"] == str(expected).removeprefix("torch.")  # what runs, not "auto"


def test_a_bad_override_and_a_bad_dtype_are_refused(monkeypatch) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, "yes")
    with pytest.raises(ValueError, match=CPU_BF16_ENV):
        cpu_has_bf16()
    with pytest.raises(ValueError, match="^dtype must be 'auto' or one of"):
        EngineConfig(model="m", dtype="int8")


def test_the_probe_agrees_with_the_cpu_flags(monkeypatch) -> None:
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    cpuinfo = Path("/proc/cpuinfo")
    if not cpuinfo.is_file():
        pytest.skip("no /proc/cpuinfo to compare with")
    flags = set(next((ln for ln in cpuinfo.read_text().splitlines() if ln.startswith("flags")), "").split())
    assert cpu_has_bf16() is bool(flags & {"avx512_bf16", "amx_bf16"})


def test_the_checkpoint_dtype_is_read_from_config_json(tmp_path: Path, tiny_llama: Path) -> None:
    assert checkpoint_dtype(str(tiny_llama)) == "float32"
    (tmp_path / "config.json").write_text(json.dumps({"dtype": "bfloat16"}))  # transformers 5's key
    assert checkpoint_dtype(str(tmp_path)) == "bfloat16"
    assert checkpoint_dtype(str(tmp_path / "model.gguf")) is None  # a GGUF names none


@pytest.mark.parametrize("forced", [None, "1", "0"])
def test_an_auto_engine_generates_in_the_probed_dtype(monkeypatch, tiny_llama: Path,
                                                      forced: str | None) -> None:
    if forced is None:  # this machine's own answer
        monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    else:
        monkeypatch.setenv(CPU_BF16_ENV, forced)
    expected = torch.bfloat16 if cpu_has_bf16() else torch.float32
    llm = LLM(model=tiny_llama, dtype="auto", num_kv_blocks=16, max_num_seqs=2)
    engine = llm.engine
    assert engine.model.dtype is expected
    assert all(k.dtype is expected for k, _ in engine.runner.kv_caches)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9] * 20}], params)
    assert [len(o.outputs[0].token_ids) for o in outs] == [6, 6]


def test_an_auto_embedder_runs_in_the_probed_dtype(monkeypatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    folder = make_tiny_embedding_model(tmp_path / "bert", "bert")
    engine = EmbeddingEngine.from_model(folder, dtype="auto", max_num_batched_tokens=64, max_num_seqs=2)
    assert next(engine.model.parameters()).dtype is torch.bfloat16
    engine.add_request("a", prompt_token_ids=[2, 5, 6, 3])
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    (out,) = outs
    assert out.data.dtype == torch.float32 and torch.isfinite(out.data).all()  # vectors leave as float32


def test_the_worker_engine_option_builds_an_auto_engine(monkeypatch, caplog, tiny_llama: Path) -> None:
    monkeypatch.setenv(CPU_BF16_ENV, "1")
    options = parse_engine_options(["dtype=auto", "num_kv_blocks=16"])
    with caplog.at_level("INFO", logger="batchinfer.workers.service.serve"):
        engine = build_engine(str(tiny_llama), "cpu", False, options)
    assert engine.model.dtype is torch.bfloat16
    assert "in bfloat16 (dtype auto)" in caplog.text


def test_a_worker_daemon_started_with_dtype_auto_says_what_runs(redis_server, tiny_llama: Path,
                                                                tmp_path: Path) -> None:
    stack = Stack(redis_server.url, tmp_path)
    stack.worker("w", tiny_llama, options={"dtype": "auto", "num_kv_blocks": 16}, env={CPU_BF16_ENV: "0"})
    log = tmp_path / "w.log"
    try:
        deadline = time.monotonic() + 60
        while "(dtype auto)" not in (log.read_text() if log.exists() else ""):
            assert stack.procs["w"].poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.1)
        assert "in float32 (dtype auto)" in log.read_text()
    finally:
        stack.stop("w")
