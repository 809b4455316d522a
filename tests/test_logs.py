"""One logging setup: JSON fields, request ids from extra= and log_context, secrets redacted."""

from __future__ import annotations

import datetime as dt
import io
import json
import logging
import string

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchinfer.ops.logs import log_context, redact, request_extra, setup_logging


@pytest.fixture
def capture():
    """Installs batchinfer's handler writing to a buffer; restores the root logger afterwards."""
    root = logging.getLogger()
    saved_handlers, saved_level = list(root.handlers), root.level
    buffers: list[io.StringIO] = []

    def install(fmt: str, level: str = "DEBUG") -> io.StringIO:
        buf = io.StringIO()
        setup_logging(fmt, level, stream=buf)
        buffers.append(buf)
        return buf

    yield install
    for handler in list(root.handlers):
        if handler not in saved_handlers:
            root.removeHandler(handler)
    root.setLevel(saved_level)


def lines(buf: io.StringIO) -> list[str]:
    return [line for line in buf.getvalue().splitlines() if line]


def test_json_lines_carry_ts_level_logger_msg_and_request_ids(capture):
    buf = capture("json")
    logging.getLogger("batchinfer.scheduler.daemon").warning(
        "request %s rejected", "j1:7", extra=request_extra("j1", "j1:7"))
    logging.getLogger("batchinfer.worker").info("plain line")
    first, second = (json.loads(line) for line in lines(buf))
    assert first["level"] == "WARNING" and first["logger"] == "batchinfer.scheduler.daemon"
    assert first["msg"] == "request j1:7 rejected"
    assert (first["job_id"], first["request_id"]) == ("j1", "j1:7")
    assert dt.datetime.fromisoformat(first["ts"]).tzinfo is not None
    assert "job_id" not in second and second["msg"] == "plain line"


def test_log_context_binds_ids_and_extra_wins(capture):
    buf = capture("json")
    log = logging.getLogger("batchinfer.test")
    with log_context(job_id="jobA", worker="w1"):
        with log_context(request_id="jobA:3"):
            log.info("inner")
        log.info("outer", extra={"job_id": "override"})
    log.info("after")
    inner, outer, after = (json.loads(line) for line in lines(buf))
    assert (inner["job_id"], inner["request_id"], inner["worker"]) == ("jobA", "jobA:3", "w1")
    assert outer["job_id"] == "override" and "request_id" not in outer
    assert not {"job_id", "request_id", "worker"} & after.keys()


def test_log_context_rejects_unknown_fields():
    with pytest.raises(ValueError, match="colour"), log_context(colour="red"):
        pass


def test_human_format_tags_request_lines(capture):
    buf = capture("human")
    logging.getLogger("batchinfer.worker").error("engine error", extra=request_extra("j2", "j2:0"))
    (line,) = lines(buf)
    assert "ERROR batchinfer.worker: engine error [job_id=j2 request_id=j2:0]" in line


def test_secrets_are_redacted_from_messages_args_and_tracebacks(capture):
    for fmt in ("human", "json"):
        buf = capture(fmt)
        log = logging.getLogger("batchinfer.test")
        log.info("connecting to redis://default:Sup3rS3cret@redis:6379/0")
        log.info("settings %s", {"redis_password": "hunter2pass", "api_key": "sk-abcdef123"})
        try:
            raise ConnectionError("cannot reach rediss://alice:TopSecretPw@host:6380 (token=tok_998877)")
        except ConnectionError:
            log.exception("redis down")
        text = buf.getvalue()
        for secret in ("Sup3rS3cret", "hunter2pass", "sk-abcdef123", "TopSecretPw", "tok_998877"):
            assert secret not in text, (fmt, secret)
        assert "redis://default:***@redis:6379/0" in text
        assert "rediss://alice:***@host:6380" in text


def test_redaction_keeps_ordinary_token_counts():
    line = "prompt_tokens=5 max_tokens=7 num_token=3 redis://host:6379/0 http://h:80/a@b"
    assert redact(line) == line


@given(st.text(alphabet=string.ascii_letters + string.digits + "!$%*-_~", min_size=8, max_size=40))
def test_any_url_password_is_redacted(password):
    out = redact(f"url=redis://app:{password}@cache.internal:6379/2 ok")
    assert "redis://app:***@cache.internal:6379/2 ok" in out
    assert f":{password}@" not in out


def test_second_setup_replaces_the_first(capture):
    first = capture("human")
    second = capture("json")
    logging.getLogger("batchinfer.test").warning("once")
    assert first.getvalue() == ""
    assert len(lines(second)) == 1


def test_bad_format_and_level_name_what_is_wrong():
    with pytest.raises(ValueError, match="log format: 'xml'"):
        setup_logging("xml")
    with pytest.raises(ValueError, match="LOUD"):
        setup_logging("human", "LOUD")
