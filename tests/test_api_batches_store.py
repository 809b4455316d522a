"""API batch records (batchinfer/store/apibatches.py) on a real Redis: round trips, owners, the
state compare-and-set, and list pagination that neither repeats nor skips a batch."""

from __future__ import annotations

import threading

import pytest

from batchinfer.keys import Keys
from batchinfer.protocol.entries import valid_job_id
from batchinfer.store.apibatches import ApiBatch, ApiBatches, BatchKind, BatchState

T0 = 1_700_000_000_000


@pytest.fixture
def batches(redis_server):
    return ApiBatches(redis_server.client(), Keys("{t}"), clock=lambda: T0 + 999)


def _batch(batches: ApiBatches, owner: str = "key_a", created_at: int = T0, kind=BatchKind.OPENAI,
           **kw) -> ApiBatch:
    b = ApiBatch(id=batches.new_id(kind), kind=kind, owner=owner, endpoint="/v1/chat/completions",
                 input_file_id="file-" + "0" * 24, output_file_id="file-" + "1" * 24, error_file_id=None,
                 completion_window="24h", metadata={"team": "nlp"}, created_at=created_at, **kw)
    batches.create(b)
    return b


def test_ids_are_the_vendors_shapes_and_valid_job_ids():
    openai_id, anthropic_id = ApiBatches.new_id(BatchKind.OPENAI), ApiBatches.new_id(BatchKind.ANTHROPIC)
    assert openai_id.startswith("batch_") and len(openai_id) == 6 + 32
    assert anthropic_id.startswith("msgbatch_") and len(anthropic_id) == 9 + 24
    assert valid_job_id(openai_id) and valid_job_id(anthropic_id)
    assert ApiBatches.new_id(BatchKind.OPENAI) != openai_id


def test_a_batch_reads_back_as_written_by_its_owner_only(batches):
    b = _batch(batches, errors=[{"code": "x", "message": "m", "line": 3, "param": None}], total=4)
    assert batches.get(b.id, "key_a") == b
    assert batches.get(b.id, "key_b") is None
    assert batches.get("batch_" + "f" * 32, "key_a") is None
    assert batches.get("x" * 10_000, "key_a") is None


def test_set_state_moves_only_from_the_expected_state(batches):
    b = _batch(batches)
    assert batches.set_state(b.id, BatchState.SUBMITTED, total=12)
    got = batches.get(b.id, "key_a")
    assert got is not None and got.state is BatchState.SUBMITTED and got.total == 12 and got.ended_at is None
    assert not batches.set_state(b.id, BatchState.CANCELLED)  # expects validating: it is submitted now
    assert batches.get(b.id, "key_a").state is BatchState.SUBMITTED
    assert not batches.set_state("batch_" + "e" * 32, BatchState.SUBMITTED)
    assert batches.get("batch_" + "e" * 32, "key_a") is None  # a missing batch is not created by it


def test_a_failed_validation_keeps_its_errors_and_end_time(batches):
    b = _batch(batches)
    errors = [{"code": "invalid_json", "message": "line 2 is not JSON", "line": 2, "param": None},
              {"code": "duplicate_custom_id", "message": "custom_id 'a' again", "line": 5,
               "param": "custom_id"}]
    assert batches.set_state(b.id, BatchState.FAILED, errors=errors)
    got = batches.get(b.id, "key_a")
    assert got.state is BatchState.FAILED and got.errors == errors and got.ended_at == T0 + 999


def test_a_cancel_racing_a_validation_has_one_winner(batches, redis_server):
    for _ in range(10):
        b = _batch(batches)
        barrier = threading.Barrier(2)
        won: dict[BatchState, bool] = {}

        def move(state: BatchState, b=b, barrier=barrier, won=won) -> None:
            mine = ApiBatches(redis_server.client(), Keys("{t}"))
            barrier.wait()
            won[state] = mine.set_state(b.id, state)

        rivals = (BatchState.SUBMITTED, BatchState.CANCELLED)
        threads = [threading.Thread(target=move, args=(s,)) for s in rivals]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(won.values()) == [False, True]
        winner = next(s for s, ok in won.items() if ok)
        assert batches.get(b.id, "key_a").state is winner


def _ids(page: list[ApiBatch]) -> list[str]:
    return [b.id for b in page]


@pytest.fixture
def many(batches) -> list[str]:
    """23 batches of key_a, several sharing a millisecond, newest first as the listing orders them."""
    made = [_batch(batches, created_at=T0 + i // 3) for i in range(23)]
    return [b.id for b in sorted(made, key=lambda b: (b.created_at, b.id), reverse=True)]


def test_list_pages_through_every_batch_newest_first_without_repeats(batches, many):
    seen, after = [], None
    while True:
        page, has_more = batches.list(BatchKind.OPENAI, "key_a", limit=4, after=after)
        seen += _ids(page)
        if not has_more:
            break
        after = page[-1].id
    assert seen == many
    assert _ids(batches.list(BatchKind.OPENAI, "key_a", limit=100)[0]) == many
    page, has_more = batches.list(BatchKind.OPENAI, "key_a", limit=23)
    assert _ids(page) == many and not has_more
    assert batches.list(BatchKind.OPENAI, "key_a", limit=22)[1]


def test_list_before_a_cursor_walks_back_to_the_newest(batches, many):
    oldest = many[-1]
    page, has_more = batches.list(BatchKind.OPENAI, "key_a", limit=5, before=oldest)
    assert _ids(page) == many[-6:-1] and has_more  # the five just newer, newest first
    seen, before = [], oldest
    while True:
        page, has_more = batches.list(BatchKind.OPENAI, "key_a", limit=4, before=before)
        seen = _ids(page) + seen
        if not has_more:
            break
        before = page[0].id
    assert seen == many[:-1]


def test_a_cursor_between_same_millisecond_batches_splits_them_exactly(batches, many):
    for i, cursor in enumerate(many):
        older = batches.list(BatchKind.OPENAI, "key_a", limit=3, after=cursor)[0]
        newer = batches.list(BatchKind.OPENAI, "key_a", limit=3, before=cursor)[0]
        assert _ids(older) == many[i + 1:i + 4] and _ids(newer) == many[max(0, i - 3):i]


def test_listings_are_per_owner_and_per_kind(batches):
    mine = _batch(batches, owner="key_a")
    theirs = _batch(batches, owner="key_b")
    anthropic = _batch(batches, owner="key_a", kind=BatchKind.ANTHROPIC)
    assert _ids(batches.list(BatchKind.OPENAI, "key_a")[0]) == [mine.id]
    assert _ids(batches.list(BatchKind.ANTHROPIC, "key_a")[0]) == [anthropic.id]
    assert _ids(batches.list(BatchKind.OPENAI, "key_b")[0]) == [theirs.id]
    assert batches.list(BatchKind.OPENAI, "key_a", after=theirs.id) == ([], False)  # another's cursor


def test_list_arguments_are_checked(batches, many):
    with pytest.raises(ValueError, match="not both"):
        batches.list(BatchKind.OPENAI, "key_a", after=many[0], before=many[1])
    with pytest.raises(ValueError, match="limit"):
        batches.list(BatchKind.OPENAI, "key_a", limit=0)


def test_delete_removes_the_record_and_its_listing(batches, many):
    batches.delete(many[3])
    assert batches.get(many[3], "key_a") is None
    assert _ids(batches.list(BatchKind.OPENAI, "key_a", limit=100)[0]) == many[:3] + many[4:]
    batches.delete(many[3])  # again: nothing there, nothing raised
