"""SamplingParams: validation messages name the field, normalisation, dict round trips."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from batchinfer.workers.sampling_params import SamplingParams


def test_defaults_match_vllm():
    p = SamplingParams()
    assert (p.n, p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p) == (1, 16, 1.0, 1.0, 0, 0.0)
    assert p.stop == [] and p.stop_token_ids == [] and p.logprobs is None
    assert not p.greedy


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"top_p": 1.5}, "top_p must be in (0, 1], got 1.5"),
        ({"top_p": 0.0}, "top_p must be in (0, 1], got 0.0"),
        ({"max_tokens": 0}, "max_tokens must be >= 1, got 0"),
        ({"n": 0}, "n must be >= 1"),
        ({"n": True}, "n must be an integer, got True"),
        ({"max_tokens": 2.0}, "max_tokens must be an integer"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens must be <= max_tokens (4), got 5"),
        ({"temperature": -0.1}, "temperature must be >= 0"),
        ({"temperature": float("nan")}, "temperature must be a finite number"),
        ({"temperature": float("inf")}, "temperature must be a finite number"),  # JSON's 1e400
        ({"repetition_penalty": 10**400}, "repetition_penalty must be a finite number"),
        ({"temperature": "hot"}, "temperature must be a number, got 'hot'"),
        ({"temperature": False}, "temperature must be a number"),
        ({"top_k": -2}, "top_k must be >= -1, got -2"),
        ({"min_p": 1.01}, "min_p must be in [0, 1]"),
        ({"presence_penalty": 2.5}, "presence_penalty must be in [-2, 2]"),
        ({"frequency_penalty": -3}, "frequency_penalty must be in [-2, 2]"),
        ({"repetition_penalty": 0}, "repetition_penalty must be > 0"),
        ({"seed": "7"}, "seed must be an integer"),
        ({"seed": 2**64}, "seed must be in"),
        ({"stop": 3}, "stop must be a string or a list of strings"),
        ({"stop": ["a", 3]}, "stop[1] must be a string, got 3"),
        ({"stop": ["a", ""]}, "stop[1] must not be empty"),
        ({"stop_token_ids": 3}, "stop_token_ids must be a list of integers"),
        ({"stop_token_ids": [1, "2"]}, "stop_token_ids[1] must be a non-negative integer, got '2'"),
        ({"stop_token_ids": [True]}, "stop_token_ids[0] must be a non-negative integer"),
        ({"stop_token_ids": [-1]}, "stop_token_ids[0] must be a non-negative integer"),
        ({"ignore_eos": 1}, "ignore_eos must be a boolean, got 1"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output must be a boolean"),
        ({"skip_special_tokens": None}, "skip_special_tokens must be a boolean"),
        ({"logprobs": 21}, "logprobs must be in [0, 20], got 21"),
        ({"logprobs": -1}, "logprobs must be in [0, 20]"),
        ({"logit_bias": {"x": 1}}, "logit_bias keys must be token ids"),
        ({"logit_bias": {"7": 101}}, "logit_bias[7] must be in [-100, 100], got 101.0"),
        ({"allowed_token_ids": []}, "allowed_token_ids must not be empty"),
        ({"allowed_token_ids": [-1]}, "allowed_token_ids[0] must be a non-negative integer"),
        ({"bad_words": ["a", None]}, "bad_words[1] must be a string, got None"),
    ],
)
def test_invalid_values_name_the_field(kwargs, message):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(message), str(err.value)


def test_normalisation():
    p = SamplingParams(stop="###", stop_token_ids=(5, 6), top_k=-1, temperature=1, top_p=1)
    assert p.stop == ["###"] and p.stop_token_ids == [5, 6]
    assert p.top_k == 0
    assert isinstance(p.temperature, float) and isinstance(p.top_p, float)


def test_greedy_threshold():
    assert SamplingParams(temperature=0).greedy
    assert SamplingParams(temperature=1e-6).greedy
    assert not SamplingParams(temperature=0.01).greedy


def test_from_dict_rejects_unknown_fields_and_lists_allowed():
    with pytest.raises(ValueError) as err:
        SamplingParams.from_dict({"temperature": 0.5, "best_of": 2, "beam": 1})
    msg = str(err.value)
    assert msg.startswith("beam is not a sampling parameter")
    assert "best_of" in msg and "allowed:" in msg and "top_p" in msg


def test_from_dict_null_means_default_except_nullable():
    p = SamplingParams.from_dict({"temperature": None, "max_tokens": None, "seed": None, "top_k": None})
    assert p.temperature == 1.0 and p.top_k == 0
    assert p.max_tokens is None  # explicit null: until max_model_len
    with pytest.raises(ValueError, match="^sampling parameters must be an object"):
        SamplingParams.from_dict([("n", 1)])


def test_fields_lists_every_dataclass_field():
    assert set(SamplingParams.FIELDS) == set(SamplingParams().to_dict())
    assert "FIELDS" not in SamplingParams.FIELDS


params_strategy = st.builds(
    SamplingParams,
    n=st.integers(1, 8),
    max_tokens=st.one_of(st.none(), st.integers(20, 4096)),
    min_tokens=st.integers(0, 20),
    temperature=st.floats(0, 5),
    top_p=st.floats(0, 1, exclude_min=True),
    top_k=st.integers(-1, 100),
    min_p=st.floats(0, 1),
    presence_penalty=st.floats(-2, 2),
    frequency_penalty=st.floats(-2, 2),
    repetition_penalty=st.floats(0, 3, exclude_min=True),
    seed=st.one_of(st.none(), st.integers(-(2**63), 2**64 - 1)),
    stop=st.one_of(st.none(), st.text(min_size=1), st.lists(st.text(min_size=1), max_size=4)),
    stop_token_ids=st.one_of(st.none(), st.lists(st.integers(0, 2**31), max_size=4)),
    include_stop_str_in_output=st.booleans(),
    ignore_eos=st.booleans(),
    logprobs=st.one_of(st.none(), st.integers(0, 20)),
    skip_special_tokens=st.booleans(),
    logit_bias=st.one_of(st.none(), st.dictionaries(st.integers(0, 2**31), st.floats(-100, 100), max_size=4)),
    allowed_token_ids=st.one_of(st.none(), st.lists(st.integers(0, 2**31), min_size=1, max_size=4)),
    bad_words=st.one_of(st.none(), st.lists(st.text(min_size=1), max_size=4)),
)


@given(params_strategy)
def test_to_dict_round_trips_through_json(p):
    d = json.loads(json.dumps(p.to_dict()))
    assert SamplingParams.from_dict(d) == p


def test_copy_is_equal_and_shares_no_container():
    p = SamplingParams(stop=["a"], stop_token_ids=[7], logit_bias={"3": 1.5}, allowed_token_ids=[1, 2, 3],
                       bad_words=["x"], structured_outputs={"choice": ["yes", "no"]}, max_tokens=5)
    q = p.copy()
    assert q == p and q is not p and type(q) is SamplingParams
    for name in ("stop", "stop_token_ids", "logit_bias", "allowed_token_ids", "bad_words"):
        assert getattr(q, name) is not getattr(p, name), name
    q.stop.append("b")
    q.logit_bias[9] = 2.0
    q.output_kind = "final_only"
    assert p.stop == ["a"] and 9 not in p.logit_bias and p.output_kind == "cumulative"
    assert q.structured_outputs is p.structured_outputs  # frozen: shared


def test_prepared_params_share_one_validation_per_distinct_raw_parameters():
    """The worker's prefetch thread builds each batch's distinct raw parameters once: requests with
    the same raw parameters get equal, independent objects; different ones (1 and 1.0, key order
    aside) get their own; a bad one is None for every request that carries it."""
    from batchinfer.protocol.rows import BatchRequest
    from batchinfer.workers.service.reader import prepared_params

    def req(i: int, sp: dict) -> BatchRequest:
        return BatchRequest(request_id=f"j:{i}", job_id="j", idx=i, prompt_token_ids=[1], sampling_params=sp,
                            model="m")

    built: dict = {}
    raw = {"max_tokens": 4, "stop": ["z"], "temperature": 0.5}
    same = [prepared_params(req(i, dict(raw)), built) for i in range(3)]
    assert len(built) == 1
    assert all(p == same[0] for p in same) and len({id(p) for p in same}) == 3
    assert all(p.output_kind == "final_only" for p in same)
    same[0].stop.append("y")
    assert same[1].stop == ["z"]
    other = prepared_params(req(3, {"max_tokens": 4, "stop": ["z"], "temperature": 1}), built)
    assert other.temperature == 1.0 and len(built) == 2
    bad = [prepared_params(req(i, {"max_tokens": -1}), built) for i in (4, 5)]
    assert bad == [None, None] and len(built) == 3
    # what orjson cannot key (an int past 64 bits) is built alone, and still checked
    assert prepared_params(req(6, {"seed": 2**70}), built) is None and len(built) == 3
