"""The worker's bookkeeping (pure): batches acked exactly when complete, bisection of failed steps."""

from __future__ import annotations

import math

from hypothesis import given
from hypothesis import strategies as st

from batchinfer.protocol.rows import BatchRequest
from batchinfer.workers.service.inflight import Book, Quarantine


def _req(i: int) -> BatchRequest:
    return BatchRequest(request_id=f"j:{i}", job_id="j", idx=i, prompt_token_ids=[1], sampling_params={},
                        model="m")


@given(st.lists(st.lists(st.integers(0, 15), min_size=1, max_size=6, unique=True), min_size=1, max_size=6),
       st.randoms(use_true_random=False))
def test_batches_are_acked_once_all_their_requests_are_done(batches, rnd):
    book = Book()
    acked: list[str] = []
    members = {}
    for b, idxs in enumerate(batches):
        members[f"e{b}"] = {f"j:{i}" for i in idxs}
        assert not book.add_batch(f"e{b}", [_req(i) for i in idxs], [False] * len(idxs))
    started = []
    while (held := book.next_waiting()) is not None:
        book.start(held, 0)
        started.append(held.request.request_id)
    assert sorted(started) == sorted(set().union(*members.values()))  # overlapping requests run once
    order = list(started)
    rnd.shuffle(order)
    done: set[str] = set()
    for rid in order:
        done.add(rid)
        for entry in book.done(rid):
            assert members[entry] <= done and entry not in acked
            acked.append(entry)
    assert sorted(acked) == sorted(members) and book.empty()


def test_published_requests_are_skipped_and_a_finished_batch_is_acked_at_once():
    book = Book()
    assert book.add_batch("e1", [_req(0), _req(1)], [True, True])
    assert not book.add_batch("e2", [_req(2), _req(3)], [True, False])
    held = book.next_waiting()
    assert held.request.request_id == "j:3" and book.next_waiting() is None


def test_engine_ids_change_on_a_rerun_and_stale_outputs_are_ignored():
    book = Book()
    book.add_batch("e", [_req(0)], [False])
    held = book.next_waiting()
    first = book.start(held, 0)
    book.unstart([held.request.request_id])
    second = book.start(held, 1)
    assert first == "j:0" and second == "j:0#1"
    assert book.resolve(first) is None and book.resolve(second) is held


def test_lost_batches_drop_their_waiting_requests_only():
    book = Book()
    book.add_batch("e1", [_req(0), _req(1)], [False, False])
    book.add_batch("e2", [_req(1), _req(2)], [False, False])
    running = book.next_waiting()
    book.start(running, 0)  # j:0 runs
    assert sorted(book.drop_batches(["e1"])) == []  # j:1 still belongs to e2, j:0 is running
    assert sorted(book.drop_batches(["e2"])) == ["j:1", "j:2"]
    assert set(book.held) == {"j:0"} and book.done("j:0") == []


@given(st.integers(1, 64), st.data())
def test_bisection_blames_exactly_the_culprit(n, data):
    culprit = f"r{data.draw(st.integers(0, n - 1)):02d}"
    q = Quarantine()
    alive = {f"r{i:02d}" for i in range(n)}
    completed, blamed, failures = set(), [], 0
    running = sorted(alive)
    while True:
        if culprit in running:  # the step fails
            failures += 1
            found = q.failed(running)
            if found is not None:
                blamed.append(found)
                alive.discard(found)
        else:
            completed.update(running)
            alive -= set(running)
            assert q.group_done(set())
        group = q.next_group(alive)
        if group is None:
            break
        running = group
    assert blamed == [culprit] and completed == {f"r{i:02d}" for i in range(n)} - {culprit}
    assert failures <= math.ceil(math.log2(n)) + 1 and not q.active


def test_solo_requests_wait_apart_and_hold_off_pulling_until_their_row_is_queued():
    book = Book()
    book.add_batch("b1", [_req(0), _req(1)], [False, False])
    book.add_batch("b2", [_req(2)], [False], solo=True)
    assert book.holds_solo and not book.solo_running
    assert [book.next_waiting().request.request_id for _ in range(2)] == ["j:0", "j:1"]
    assert book.next_waiting() is None  # the solo request never comes out with the others
    solo = book.next_solo()
    assert solo.request.request_id == "j:2" and book.next_solo() is None
    book.start(solo, now_ms=1)
    assert book.solo_running and book.holds_solo
    book.close("j:2")  # its row is queued: pulling may resume
    assert not book.solo_running and not book.holds_solo
    assert book.done("j:2") == ["b2"]


def test_a_held_request_re_sent_in_a_solo_batch_becomes_solo_and_a_lost_one_is_forgotten():
    book = Book()
    book.add_batch("b1", [_req(0), _req(1)], [False, False])
    book.add_batch("b2", [_req(1)], [False], solo=True)  # a re-dispatch of j:1 on its last attempt
    assert book.next_waiting().request.request_id == "j:0" and book.next_waiting() is None
    assert book.next_solo().request.request_id == "j:1"
    book.add_batch("b3", [_req(3)], [False], solo=True)
    assert book.drop_batches(["b3"]) == ["j:3"]  # its lease went elsewhere before it started
    assert book.next_solo() is None and book.solo == {"j:1"}
