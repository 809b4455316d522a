"""OpenAI batch input validation (batchinfer/api/validation.py) and the Batch object
(batchinfer/api/batch_objects.py): pure functions, no Redis, no server."""

from __future__ import annotations

import json

import openai
import pytest

from batchinfer.api.batch_objects import openai_batch
from batchinfer.api.validation import validate_batch_lines
from batchinfer.store.apibatches import ApiBatch, BatchKind, BatchState
from batchinfer.store.jobstore import JobRecord, JobStatus

CHAT = "/v1/chat/completions"


def line(custom_id: str = "a", url: str = CHAT, model: str = "m", **extra) -> bytes:
    obj = {"custom_id": custom_id, "method": "POST", "url": url,
           "body": {"model": model, "messages": [{"role": "user", "content": "hi"}]}, **extra}
    return json.dumps(obj).encode()


def check(lines, endpoint=CHAT, **kw):
    kw.setdefault("max_requests", 100)
    kw.setdefault("max_line_bytes", 10_000)
    return validate_batch_lines(lines, endpoint, **kw)


def codes(result) -> list[tuple[str, int | None, str | None]]:
    return [(e.code, e.line, e.param) for e in result.errors]


def test_a_good_file_counts_its_requests_and_names_its_model():
    result = check([line("a"), b"", line("b") + b"\r", b"  "])
    assert result.ok and result.requests == 2 and result.model == "m"


def test_a_byte_order_mark_on_the_first_line_is_not_an_error():
    assert check([b"\xef\xbb\xbf" + line("a")]).ok


@pytest.mark.parametrize("raw, code, param", [
    (b"{not json", "invalid_json_line", None),
    (b"[1, 2]", "invalid_json_line", None),
    (b"\xff\xfe{}", "invalid_json_line", None),
    (json.dumps({"method": "POST", "url": CHAT, "body": {"model": "m"}}).encode(),
     "missing_required_parameter", "custom_id"),
    (json.dumps({"custom_id": "x", "url": CHAT, "body": {"model": "m"}}).encode(),
     "missing_required_parameter", "method"),
    (json.dumps({"custom_id": "x", "method": "POST", "body": {"model": "m"}}).encode(),
     "missing_required_parameter", "url"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": CHAT}).encode(),
     "missing_required_parameter", "body"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": CHAT, "body": {}}).encode(),
     "missing_required_parameter", "body.model"),
    (json.dumps({"custom_id": 7, "method": "POST", "url": CHAT, "body": {"model": "m"}}).encode(),
     "invalid_value", "custom_id"),
    (json.dumps({"custom_id": "x", "method": "GET", "url": CHAT, "body": {"model": "m"}}).encode(),
     "invalid_method", "method"),
    (json.dumps({"custom_id": "x", "method": "POST", "url": CHAT, "body": "text"}).encode(),
     "invalid_value", "body"),
    (line("x", url="/v1/completions"), "url_mismatch", "url"),
])
def test_each_bad_line_is_reported_with_its_code_line_and_param(raw, code, param):
    result = check([line("ok"), raw])
    assert codes(result) == [(code, 2, param)]
    assert result.errors[0].message  # says what was wrong


def test_duplicate_custom_id_names_the_first_line():
    result = check([line("a"), line("b"), line("a")])
    assert codes(result) == [("duplicate_custom_id", 3, "custom_id")]
    assert "line 1" in result.errors[0].message


def test_a_second_model_is_a_model_mismatch():
    result = check([line("a", model="m"), line("b", model="other")])
    assert codes(result) == [("model_mismatch", 2, "body.model")]


def test_an_empty_file_is_one_error_without_a_line():
    assert codes(check([])) == [("empty_file", None, None)]
    assert codes(check([b"", b"   "])) == [("empty_file", None, None)]


def test_too_many_requests_stops_the_check():
    result = check([line(str(i)) for i in range(10)], max_requests=3)
    assert codes(result) == [("too_many_tasks", None, None)]
    assert "more than 3" in result.errors[0].message


def test_a_line_over_the_byte_limit():
    long = line("a", extra_text="x" * 500)
    result = check([line("b"), long], max_line_bytes=200)
    assert codes(result) == [("line_too_long", 2, None)]


def test_errors_stop_at_max_errors():
    result = check([b"nope"] * 10, max_errors=4)
    assert len(result.errors) == 4 and result.truncated


def test_to_dict_has_openais_keys():
    error = check([b"nope"]).errors[0]
    assert error.to_dict() == {"code": "invalid_json_line", "message": error.message, "line": 1,
                               "param": None}


# -- the Batch object --------------------------------------------------------------------------------


def api_batch(state: BatchState = BatchState.VALIDATING, **kw) -> ApiBatch:
    values = dict(id="batch_" + "0" * 32, kind=BatchKind.OPENAI, owner="key_1", endpoint=CHAT,
                  input_file_id="file-" + "1" * 24, output_file_id="file-" + "2" * 24,
                  error_file_id="file-" + "3" * 24, completion_window="24h", metadata={"k": "v"},
                  created_at=1_700_000_000_000, state=state)
    values.update(kw)
    return ApiBatch(**values)


def parsed(obj: dict) -> openai.types.Batch:
    return openai.types.Batch.model_validate(obj, strict=False)


def test_a_validating_batch():
    b = parsed(openai_batch(api_batch(), None))
    assert b.status == "validating" and b.created_at == 1_700_000_000
    assert b.expires_at == 1_700_000_000 + 24 * 3600
    assert b.output_file_id is None and b.error_file_id is None and b.metadata == {"k": "v"}
    assert b.request_counts.total == 0


def test_a_batch_that_failed_validation_shows_its_errors():
    errors = [{"code": "url_mismatch", "message": "m", "line": 3, "param": "url"}]
    b = parsed(openai_batch(api_batch(BatchState.FAILED, errors=errors, ended_at=1_700_000_005_000), None))
    assert b.status == "failed" and b.failed_at == 1_700_000_005
    assert [(e.code, e.line, e.param) for e in b.errors.data] == [("url_mismatch", 3, "url")]


def test_a_batch_cancelled_before_its_job():
    b = parsed(openai_batch(api_batch(BatchState.CANCELLED, ended_at=1_700_000_002_000), None))
    assert b.status == "cancelled" and b.cancelled_at == b.cancelling_at == 1_700_000_002


def record(status: JobStatus, **kw) -> JobRecord:
    values = dict(id="batch_" + "0" * 32, status=status, model="tiny", total=4, created_at=1_700_000_001_000,
                  in_progress_at=1_700_000_001_000, expires_at=1_700_086_401_000)
    values.update(kw)
    return JobRecord(**values)


def test_a_running_batch_reads_its_job():
    b = parsed(openai_batch(api_batch(BatchState.SUBMITTED, total=4),
                            record(JobStatus.IN_PROGRESS, completed=1)))
    assert b.status == "in_progress" and b.in_progress_at == 1_700_000_001 and b.model == "tiny"
    assert (b.request_counts.total, b.request_counts.completed, b.request_counts.failed) == (4, 1, 0)
    assert b.output_file_id is None and b.usage is None  # not exported yet


def test_files_and_usage_appear_once_exported_and_the_error_file_only_with_errors():
    done = dict(completed=4, completed_at=1_700_000_009_000, exported_at=1_700_000_009_000,
                prompt_tokens=40, completion_tokens=8, cached_tokens=16)
    b = parsed(openai_batch(api_batch(BatchState.SUBMITTED), record(JobStatus.COMPLETED, **done)))
    assert b.status == "completed" and b.output_file_id == "file-" + "2" * 24 and b.error_file_id is None
    assert (b.usage.input_tokens, b.usage.output_tokens, b.usage.total_tokens) == (40, 8, 48)
    assert b.usage.input_tokens_details.cached_tokens == 16

    cut = dict(done, completed=1, cancelled=2, failed=1, cancelled_at=1_700_000_009_000)
    b = parsed(openai_batch(api_batch(BatchState.SUBMITTED), record(JobStatus.CANCELLED, **cut)))
    assert b.status == "cancelled" and b.error_file_id == "file-" + "3" * 24
    assert (b.request_counts.completed, b.request_counts.failed) == (1, 3)


def test_an_expired_batch_reads_finalizing_until_its_files_are_written():
    ended = dict(completed=1, expired=2, expired_at=1_700_000_009_000)
    b = parsed(openai_batch(api_batch(BatchState.SUBMITTED), record(JobStatus.EXPIRED, **ended)))
    assert b.status == "finalizing" and b.expired_at is None and b.output_file_id is None
    b = parsed(openai_batch(api_batch(BatchState.SUBMITTED),
                            record(JobStatus.EXPIRED, exported_at=1_700_000_010_000, **ended)))
    assert b.status == "expired" and b.expired_at == 1_700_000_009
    assert b.output_file_id == "file-" + "2" * 24 and b.error_file_id == "file-" + "3" * 24


def test_a_submitted_batch_whose_job_is_not_open_yet_reads_validating():
    assert parsed(openai_batch(api_batch(BatchState.SUBMITTED), None)).status == "validating"


def test_the_start_job_is_found_by_its_path():
    from rq.utils import import_attribute

    from batchinfer.api.batch_start import start_batch
    from batchinfer.jobs.api_batches import START_JOB

    assert import_attribute(START_JOB) is start_batch
