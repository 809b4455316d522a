"""Speculative decoding's settings and per-request switches (issue 34), from every way in to the engine:
``SpeculativeConfig`` (a dict in vLLM's shape, JSON text, ``EngineConfig``, the CLI's
``--speculative-config``), ``SamplingParams.speculative`` / ``.prediction`` from request bodies
through the scheduler's staging and the worker's feeder, and the engine's ``Request``
(``prediction_token_ids``, ``spec_group``)."""

from __future__ import annotations

import json

import click
import pytest
from click.testing import CliRunner
from daemons import ThreadedWorker, wait_until, worker_daemon

from batchinfer.cli.daemons import speculative_options
from batchinfer.cli.main import cli
from batchinfer.config import Settings
from batchinfer.keys import WORKERS_GROUP, Keys
from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import IntakeEntry, RequestError
from batchinfer.protocol.rows import BatchRequest
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.intake import params_dict
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.sampling_params import SamplingParams
from batchinfer.workers.service.echo_engine import EchoEngine
from batchinfer.workers.speculative_config import DEFAULT_DISABLE_BY_BATCH_SIZE, SpeculativeConfig
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

USER = [{"role": "user", "content": "Rename x to y in: x = 1; print(x)"}]
PREDICTED = "y = 1; print(y)"


def chat_line(**body) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "m", "messages": USER, **body}}


def completion_line(**body) -> dict:
    return {"custom_id": "c1", "method": "POST", "url": "/v1/completions",
            "body": {"model": "m", "prompt": "x", **body}}


def error_of(body) -> RequestError:
    with pytest.raises(RequestError) as info:
        parse_body(body)
    return info.value


# -- SpeculativeConfig ------------------------------------------------------------------------------


def test_the_defaults_are_the_contracts():
    c = SpeculativeConfig()
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max, c.model) == \
           (None, 4, 2, 5, None)
    assert c.disable_by_batch_size == DEFAULT_DISABLE_BY_BATCH_SIZE == 16 and c.use_predictions is True
    assert (c.suffix_max_depth, c.suffix_max_cached_requests, c.suffix_min_token_prob,
            c.suffix_max_spec_factor, c.draft_num_kv_blocks) == (24, 1000, 0.1, 1.0, None)


def test_from_value_takes_none_a_dict_its_json_and_an_instance():
    assert SpeculativeConfig.from_value(None) is None
    given = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 4}
    c = SpeculativeConfig.from_value(given)
    assert (c.method, c.num_speculative_tokens, c.prompt_lookup_min, c.prompt_lookup_max) == \
           ("ngram", 3, 1, 4)
    assert SpeculativeConfig.from_value(json.dumps(given)) == c
    assert SpeculativeConfig.from_value(c) is c
    assert SpeculativeConfig.from_value(c.to_dict()) == c  # the round trip
    assert json.loads(json.dumps(c.to_dict())) == c.to_dict()
    assert SpeculativeConfig.from_value("{}") == SpeculativeConfig()  # predictions only


def test_vllm_spellings_are_read_as_ours():
    c = SpeculativeConfig.from_value({"method": "draft_model", "model": "/models/draft"})
    assert (c.method, c.model) == ("draft", "/models/draft")
    assert SpeculativeConfig.from_value({"model": "/models/draft"}).method == "draft"  # a model: a draft
    c = SpeculativeConfig.from_value({"method": "suffix", "suffix_decoding_max_tree_depth": 32,
                                      "suffix_decoding_max_cached_requests": 0,
                                      "suffix_decoding_min_token_prob": 0,
                                      "suffix_decoding_max_spec_factor": 2})
    assert (c.suffix_max_depth, c.suffix_max_cached_requests, c.suffix_min_token_prob,
            c.suffix_max_spec_factor) == (32, 0, 0.0, 2.0)
    assert isinstance(c.suffix_min_token_prob, float) and "suffix_decoding_max_tree_depth" not in c.to_dict()
    assert SpeculativeConfig(disable_by_batch_size=None).disable_by_batch_size is None  # never off


@pytest.mark.parametrize("value,field,says", [
    ({"method": "eagle"}, "method", "ngram, suffix, draft"),
    ({"method": 3}, "method", "got 3"),
    ({"method": "draft"}, "model", "needed by method 'draft'"),
    ({"method": "ngram", "model": "/d"}, "model", "not of method 'ngram'"),
    ({"model": ""}, "model", "draft model folder"),
    ({"num_speculative_tokens": 0}, "num_speculative_tokens", "in [1, 32]"),
    ({"num_speculative_tokens": 33}, "num_speculative_tokens", "in [1, 32]"),
    ({"num_speculative_tokens": True}, "num_speculative_tokens", "integer"),
    ({"num_speculative_tokens": 2.0}, "num_speculative_tokens", "integer"),
    ({"prompt_lookup_min": 4, "prompt_lookup_max": 3}, "prompt_lookup_min", "<= prompt_lookup_max"),
    ({"prompt_lookup_max": 33}, "prompt_lookup_max", "in [1, 32]"),
    ({"prompt_lookup_min": 0}, "prompt_lookup_min", "in [1, 32]"),
    ({"draft_num_kv_blocks": 0}, "draft_num_kv_blocks", ">= 1"),
    ({"disable_by_batch_size": 0}, "disable_by_batch_size", ">= 1"),
    ({"suffix_max_depth": 1}, "suffix_max_depth", "in [2, 256]"),
    ({"suffix_max_depth": 257}, "suffix_max_depth", "in [2, 256]"),
    ({"suffix_max_cached_requests": -1}, "suffix_max_cached_requests", ">= 0"),
    ({"suffix_min_token_prob": 1.5}, "suffix_min_token_prob", "in [0, 1]"),
    ({"suffix_min_token_prob": "0.5"}, "suffix_min_token_prob", "a number"),
    ({"suffix_max_spec_factor": 0}, "suffix_max_spec_factor", "> 0"),
    ({"suffix_max_spec_factor": float("inf")}, "suffix_max_spec_factor", "> 0"),
    ({"use_predictions": "yes"}, "use_predictions", "boolean"),
    ({"suffix_max_depth": 8, "suffix_decoding_max_tree_depth": 8}, "suffix_max_depth", "given twice"),
    ({"speculative_model": "/d"}, "speculative_model", "allowed: method, num_speculative_tokens"),
])
def test_every_bad_setting_is_named(value, field, says):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_value(value)
    assert str(info.value).startswith(f"speculative_config.{field} ") and says in str(info.value), info.value


@pytest.mark.parametrize("value,says", [
    ("{method: ngram}", "invalid JSON"), ("", "invalid JSON"), ("[1, 2]", "got list"), (7, "got int")])
def test_a_value_that_is_no_object_is_refused_as_a_whole(value, says):
    with pytest.raises(ValueError) as info:
        SpeculativeConfig.from_value(value)
    assert str(info.value).startswith("speculative_config must be") and says in str(info.value), info.value


def test_the_config_is_frozen():
    with pytest.raises(AttributeError):
        SpeculativeConfig().method = "ngram"  # type: ignore[misc]


def test_the_engine_config_holds_one_and_stays_json_ready():
    assert EngineConfig(model="m").speculative_config is None
    config = EngineConfig(model="m", speculative_config={"method": "suffix", "num_speculative_tokens": 8})
    assert config.speculative_config == SpeculativeConfig(method="suffix", num_speculative_tokens=8)
    as_json = json.loads(json.dumps(config.to_dict()))
    assert as_json["speculative_config"] == config.speculative_config.to_dict()
    assert EngineConfig(**{**as_json, "dtype": "float32"}).speculative_config == config.speculative_config
    from_json = EngineConfig(model="m", speculative_config='{"method": "ngram"}')
    assert from_json.speculative_config.method == "ngram"
    # a draft model runs on rank 0's device: allowed with tensor parallelism
    tp = EngineConfig(model="m", tensor_parallel_size=2, speculative_config={"model": "/d"})
    assert tp.speculative_config.method == "draft"
    with pytest.raises(ValueError, match=r"^speculative_config\.num_speculative_tokens "):
        EngineConfig(model="m", speculative_config={"num_speculative_tokens": 0})


# -- SamplingParams ---------------------------------------------------------------------------------


def test_the_sampling_switches_default_to_on_and_no_prediction():
    p = SamplingParams()
    assert p.speculative is True and p.prediction is None
    p = SamplingParams.from_dict({"speculative": False, "prediction": PREDICTED})
    assert (p.speculative, p.prediction) == (False, PREDICTED)
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict({"speculative": None, "prediction": None}) == SamplingParams()
    assert {"speculative", "prediction"} <= set(SamplingParams.FIELDS)


@pytest.mark.parametrize("given,says", [
    ({"speculative": 0}, "speculative must be a boolean"), ({"speculative": "false"}, "speculative must be"),
    ({"prediction": 5}, "prediction must be a string"),
    ({"prediction": {"type": "content"}}, "prediction must be a string")])
def test_bad_switches_are_refused_naming_the_field(given, says):
    with pytest.raises(ValueError, match=f"^{says}"):
        SamplingParams.from_dict(given)


# -- request bodies ---------------------------------------------------------------------------------


@pytest.mark.parametrize("content", [PREDICTED, [{"type": "text", "text": "y = 1; "},
                                                 {"type": "text", "text": "print(y)"}]])
def test_a_chat_prediction_reaches_the_sampling_params(content):
    spec = parse_body(chat_line(prediction={"type": "content", "content": content}))
    assert spec.sampling_params.prediction == spec.prediction == PREDICTED
    assert spec.sampling_params.speculative is True
    plain = parse_body({"messages": USER, "prediction": {"type": "content", "content": content}})
    assert plain.sampling_params.prediction == PREDICTED
    assert parse_body(chat_line()).sampling_params.prediction is None


@pytest.mark.parametrize("body", [chat_line(speculative=False), completion_line(speculative=False),
                                  {"prompt": "x", "speculative": False},
                                  {"messages": USER, "speculative": False}])
def test_speculative_false_passes_through(body):
    assert parse_body(body).sampling_params.speculative is False


def test_speculative_true_or_null_is_the_default():
    assert parse_body({"prompt": "x", "speculative": True}).sampling_params.speculative is True
    assert parse_body(completion_line(speculative=None)).sampling_params.speculative is True


@pytest.mark.parametrize("body,field,says", [
    ({"prompt": "x", "speculative": "no"}, "speculative", "must be a boolean"),
    (chat_line(speculative=1), "speculative", "must be a boolean"),
    (completion_line(speculative=[False]), "speculative", "must be a boolean"),
    # a completion (prompt) line's prediction stays refused, as OpenAI's
    (completion_line(prediction={"type": "content", "content": "y"}), "prediction", "for chat messages"),
    ({"prompt": "x", "prediction": {"type": "content", "content": "y"}}, "prediction", "for chat messages"),
    # the body takes OpenAI's object, not the bare text SamplingParams holds
    ({"messages": USER, "prediction": PREDICTED}, "prediction", "\"type\": \"content\""),
    (chat_line(prediction={"type": "content", "content": 3}), "prediction.content", ""),
])
def test_bad_values_are_refused_naming_the_field(body, field, says):
    err = error_of(body)
    assert (err.code, err.field) == ("invalid_request", field) and says in str(err), err


def test_a_batch_element_carries_the_switches_only_when_a_line_sets_them():
    default = params_dict(parse_body(chat_line()).sampling_params)
    assert "speculative" not in default and "prediction" not in default  # as older workers read it
    assert SamplingParams.from_dict(default) == SamplingParams(max_tokens=None)
    spec = parse_body(chat_line(speculative=False, prediction={"type": "content", "content": PREDICTED}))
    given = params_dict(spec.sampling_params)
    assert (given["speculative"], given["prediction"]) == (False, PREDICTED)
    request = BatchRequest("r", "j", 0, [1, 2], json.loads(json.dumps(given)), "m")
    assert request.params() == spec.sampling_params


# -- the scheduler stages them, the worker passes them and the job on -------------------------------

KEYS = Keys("{spec}")
CAP = {"max_model_len": 512, "max_num_seqs": 8, "max_num_batched_tokens": 512, "kv_tokens": 4096}


def test_the_scheduler_stages_the_prediction_and_the_opt_out(redis_server, tiny_llama):
    r = redis_server.client()
    Registry(r, KEYS).register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    Registry(r, KEYS).heartbeat_worker("w-tiny", {"model": "tiny", "capacity": CAP}, ttl=60)
    JobStore(r, KEYS).create("js", model="tiny")
    bodies = [chat_line(prediction={"type": "content", "content": PREDICTED}),
              {"prompt": "x", "speculative": False, "max_tokens": 4},
              chat_line(),
              {"prompt": "x", "speculative": "off"}]
    for i, body in enumerate(bodies):
        r.xadd(KEYS.requests, IntakeEntry(body=json.dumps(body), job_id="js", idx=i, line=i + 1).to_fields())
    sched = SchedulerDaemon(r, Settings(prefix="{spec}"), direct_hold_s=600)
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0
    for _ in range(20):
        if sched.run_once() == 0:
            break
    staged = {q["idx"]: BatchRequest.from_dict(q) for _, f in r.xrange(KEYS.batches("tiny"))
              for q in json.loads(f[b"requests"])}
    assert sorted(staged) == [0, 1, 2]
    assert staged[0].params().prediction == PREDICTED and staged[0].params().speculative is True
    assert staged[1].params().speculative is False and staged[1].params().prediction is None
    assert "prediction" not in staged[2].sampling_params and "speculative" not in staged[2].sampling_params
    (row,) = [json.loads(f[b"row"]) for _, f in r.xrange(KEYS.results("js"))]
    assert (row["idx"], row["error_code"]) == (3, "invalid_request") and "speculative" in row["error_message"]


class GroupRecordingEcho(EchoEngine):
    """The echo engine, recording each request's spec_group and speculative switches."""

    def __init__(self, **kw):
        super().__init__(**kw)
        self.seen: dict[str, tuple] = {}

    def add_request(self, request_id, prompt=None, prompt_token_ids=None, sampling_params=None, *,
                    lora=None, spec_group=None):
        params = sampling_params
        self.seen[request_id] = (spec_group, params.speculative, params.prediction)
        super().add_request(request_id, prompt, prompt_token_ids, sampling_params, lora=lora,
                            spec_group=spec_group)


def test_the_worker_passes_the_job_as_the_spec_group(redis_server):
    r = redis_server.client()
    wkeys = Keys("{specw}")
    JobStore(r, wkeys).create("jw", model="echo")
    reqs = [BatchRequest(request_id=f"jw:{i}", job_id="jw", idx=i, prompt_token_ids=[10 + i, 20],
                         model="echo", sampling_params={"max_tokens": 2, **extra}, line=i + 1, created_at=1)
            for i, extra in enumerate([{}, {"speculative": False, "prediction": PREDICTED}])]
    r.xgroup_create(wkeys.batches("echo"), WORKERS_GROUP, id="0", mkstream=True)
    r.xadd(wkeys.batches("echo"), {"v": "1", "requests": json.dumps([q.to_dict() for q in reqs])})
    Publisher(r, wkeys).finish_submission("jw", len(reqs))
    engine = GroupRecordingEcho(max_num_seqs=4)
    worker = ThreadedWorker(worker_daemon(r, Settings(prefix="{specw}", heartbeat_seconds=0.3), engine, "w1"))
    wait_until(lambda: r.xlen(wkeys.results("jw")) == len(reqs), what="2 rows")
    assert worker.stop() == 0
    assert sorted(engine.seen.values()) == [("jw", False, PREDICTED), ("jw", True, None)]
    rows = [json.loads(f[b"row"]) for _, f in r.xrange(wkeys.results("jw"))]
    assert all(x["status"] == "completed" for x in rows), rows


# -- the engine's request ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine(engine_factory):
    return engine_factory()


def test_the_prediction_is_tokenised_once_without_special_tokens(engine):
    req = engine.make_request("p1", prompt_token_ids=[5, 6, 7],
                              sampling_params=SamplingParams(max_tokens=4, prediction=PREDICTED),
                              spec_group="job-1")
    expected = engine.tokenizer.encode(PREDICTED, add_special_tokens=False)
    assert req.prediction_token_ids == expected and expected
    assert engine.tokenizer.bos_token_id is not None and engine.tokenizer.bos_token_id not in expected
    assert req.spec_group == "job-1"
    plain = engine.make_request("p2", prompt_token_ids=[5, 6, 7], sampling_params={"prediction": ""})
    assert plain.prediction_token_ids is None and plain.spec_group is None


def test_add_request_takes_the_group_and_refuses_a_bad_one(engine):
    engine.add_request("g1", prompt_token_ids=[5, 6], sampling_params={"max_tokens": 2, "temperature": 0.0},
                       spec_group="job-2")
    assert engine.requests["g1"].spec_group == "job-2"
    while engine.has_unfinished():
        engine.step()
    with pytest.raises(ValueError, match="^spec_group must be a string"):
        engine.add_request("g2", prompt_token_ids=[5, 6], spec_group=7)  # type: ignore[arg-type]


def test_the_echo_engine_ignores_the_group():
    echo = EchoEngine()
    echo.add_request("e1", prompt_token_ids=[1, 2], sampling_params={"max_tokens": 1}, spec_group="j")
    assert echo.has_unfinished()


# -- the CLI flag -----------------------------------------------------------------------------------


def test_the_flag_becomes_the_engine_option():
    assert speculative_options(None) == {}
    options = speculative_options('{"method": "draft_model", "model": "/d", "num_speculative_tokens": 2}')
    assert options["speculative_config"]["method"] == "draft"
    assert EngineConfig(model="m", **options).speculative_config == SpeculativeConfig(
        method="draft", model="/d", num_speculative_tokens=2)


def test_the_speculative_model_flag_is_a_draft_config():
    options = speculative_options('{"num_speculative_tokens": 3}', "/draft")
    assert EngineConfig(model="m", **options).speculative_config == SpeculativeConfig(
        method="draft", model="/draft", num_speculative_tokens=3)
    assert speculative_options(None, "/d")["speculative_config"]["method"] == "draft"
    with pytest.raises(click.BadParameter, match="speculative_config.model"):
        speculative_options('{"method": "ngram"}', "/d")  # a draft model with another method


@pytest.mark.parametrize("value,says", [("not json", "invalid JSON"),
                                        ('{"method": "eagle"}', "speculative_config.method"),
                                        ('{"k": 1}', "speculative_config.k")])
def test_a_bad_flag_is_a_usage_error_naming_it(tiny_llama, tmp_path, value, says):
    result = CliRunner().invoke(cli, ["worker", "--model", str(tiny_llama), "--device", "cpu",
                                      "--speculative-config", value, "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 2 and "--speculative-config" in result.output and says in result.output, \
        result.output
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "x"}\n')
    result = CliRunner().invoke(cli, ["run", str(lines), "-o", str(tmp_path / "o.jsonl"), "--model", "tiny",
                                      "--speculative-config", value])
    assert result.exit_code == 2 and "--speculative-config" in result.output, result.output  # nothing started


def test_the_echo_engine_takes_no_flag(tmp_path):
    result = CliRunner().invoke(cli, ["worker", "--echo", "--speculative-config", "{}"])
    assert result.exit_code == 2 and "echo engine has none" in result.output, result.output
    lines = tmp_path / "in.jsonl"
    lines.write_text('{"prompt": "x"}\n')
    result = CliRunner().invoke(cli, ["run", str(lines), "-o", str(tmp_path / "o.jsonl"), "--echo",
                                      "--speculative-config", "{}"])
    assert result.exit_code == 2 and "--speculative-config" in result.output, result.output
