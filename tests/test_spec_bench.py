"""bench/spec_decode.py on a tiny random Llama: every configuration runs, the batch-size switch
shows in its rows, and a changed token is caught."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bench_scripts import bench_script


@pytest.fixture(scope="module")
def bench():
    with bench_script("spec_decode") as module:
        yield module


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A tiny random Llama with room for the long-tail job's 10-sentence documents (byte-level tokens)."""
    from batchinfer.workers.models.tiny import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("models") / "tiny-llama-2k", "LlamaForCausalLM",
                           max_position_embeddings=2048)


def test_a_small_run_measures_every_configuration_with_the_same_tokens(bench, tiny_model_dir, tmp_path,
                                                                        capsys):
    out = tmp_path / "spec.json"
    args = ["--model", str(tiny_model_dir), "--threads", "1", "--concurrency", "2", "20", "--min-tokens", "8",
            "--max-tokens", "8", "--tail-requests", "4", "--tail-tokens", "2", "--json", str(out)]
    assert bench.main(args) == 0
    result = json.loads(out.read_text())
    assert result["summary"]["identical"] is True
    rows = {(r["c"], r["config"]): r for r in result["rows"]}
    assert {config for c, config in rows if c == 2} == {"none", "ngram", "suffix", "prediction"}
    # 20 running is past the default switch (16): drafting is off for some steps, never when uncapped
    assert rows[(20, "ngram")]["off_share"] > 0
    assert rows[(20, "ngram, disable_by_batch_size=None")]["off_share"] == 0
    assert rows[(2, "none")]["acceptance"] is None and rows[(2, "ngram")]["ratio"] > 0
    assert [r["config"] for r in result["tail"]] == ["none", "ngram", "suffix"]
    assert len({r["tokens"] for r in result["tail"]}) == 1
    printed = capsys.readouterr().out.splitlines()
    assert any(line.startswith("== spec_decode:") and "identical to no speculation: yes" in line
               for line in printed)
    assert json.loads(printed[-1])["identical"] is True


def test_a_changed_token_is_reported_with_its_position(bench):
    base = bench.Run("none", {}, token_ids=[[1, 2, 3], [4, 5]])
    other = bench.Run("ngram", {}, token_ids=[[1, 2, 3], [4, 6]])
    found: list[str] = []
    bench.check_same(base, other, "c=1", found)
    assert found == ["c=1 ngram: request 1 differs from position 1 (2 vs 2 tokens)"]


def test_the_edit_task_predicts_its_own_paragraph(bench, tiny_llama):
    from batchinfer.workers.text.tokenizer import Tokenizer

    jobs = bench.make_jobs(Tokenizer.from_dir(tiny_llama), 6, seed=0, max_tokens=8)
    assert [j.task for j in jobs] == ["extract", "rewrite", "edit"] * 2
    assert all((j.prediction is not None) == (j.task == "edit") for j in jobs)
    assert jobs[2].params(use_predictions=True).prediction == jobs[2].prediction
    assert jobs[2].params(use_predictions=False).prediction is None
