"""Predicted outputs in the results: the engine's accepted / rejected prediction tokens become the
row's counts (workers/service/rows.py), the Parquet columns, and OpenAI's
``usage.completion_tokens_details`` (jobs/openai_lines.py), as OpenAI reports a ``prediction``."""

from __future__ import annotations

import json

import pyarrow.parquet as pq

from batchinfer.jobs.formats import protocol_row
from batchinfer.jobs.openai_lines import openai_line
from batchinfer.jobs.output import write_rows
from batchinfer.protocol.rows import BatchRequest, ResultRow
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.outputs import RequestOutput
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.rows import generation_row

CHAT = "/v1/chat/completions"
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12] * 4


def finished(engine: Engine, params: SamplingParams) -> RequestOutput:
    """The one request's final output, stepping until the engine is idle."""
    engine.add_request("j:0", prompt_token_ids=PROMPT, sampling_params=params)
    done = None
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done = out
    assert done is not None
    return done


def chat_row(params: SamplingParams, out: RequestOutput) -> ResultRow:
    request = BatchRequest(request_id="j:0", job_id="j", idx=0, prompt_token_ids=PROMPT,
                           sampling_params=params.to_dict(), model="tiny-llama", line=1, url=CHAT)
    return generation_row(request, out, worker="w1")


def prediction_usage(row: dict) -> tuple[int, int]:
    details = json.loads(openai_line(row))["response"]["body"]["usage"]["completion_tokens_details"]
    return details["accepted_prediction_tokens"], details["rejected_prediction_tokens"]


def test_a_predictions_counts_reach_the_openai_usage(engine_factory, tmp_path):
    plain_params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = finished(engine_factory(), plain_params)
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, prediction=plain.outputs[0].text)
    out = finished(engine_factory(), params)
    assert out.outputs[0].token_ids == plain.outputs[0].token_ids  # the prediction changes no output
    completion = out.outputs[0]
    want = (completion.accepted_prediction_tokens, completion.rejected_prediction_tokens)
    assert want[0] is not None and want[0] > 0, want

    row, plain_row = chat_row(params, out), chat_row(plain_params, plain)
    assert (row.accepted_prediction_tokens, row.rejected_prediction_tokens) == want
    assert prediction_usage(row.to_dict()) == want
    assert (plain_row.accepted_prediction_tokens, plain_row.rejected_prediction_tokens) == (None, None)
    assert prediction_usage(plain_row.to_dict()) == (0, 0)  # no prediction: OpenAI's zeros

    # through a Parquet results file and back, as an export reads it
    path = write_rows([row, plain_row], str(tmp_path / "r.parquet"))
    back = [protocol_row(r) for r in pq.read_table(path).to_pylist()]
    assert [(r["accepted_prediction_tokens"], r["rejected_prediction_tokens"]) for r in back] == [
        want, (None, None)]
    assert [prediction_usage({**r, "url": CHAT}) for r in back] == [want, (0, 0)]
