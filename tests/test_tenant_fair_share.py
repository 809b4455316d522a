"""Fair share by tenant: the jobs of one tenant (the job record's ``tenant``, an API key's batches)
share one fair-share group when batches are packed, so a tenant with two jobs gets no more than a
tenant with one. Pure packing tests, and the scheduler against a real redis-server."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from batchinfer.config import Settings
from batchinfer.keys import DIRECT, Keys
from batchinfer.protocol.batches import decode, encode, encode_request
from batchinfer.protocol.entries import IntakeEntry, JobOp
from batchinfer.protocol.rows import BatchRequest
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.scheduler.packing import Budget, Packer
from batchinfer.scheduler.staging import Staged, fair_share_group, member_for
from batchinfer.store.jobcontrol import open_job
from batchinfer.store.registry import Registry
from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

TENANT_OF = {"a1": "A", "a2": "A", "b1": "B"}


def _staged(job: str, idx: int, tenant: str | None) -> Staged:
    """Request ``idx`` of ``job`` as staging holds it (its BatchRequest JSON): cost 10 + 10 tokens."""
    request = BatchRequest(request_id=f"{job}:{idx}", job_id=job, idx=idx, prompt_token_ids=[1] * 10,
                           sampling_params={"max_tokens": 10}, model="m", created_at=idx, tenant=tenant)
    raw = encode_request(request)
    return Staged("m", member_for(0, job), f"{idx}-0", raw, json.loads(raw), 0, max_model_len=128)


def _shares(with_tenants: bool, calls: int = 3) -> Counter:
    """Requests packed per tenant over ``calls`` packing calls of 6 requests each."""
    pending = {s.candidate.key: s for job in TENANT_OF for s in
               (_staged(job, i, TENANT_OF[job] if with_tenants else None) for i in range(20))}
    packer, packed, budget = Packer(), Counter(), Budget(kv_tokens=200, max_num_seqs=6)
    for _ in range(calls):
        [batch] = packer.pack([s.candidate for s in pending.values()], budget, 1)
        for c in batch:
            packed[TENANT_OF[pending.pop(c.key).body["job_id"]]] += 1
    return packed


def test_two_jobs_of_one_tenant_share_one_fair_share_with_a_tenant_of_one_job():
    assert _shares(with_tenants=True) == {"A": 9, "B": 9}  # 50/50 between tenants
    assert _shares(with_tenants=False) == {"A": 12, "B": 6}  # without tenants: a share per job, 67/33


def test_the_fair_share_group_of_a_staged_request():
    assert fair_share_group({"job_id": "a1", "tenant": "A"}) == "tenant:A"  # no job id holds ':'
    assert fair_share_group({"job_id": "a2", "tenant": "A"}) == "tenant:A"
    assert fair_share_group({"job_id": "a1", "tenant": None}) == "a1"
    assert fair_share_group({"job_id": None}) == DIRECT
    assert _staged("a1", 0, "A").candidate.job == _staged("a2", 0, "A").candidate.job != "a1"


def test_a_batch_element_carries_its_tenant_only_when_it_has_one():
    plain = _staged("a1", 0, None).raw
    assert '"tenant"' not in plain  # the element's bytes as before tenants existed
    request = BatchRequest.from_dict(json.loads(_staged("a1", 0, "A").raw))
    assert request.tenant == "A"
    fields = {k.encode(): v.encode() for k, v in encode([request]).items()}
    assert decode(fields).requests == [request]


# -- the scheduler ------------------------------------------------------------------------------------------

KEYS = Keys("{ten}")
CAP = {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256, "kv_tokens": 4096}


@pytest.fixture
def served(redis_server, tiny_llama):
    r = redis_server.client()
    registry = Registry(r, KEYS)
    registry.register_model("tiny", read_tokenizer_files(tiny_llama), CAP)
    registry.heartbeat_worker("w1", {"model": "tiny", "capacity": CAP}, ttl=60)
    return r


def _first_batches(r, tenants: dict[str, str | None]) -> list[BatchRequest]:
    """Open the jobs (with their tenants), submit 12 requests each, run the scheduler until idle: the
    requests of the batches it dispatched (two batches of 4 for its one live worker)."""
    settings = Settings(prefix=KEYS.prefix)
    for job, tenant in tenants.items():
        assert open_job(r, KEYS, JobOp.open(job, model="tiny", tenant=tenant), settings)
    for i in range(12):  # interleaved: every job has requests as early as every other
        for job in tenants:
            r.xadd(KEYS.requests, IntakeEntry(body=json.dumps({"prompt": "p", "max_tokens": 4}), job_id=job,
                                              idx=i, line=i + 1).to_fields())
        # arrival order is the entries' millisecond, ties going to the smaller job id: a round per
        # millisecond keeps "as early as every other" true however fast the loop runs
        time.sleep(0.002)
    sched = SchedulerDaemon(r, settings, direct_hold_s=600.0)
    for _ in range(20):
        if sched.run_once() == 0:
            break
    return [BatchRequest.from_dict(q) for _, f in r.xrange(KEYS.batches("tiny"))
            for q in json.loads(f[b"requests"])]


def test_the_scheduler_packs_a_tenant_s_jobs_as_one_group(served):
    dispatched = _first_batches(served, TENANT_OF)
    assert len(dispatched) == 8
    assert {q.job_id: q.tenant for q in dispatched} == TENANT_OF  # each request carries its job's tenant
    assert Counter(q.tenant for q in dispatched) == {"A": 4, "B": 4}


def test_jobs_without_a_tenant_keep_a_share_each(served):
    dispatched = _first_batches(served, dict.fromkeys(TENANT_OF))
    assert all(q.tenant is None for q in dispatched)
    by_tenant = Counter(TENANT_OF[q.job_id] for q in dispatched)
    assert by_tenant["A"] > by_tenant["B"]  # a1 and a2 each get a share of their own
