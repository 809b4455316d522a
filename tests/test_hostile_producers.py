"""Issue 27: what a hostile producer sends straight to ``{p}:requests`` never stops intake, never
writes outside its job's or the reply namespace, and every size it sends has a bound.

A real redis-server and the real scheduler passes; a hypothesis fuzz of raw entries checks the
three invariants on any mix of fields, values and op orders."""

from __future__ import annotations

import json

import pytest
from daemons import serve_tiny
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from batchinfer.config import Settings
from batchinfer.jobs.export import export_job
from batchinfer.keys import SCHEDULER_GROUP, Keys
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.intake import MAX_INTAKE_DELIVERIES
from batchinfer.scheduler.packing import Budget, Candidate, Packer
from batchinfer.store.jobstore import JobStore
from batchinfer.store.publish import Publisher
from batchinfer.workers.text.tokenizer import PromptTooLong, Tokenizer
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

KEYS = Keys("{h}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}
MAX_REQUESTS = 1000  # the deployment's BATCHINFER_MAX_REQUESTS_PER_JOB in these tests
GOOD = json.dumps({"prompt": "hi", "model": "tiny", "max_tokens": 2})


@pytest.fixture(scope="module")
def files(tiny_llama):
    return read_tokenizer_files(tiny_llama)


@pytest.fixture
def r(redis_module, files):
    r = redis_module.client()
    r.flushdb()
    serve_tiny(r, KEYS, files, CAP)
    return r


def scheduler(r, **overrides) -> SchedulerDaemon:
    sched = SchedulerDaemon(r, Settings(prefix="{h}", max_requests_per_job=MAX_REQUESTS, **overrides),
                            direct_hold_s=600)
    sched.dispatcher.jobs.ttl = sched.admission.jobs.ttl = 0
    return sched


def serve(sched: SchedulerDaemon, passes: int = 30) -> int:
    """Passes as the daemon's loop runs them (a failed pass resets, as ``run`` does); the failures."""
    failures = 0
    for _ in range(passes):
        try:
            if sched.run_once() == 0:
                break
        except Exception:  # noqa: BLE001 - what SchedulerDaemon.run does with a failed pass
            failures += 1
            sched._reset()
    return failures


def rows(r, stream: str) -> list[ResultRow]:
    return [ResultRow.from_json(f[b"row"]) for _, f in r.xrange(stream)]


def staged_requests(r) -> list[dict]:
    out = []
    for _, f in r.xrange(KEYS.batches("tiny")):
        out += json.loads(f[b"requests"])
    for member in r.zrange(KEYS.queues("tiny"), 0, -1):
        out += [json.loads(g[b"req"]) for _, g in r.xrange(KEYS.queue("tiny", member.decode()))]
    return out


def intake_is_empty(r) -> bool:
    return r.xlen(KEYS.requests) == 0 and r.xpending(KEYS.requests, SCHEDULER_GROUP)["pending"] == 0


# -- 1. a poison entry never stops intake -------------------------------------------------------


@pytest.mark.parametrize("idx", ["-1", "4294967296", "99999999999999999999999999", "1e3"])
def test_an_entry_with_an_idx_redis_rejects_does_not_stop_intake(r, idx):
    JobStore(r, KEYS).create("j", model="tiny")
    r.xadd(KEYS.requests, {"v": "1", "job": "x", "idx": idx, "body": "{}"})
    for i in range(3):
        r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": str(i), "body": GOOD})
    assert serve(scheduler(r)) == 0
    assert intake_is_empty(r)
    assert sorted(q["idx"] for q in staged_requests(r)) == [0, 1, 2]
    (poison,) = rows(r, KEYS.results("direct"))
    assert poison.error_code == "protocol_error" and "idx" in poison.error_message
    assert not r.exists(KEYS.admitted("x"))


def test_an_entry_read_again_at_every_restart_is_answered_not_retried_forever(r):
    JobStore(r, KEYS).create("j", model="tiny")
    poison = r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": "0", "body": GOOD}).decode()
    for i in range(3):
        r.xadd(KEYS.requests, {"v": "1", "body": GOOD, "reply_to": KEYS.reply(str(i))})
    sched = scheduler(r)
    sched.intake.ensure_group()
    # A scheduler that dies on its first entry, restart after restart (say, killed for memory): it
    # read the entry once, then re-read it as its own pending entry at every start.
    r.xreadgroup(SCHEDULER_GROUP, sched.name, {KEYS.requests: ">"}, count=1)
    for _ in range(MAX_INTAKE_DELIVERIES - 1):
        r.xreadgroup(SCHEDULER_GROUP, sched.name, {KEYS.requests: "0"}, count=1)
    assert serve(sched) == 0  # its read now is one more than the bound
    assert intake_is_empty(r) and len(staged_requests(r)) == 3
    (row,) = rows(r, KEYS.results("direct"))
    assert (row.error_code, row.request_id) == ("internal_error", poison)
    assert f"read {MAX_INTAKE_DELIVERIES + 1} times and never settled" in row.error_message
    assert any(poison in e for e in JobStore(r, KEYS).get("j").errors)


def test_an_entry_read_fewer_times_is_still_run(r):
    r.xadd(KEYS.requests, {"v": "1", "body": GOOD, "reply_to": KEYS.reply("x")})
    sched = scheduler(r)
    sched.intake.ensure_group()
    r.xreadgroup(SCHEDULER_GROUP, sched.name, {KEYS.requests: ">"}, count=1)
    for _ in range(MAX_INTAKE_DELIVERIES - 2):
        r.xreadgroup(SCHEDULER_GROUP, sched.name, {KEYS.requests: "0"}, count=1)
    assert serve(sched) == 0  # its read now is the last one the bound allows
    assert intake_is_empty(r) and len(staged_requests(r)) == 1 and r.xlen(KEYS.results("direct")) == 0


# -- 3. reply_to stays in the reply namespace ----------------------------------------------------


@pytest.mark.parametrize("target", ["{h}:requests", "{h}:deadletter", "{h}:results:victim",
                                    "{h}:batches:tiny", "{h}:reply", "elsewhere"])
def test_a_reply_to_outside_the_reply_namespace_is_refused_and_written_nowhere(r, target):
    store = JobStore(r, KEYS)
    store.create("victim", model="tiny")
    r.xadd(KEYS.results("victim"), {"row": "x"})
    r.xadd(KEYS.deadletter, {"x": "1"})
    scheduler(r).intake.ensure_group()
    before = {k: (r.type(k), r.ttl(k)) for k in r.keys("*")}
    r.xadd(KEYS.requests, {"v": "1", "body": GOOD, "reply_to": target})  # direct
    r.xadd(KEYS.requests, {"v": "1", "body": "{bad json", "reply_to": target})  # malformed body too
    r.xadd(KEYS.requests, {"v": "1", "op": "cancel", "job": "victim", "reply_to": target})
    serve(scheduler(r))
    assert intake_is_empty(r)
    for key, (kind, ttl) in before.items():
        assert (r.type(key), r.ttl(key)) == (kind, ttl), key
    assert r.xlen(KEYS.results("victim")) == 1 and store.get("victim").status != "cancelling"
    assert not r.exists(target) or target.encode() in before
    found = rows(r, KEYS.results("direct"))  # reply_to is checked first, before the body is read
    assert [row.error_code for row in found] == ["protocol_error"] * 3
    assert all("is not a reply stream" in row.error_message for row in found)
    assert staged_requests(r) == []


def test_a_job_entry_with_a_foreign_reply_to_gets_its_row_in_its_job(r):
    JobStore(r, KEYS).create("j", model="tiny")
    r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": "0", "body": GOOD, "reply_to": "{h}:results:other"})
    serve(scheduler(r))
    (row,) = rows(r, KEYS.results("j"))
    assert (row.idx, row.error_code) == (0, "protocol_error") and "reply_to" in row.error_message
    assert not r.exists("{h}:results:other")


# -- 4. limits: n, idx, prompt size --------------------------------------------------------------


def test_n_is_bounded_by_the_setting(r):
    r.xadd(KEYS.requests, {"v": "1", "body": json.dumps({"prompt": "hi", "model": "tiny", "n": 100000,
                                                         "max_tokens": 2}), "reply_to": KEYS.reply("n")})
    r.xadd(KEYS.requests, {"v": "1", "body": json.dumps({"prompt": "hi", "model": "tiny", "n": 3,
                                                         "max_tokens": 2}), "reply_to": KEYS.reply("ok")})
    serve(scheduler(r, max_n=4))
    (row,) = rows(r, KEYS.reply("n"))
    assert row.error_code == "invalid_request" and "n must be <= 4" in row.error_message
    assert [q["sampling_params"]["n"] for q in staged_requests(r)] == [3]


def test_a_requests_sequences_count_against_the_batch_and_its_jobs_fair_share():
    budget = Budget(kv_tokens=10_000, max_num_seqs=4)
    wide = Candidate(key="a", job="A", priority=0, prompt_tokens=10, max_tokens=5, arrival=0, seqs=4)
    narrow = [Candidate(key=f"b{i}", job="B", priority=0, prompt_tokens=10, max_tokens=5, arrival=i + 1)
              for i in range(4)]
    assert wide.cost == 10 + 4 * 5
    batches = Packer().pack([wide, *narrow], budget, max_batches=2)
    # n=4 fills a batch of max_num_seqs 4 alone; before, it rode with three others in one batch
    assert sorted(len(b) for b in batches) == [1, 4]


def test_an_idx_past_the_job_limit_is_refused_without_a_bitmap(r):
    JobStore(r, KEYS).create("j", model="tiny")
    r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": str(MAX_REQUESTS), "body": GOOD})
    r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": "4294967295", "body": GOOD})
    serve(scheduler(r))
    found = rows(r, KEYS.results("direct"))
    assert [row.error_code for row in found] == ["protocol_error"] * 2
    assert all("BATCHINFER_MAX_REQUESTS_PER_JOB" in row.error_message for row in found)
    assert not r.exists(KEYS.admitted("j")) and rows(r, KEYS.results("j")) == []


def test_a_malformed_entry_with_a_far_idx_is_answered_directly(r):
    JobStore(r, KEYS).create("j", model="tiny")
    r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": str(2**40), "body": GOOD, "bogus": "1"})
    r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": "0", "body": GOOD})
    assert serve(scheduler(r)) == 0
    (row,) = rows(r, KEYS.results("direct"))
    assert row.error_code == "protocol_error" and "bogus" in row.error_message
    assert intake_is_empty(r) and len(staged_requests(r)) == 1
    assert r.strlen(KEYS.admitted("j")) == 1  # only idx 0's bit


def test_an_exported_jobs_admissions_expire_with_its_results(r, redis_module, tmp_path, monkeypatch):
    monkeypatch.setenv("BATCHINFER_RESULTS_ROOT", str(tmp_path))
    JobStore(r, KEYS).create("j", model="tiny")
    r.xadd(KEYS.requests, {"v": "1", "job": "j", "idx": "0", "body": "{bad"})  # answered at intake
    serve(scheduler(r))
    Publisher(r, KEYS).finish_submission("j", 1)
    assert r.ttl(KEYS.admitted("j")) == -1  # kept while the job runs
    export_job("j", prefix="{h}", redis_url=redis_module.url)
    ttl = Settings.from_env().results_ttl_seconds
    assert ttl - 60 < r.ttl(KEYS.admitted("j")) <= ttl  # it once stayed in Redis for good


def test_a_huge_prompt_is_refused_before_it_is_tokenised_whole(tiny_llama):
    tok = Tokenizer.from_dir(tiny_llama)
    assert tok.max_token_chars is not None and tok.max_token_chars >= 1
    limit = 100
    by_length = "x" * (limit * tok.max_token_chars + 1)
    with pytest.raises(PromptTooLong, match="characters\\)"):
        tok.encode_within(by_length, limit)
    by_prefix = "a b " * 400  # within the length bound, but its head alone is over the limit
    assert len(by_prefix) <= limit * tok.max_token_chars
    with pytest.raises(PromptTooLong, match="its first 808 characters"):
        tok.encode_within(by_prefix, limit)
    ok = "hello world " * 5
    assert tok.encode_within(ok, limit) == tok.encode(ok)


def test_a_huge_prompt_gets_prompt_too_long(r):
    body = json.dumps({"prompt": "word " * 400_000, "model": "tiny", "max_tokens": 2})
    r.xadd(KEYS.requests, {"v": "1", "body": body, "reply_to": KEYS.reply("big")})
    serve(scheduler(r))
    (row,) = rows(r, KEYS.reply("big"))
    assert row.error_code == "prompt_too_long" and "not tokenised whole" in row.error_message


# -- 6. numbers out of range ---------------------------------------------------------------------


@pytest.mark.parametrize(("fields", "code", "words"), [
    ({"hold_seconds": "1e308"}, "protocol_error", "hold_seconds"),
    ({"body": json.dumps({"prompt": "hi", "model": "tiny"}).replace("}", ', "temperature": 1e400}')},
     "invalid_request", "temperature must be a finite number"),
    ({"line": "9" * 30}, "protocol_error", "line must be"),
    ({"client_request_id": "c" * 10_000}, "protocol_error", "client_request_id is 10000 characters"),
])
def test_numbers_and_sizes_out_of_range_are_error_rows(r, fields, code, words):
    r.xadd(KEYS.requests, {"v": "1", "body": GOOD, "reply_to": KEYS.reply("n"), **fields})
    assert serve(scheduler(r)) == 0
    (row,) = rows(r, KEYS.reply("n"))
    assert row.error_code == code and words in row.error_message


def test_op_values_out_of_range_are_refused(r):
    r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": "w", "completion_window": "99999999d",
                           "reply_to": KEYS.reply("op")})
    r.xadd(KEYS.requests, {"v": "1", "op": "open", "job": "p", "priority": str(10**40),
                           "reply_to": KEYS.reply("op")})
    serve(scheduler(r))
    found = rows(r, KEYS.reply("op"))
    assert [row.error_code for row in found] == ["invalid_request"] * 2
    assert "366 days" in found[0].error_message and "priority" in found[1].error_message
    assert not r.exists(KEYS.job("w")) and not r.exists(KEYS.job("p"))


# -- the fuzz: any entries, in any order -----------------------------------------------------------

BODIES = [GOOD, "{}", "{bad", json.dumps({"prompt": "hi", "model": "tiny", "n": 100000, "max_tokens": 2}),
          json.dumps({"prompt": "x" * 3000, "model": "tiny"}), json.dumps({"prompt": "hi", "model": "ghost"}),
          '{"prompt": "hi", "model": "tiny", "temperature": 1e400}',
          json.dumps({"messages": [], "model": "tiny"})]
NUMBERS = st.one_of(st.sampled_from(["0", "1", "2", "-1", "4294967296", "1e308", "nan", "inf", "",
                                     str(MAX_REQUESTS), str(2**60), "9" * 50]),
                    st.integers(-(2**70), 2**70).map(str))
KEYS_NAMED = st.sampled_from(["{h}:reply:a", "{h}:reply:", "{h}:requests", "{h}:results:victim",
                              "{h}:deadletter", "{h}:job:victim", "{h}:batches:tiny", "{h}:results:direct",
                              "plain", ""])
# Each field with the values that reach its edge cases, any of them present or not, in any order.
entry = st.fixed_dictionaries({"v": st.sampled_from(["1"] * 6 + ["2", ""])}, optional={
    "body": st.one_of(st.sampled_from(BODIES), st.text(max_size=8)),
    "job": st.sampled_from(["j", "victim2", "nojob", "bad id", ""]),
    "idx": NUMBERS, "line": NUMBERS, "hold_seconds": NUMBERS, "total": NUMBERS, "priority": NUMBERS,
    "reply_to": KEYS_NAMED,
    "client_request_id": st.one_of(st.sampled_from(["c1", "c2"]), st.text(max_size=8)),
    "op": st.sampled_from(["open", "close", "cancel", "launch"]),
    "model": st.sampled_from(["tiny", "ghost", ""]),
    "completion_window": st.one_of(st.sampled_from(["1h", "99999999d", "0", "x"]), NUMBERS),
    "metadata": st.sampled_from(['{"a": "b"}', "[]", "x"]),
    "bogus": st.just("1"),
})
PROTECTED = ["{h}:requests", "{h}:deadletter", "{h}:results:victim", "{h}:job:victim", "{h}:batches:tiny",
             "{h}:results:direct", "{h}:jobs", "{h}:models"]


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(entries=st.lists(entry, min_size=1, max_size=6))
def test_fuzz_intake_always_advances_answers_once_and_stays_in_its_namespace(redis_module, files, entries):
    r = redis_module.client()
    r.flushdb()
    serve_tiny(r, KEYS, files, CAP)
    JobStore(r, KEYS).create("j", model="tiny")
    JobStore(r, KEYS).create("victim", model="tiny")
    r.xadd(KEYS.results("victim"), {"row": "x"})
    r.xadd(KEYS.deadletter, {"x": "1"})
    r.xadd(KEYS.results("direct"), {"row": "x"})
    sched = scheduler(r)
    sched.intake.ensure_group()
    victim = r.hgetall(KEYS.job("victim"))
    for fields in entries:
        r.xadd(KEYS.requests, fields)
    sentinel = r.xadd(KEYS.requests, {"v": "1", "body": GOOD, "reply_to": KEYS.reply("sentinel")})
    before = {k: (r.type(k), r.ttl(k)) for k in PROTECTED if r.exists(k)}

    assert serve(sched) == 0  # no pass failed
    assert intake_is_empty(r)  # every entry settled: staged, held, answered or dropped
    assert sentinel.decode() in {q["request_id"] for q in staged_requests(r)}
    for key, (kind, ttl) in before.items():  # no system key changed type or got an expiry
        assert r.type(key) == kind and (r.ttl(key) == ttl or kind == b"none"), key
    assert r.xlen(KEYS.results("victim")) == 1 and r.hgetall(KEYS.job("victim")) == victim
    for key in r.keys("{h}:*"):  # each request at most one row per stream
        if r.type(key) == b"stream" and key.decode().split(":")[1] in ("results", "reply"):
            ids = [f[b"row"] for _, f in r.xrange(key) if f.get(b"row") != b"x"]
            ids = [json.loads(row)["request_id"] for row in ids]
            assert len(ids) == len(set(ids)), key
    for key in r.keys("{h}:admitted:*") + r.keys("{h}:published:*"):  # bitmaps bounded by the job limit
        if r.type(key) == b"string":
            assert r.strlen(key) <= MAX_REQUESTS // 8 + 1, key
