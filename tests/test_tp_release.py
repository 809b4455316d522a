"""A tensor-parallel ``LLM`` deleted without ``close()`` releases its torch.distributed group when
it is collected (issue 28): a notebook user who deletes one and builds another in the same process
gets a working engine, not "this process already belongs to a torch.distributed group"."""

from __future__ import annotations

import gc
import socket
import weakref

import pytest
import torch.distributed as dist

from batchinfer.workers.engine.tp_ranks import RankFailure
from batchinfer.workers.entrypoints.llm import LLM
from batchinfer.workers.models.tiny import make_tiny_model
from batchinfer.workers.sampling_params import SamplingParams

PROMPTS = [{"prompt_token_ids": [5, 6, 7, 8]}, {"prompt_token_ids": [9, 10]}]
PARAMS = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def _alive(pid: int) -> bool:
    """``pid`` is running and not a zombie."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_deleted_tp_llm_releases_its_group_and_a_new_one_starts(tmp_path):
    model = make_tiny_model(tmp_path / "llama")
    first = LLM(model, tensor_parallel_size=2, num_kv_blocks=32)
    ref = [o.outputs[0].token_ids for o in first.generate(PROMPTS, PARAMS, use_tqdm=False)]
    ranks = weakref.ref(first.engine.ranks)
    pid = first.engine.ranks.procs[0].pid
    del first
    gc.collect()  # nothing should need it (no cycle keeps the LLM alive), but a notebook may run it
    assert ranks() is None, "something still holds the deleted LLM's ranks"
    assert not dist.is_initialized()
    assert not _alive(pid)
    second = LLM(model, tensor_parallel_size=2, num_kv_blocks=32)
    try:
        got = [o.outputs[0].token_ids for o in second.generate(PROMPTS, PARAMS, use_tqdm=False)]
    finally:
        second.close()
    assert got == ref
    assert not dist.is_initialized()  # close() left the group too


def test_a_tp_llm_starts_after_one_whose_rendezvous_failed(tmp_path):
    """A rendezvous that failed (here: the port is taken) leaves no trace that stops the next TP
    ``LLM`` of the process: torch's count of default groups is reset as ``close()`` resets it."""
    model = make_tiny_model(tmp_path / "llama")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(RankFailure, match="port"):
            LLM(model, tensor_parallel_size=2, num_kv_blocks=32, tp_port=taken.getsockname()[1])
    llm = LLM(model, tensor_parallel_size=2, num_kv_blocks=32, tp_timeout_s=20)  # bounds a failure
    try:
        [out] = llm.generate(PROMPTS[:1], PARAMS, use_tqdm=False)
    finally:
        llm.close()
    assert len(out.outputs[0].token_ids) == PARAMS.max_tokens
