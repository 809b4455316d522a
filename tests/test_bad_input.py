"""Bad input through the real path (issue 5, "Bad input to reject cleanly").

One queue for the module: a redis-server, the scheduler driven by ``run_once()``, two echo workers
(the model does not matter here; ``hostile`` serves a model folder whose chat template tries to
leave the jinja2 sandbox) and rq's worker running the real export. Each corpus file of
``tests/data/bad_input/`` is submitted through :class:`~batchinfer.client.client.Client` or the CLI as one
job mixing good and bad lines; every bad line must get exactly its error code and a message naming
the field, at its line; every good line must complete; the job must complete; no daemon may die.
"""

from __future__ import annotations

import gzip
import json
import os
import pickle
import select
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from click.testing import CliRunner
from daemons import worker_daemon
from hypothesis import given, settings
from hypothesis import strategies as st

from batchinfer.cli.context import EXIT_INPUT
from batchinfer.cli.main import cli
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import RQ_QUEUE, WORKERS_GROUP
from batchinfer.protocol.bodies import parse_body
from batchinfer.protocol.entries import RequestError
from batchinfer.protocol.rows import ResultRow
from batchinfer.scheduler.daemon import SchedulerDaemon
from batchinfer.store.jobstore import JobStatus, JobStore
from batchinfer.store.publish import Publisher
from batchinfer.store.registry import Registry
from batchinfer.workers.service.echo_engine import EchoEngine, byte_tokenizer_files

DATA = Path(__file__).parent / "data" / "bad_input"
PREFIX = "{badin}"
ECHO, HOSTILE = "echo", "hostile"
CONTEXT = 64  # max_model_len of both echo workers
MAX_PROMPT_TOKENS = 100  # Settings.max_prompt_tokens for this queue (above the context, to test both)
VOCAB = 258  # the byte tokenizer: 256 bytes, <s>, </s>


@dataclass(frozen=True)
class Bad:
    """What one bad line must become: its error code and words its message must contain."""

    code: str
    says: tuple[str, ...]


def bad(code: str, *says: str) -> Bad:
    return Bad(code, says)


IJ, IR, TL, PE = "invalid_json", "invalid_request", "prompt_too_long", "protocol_error"
# file -> {line: expected}; every other non-blank line of the file is a good request.
CASES: dict[str, dict[int, Bad]] = {
    "invalid_json.jsonl": {
        2: bad(IJ, "invalid JSON", "(column "), 3: bad(IJ, "invalid JSON", "double quotes"),
        4: bad(IJ, "NaN is not a valid JSON number"), 5: bad(IJ, "Extra data")},
    "not_an_object.jsonl": {
        2: bad(IR, "must be a JSON object", "a list"), 3: bad(IR, "JSON object", "a string"),
        4: bad(IR, "JSON object", "an integer"), 5: bad(IR, "JSON object", "null")},
    "missing_prompt.jsonl": {
        2: bad(IR, "prompt", "exactly one of", "got none"), 3: bad(IR, "prompt", "got none"),
        4: bad(IR, "prompt must not be empty"), 5: bad(IR, "messages must be a non-empty")},
    "prompt_and_messages.jsonl": {
        2: bad(IR, "got prompt, messages"), 3: bad(IR, "got prompt, prompt_token_ids"),
        4: bad(IR, "body.prompt", "takes 'messages', not a prompt")},
    "wrong_types.jsonl": {
        2: bad(IR, "prompt must be a string"), 3: bad(IR, "max_tokens must be an integer"),
        4: bad(IR, "temperature must be a number"), 5: bad(IR, "messages must be a non-empty"),
        6: bad(IR, "messages[0].role must be one of"), 7: bad(IR, "stop[0] must be a string"),
        8: bad(IR, "metadata.team must be a string"), 9: bad(IR, "custom_id must be a string"),
        10: bad(IR, "seed must be an integer"), 11: bad(IR, "n must be an integer"),
        12: bad(IR, "priority must be an integer")},
    "max_tokens.jsonl": {
        2: bad(IR, "max_tokens must be >= 1", "-1"), 3: bad(IR, "max_tokens must be >= 1"),
        4: bad(IR, "max_tokens must be <= 1000000", "1000000000"),
        5: bad(IR, "max_tokens must be <= 1000000", "1180591620717411303424"),
        6: bad(IR, "max_tokens must be an integer"),
        7: bad(TL, "max_tokens", f"65 > the model's context of {CONTEXT}")},
    "temperature.jsonl": {
        2: bad(IR, "temperature must be >= 0", "-0.5"), 3: bad(IR, "temperature must be >= 0")},
    "top_p.jsonl": {n: bad(IR, "top_p must be in (0, 1]") for n in (2, 3, 4, 5)},
    "unknown_fields.jsonl": {
        2: bad(IR, "unknown field(s): temprature"), 3: bad(IR, "unknown field(s): best_of"),
        4: bad(IR, "unknown field(s): sampling_params"), 5: bad(IR, "messages[0] has unknown field(s): foo"),
        6: bad(IR, "unknown field(s) in OpenAI Batch line: priority_class")},
    "openai_url_stream.jsonl": {
        # an embeddings line is understood, and routed: the job's model generates, so an error row
        2: bad(IR, "model 'echo' is a generation model", "/v1/embeddings needs an embedding model"),
        3: bad("unsupported_url", "url '/v1/moderations' is not supported"),
        4: bad(IR, 'method must be "POST"', "GET"),
        5: bad(IR, "stream: true is not supported"), 6: bad(IR, "stream: true is not supported")},
    "non_utf8.jsonl": {
        2: bad(IJ, "line is not UTF-8", "0xe9"), 3: bad(IJ, "line is not UTF-8", "0xff"),
        4: bad(IJ, "prompt holds a lone UTF-16 surrogate"),
        5: bad(IJ, "custom_id holds a lone UTF-16 surrogate")},
    "prompt_too_long.jsonl": {
        2: bad(TL, "prompt", "120 tokens", f"limit of {MAX_PROMPT_TOKENS}", "BATCHINFER_MAX_PROMPT_TOKENS"),
        3: bad(TL, "prompt", "80 tokens", f"context is {CONTEXT}"),
        4: bad(TL, "max_tokens", f"70 > the model's context of {CONTEXT}"),
        5: bad(TL, "messages", f"limit of {MAX_PROMPT_TOKENS}"),
        6: bad(TL, "prompt_token_ids", "70 tokens", f"context is {CONTEXT}")},
    "token_ids.jsonl": {
        2: bad(IR, "prompt_token_ids[1]", f"token id 300 is outside the model's vocabulary of {VOCAB}"),
        3: bad(IR, "prompt_token_ids[0] must be a token id"),
        4: bad(IR, "prompt_token_ids[0] must be a token id", "1099511627776"),
        5: bad(IR, "prompt_token_ids[0] must be a token id", "'a'"),
        6: bad(IR, "prompt_token_ids must be a non-empty list"),
        7: bad(IR, "prompt_token_ids[1]", "token id 999 is outside")},
    "hostile_chat.jsonl": {
        2: bad(IR, "messages", "unsafe operation", "__class__"),
        3: bad(IR, "messages", "unsafe operation", "__init__"),
        4: bad(IR, "messages", "unsafe operation"),
        5: bad(IR, "messages", "unsafe operation", "append"),
        6: bad(IR, "messages", "cannot render the chat template", "no loader"),
        7: bad(IR, "messages", "Range too big"),
        8: bad(IR, "messages", "RecursionError")},
}
MODEL_OF = {"hostile_chat.jsonl": HOSTILE}


class Serving:
    """A worker daemon serving in a thread (``run`` returns only when stopped or broken)."""

    def __init__(self, r, settings_: Settings, engine, name: str):
        self.daemon = worker_daemon(r, settings_, engine, name, block_ms=50, cancel_poll_seconds=0.2)
        self.stop_event = threading.Event()
        self.code: int | None = None
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.code = self.daemon.run(self.stop_event)

    def stop(self) -> int | None:
        self.stop_event.set()
        self.thread.join(timeout=30)
        return self.code


class Queue:
    """The module's queue: a Client, the scheduler (stepped here), two echo workers, the exporter."""

    def __init__(self, url: str, tmp: Path):
        self.tmp = tmp
        self.marker = tmp / "sandbox-escaped"  # what the hostile template and pickles try to create
        self.settings = Settings(redis_url=url, prefix=PREFIX, results_root=str(tmp / "results"),
                                 heartbeat_seconds=0.3, max_prompt_tokens=MAX_PROMPT_TOKENS)
        self.client = Client(settings=self.settings)
        self.r = self.client.redis
        hostile = self._hostile_model(tmp / HOSTILE)
        engines = {"w-echo": EchoEngine(ECHO, max_model_len=CONTEXT),
                   "w-hostile": EchoEngine.from_model_dir(hostile, max_model_len=CONTEXT)}
        self.workers = [Serving(self.r, self.settings, engine, name) for name, engine in engines.items()]
        registry = Registry(self.r, self.client.keys)
        self._until(lambda: len(registry.live_workers()) == 2 and set(registry.models()) >= {ECHO, HOSTILE},
                    "both workers registered")
        self.scheduler = SchedulerDaemon(self.r, self.settings, name="sched-badin")
        self.scheduler.dispatcher.jobs.ttl = self.scheduler.admission.jobs.ttl = 0

    def _hostile_model(self, path: Path) -> Path:
        """A model folder (tokenizer files only: the echo engine needs no weights) with a hostile template."""
        path.mkdir()
        files = byte_tokenizer_files()
        config = json.loads(files["tokenizer_config.json"])
        template = (DATA / "hostile_chat_template.jinja").read_text()
        config["chat_template"] = template.replace("MARKER", str(self.marker))
        files["tokenizer_config.json"] = json.dumps(config).encode()
        for name, data in files.items():
            (path / name).write_bytes(data)
        return path

    @staticmethod
    def _until(cond, what: str, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            assert time.monotonic() < deadline, f"timed out waiting for {what}"
            time.sleep(0.02)

    def alive(self) -> bool:
        return all(w.thread.is_alive() for w in self.workers)

    def drain(self, *jobs: str, timeout: float = 120.0) -> None:
        """Step the scheduler until every job has all its rows, then run the exports."""
        store, deadline = JobStore(self.r, self.client.keys), time.monotonic() + timeout
        while True:
            self.scheduler.run_once()  # a scheduler pass that raised would fail the test here
            states = [store.get(j).status for j in jobs]
            if all(s in (JobStatus.FINALIZING, JobStatus.COMPLETED) for s in states):
                break
            assert self.alive(), "a worker daemon died"
            assert time.monotonic() < deadline, f"jobs still {states}"
            time.sleep(0.005)
        self.export()

    def export(self) -> None:
        """What ``batchinfer exporter`` runs, without forking (this process has worker threads)."""
        from rq import Queue as RqQueue
        from rq import SimpleWorker
        from rq.serializers import JSONSerializer

        queue = RqQueue(RQ_QUEUE, connection=self.r, serializer=JSONSerializer)
        SimpleWorker([queue], connection=self.r, serializer=JSONSerializer).work(burst=True)

    def rows(self, job: str) -> dict[int, dict]:
        """The job's rows by input line."""
        rows = list(self.client.result_rows(job))
        by_line = {row["line"]: row for row in rows}
        assert len(by_line) == len(rows), "two rows for one line"
        return by_line

    def close(self) -> None:
        codes = [w.stop() for w in self.workers]
        self.client.close()
        assert codes == [0, 0], f"worker daemons exited with {codes}"


@pytest.fixture(scope="module")
def queue(redis_module, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("bad_input")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("BATCHINFER_RESULTS_ROOT", str(tmp / "results"))  # export_job reads its settings
        q = Queue(redis_module.url, tmp)
        yield q
        q.close()


@pytest.fixture(scope="module")
def corpus(queue) -> dict[str, str]:
    """Every corpus file submitted as one job, all drained together: file name -> job id."""
    jobs = {name: queue.client.submit(DATA / name, model=MODEL_OF.get(name, ECHO)) for name in CASES}
    queue.drain(*jobs.values())
    return jobs


def good_lines(path: Path, bad_lines: dict[int, Bad]) -> list[int]:
    lines = path.read_bytes().split(b"\n")
    return [n for n, text in enumerate(lines, start=1) if text.strip() and n not in bad_lines]


def check_job(queue: Queue, job: str, expected: dict[int, Bad], good: list[int]) -> dict[int, dict]:
    """Each bad line has its error row, each good line completed, and the job completed."""
    rows = queue.rows(job)
    assert sorted(rows) == sorted([*expected, *good])
    for line, want in expected.items():
        row = rows[line]
        assert (row["status"], row["error_code"]) == ("failed", want.code), (line, row["error_message"])
        for words in want.says:
            assert words in row["error_message"], (line, words, row["error_message"])
    for line in good:
        assert rows[line]["status"] == "completed", (line, rows[line]["error_message"])
        assert rows[line]["output_token_ids"], line
    record = queue.client.status(job)
    assert record.status == JobStatus.COMPLETED, (record.status, record.errors)
    assert (record.total, record.completed, record.failed) == (len(rows), len(good), len(expected))
    assert pq.read_table(record.output).num_rows == len(rows)  # the export has every row too
    return rows


@pytest.mark.parametrize("name", sorted(CASES))
def test_corpus_file(queue, corpus, name):
    rows = check_job(queue, corpus[name], CASES[name], good_lines(DATA / name, CASES[name]))
    if name == "missing_prompt.jsonl":  # a rejected line still carries the caller's id, as OpenAI's do
        assert rows[2]["custom_id"] == "no-input"
    if name == "hostile_chat.jsonl":
        assert not queue.marker.exists(), "the chat template ran code outside the sandbox"
        # good chats were rendered by the same template: <s> is one token
        assert rows[1]["prompt_tokens"] == 1 + len("user: hello there\nassistant: ")


def test_a_100mb_line_is_answered_by_the_submitter(queue, tmp_path):
    """Generated here (never committed): the submitter skips it in constant memory and answers it."""
    path = tmp_path / "huge.jsonl"
    with open(path, "wb") as f:
        f.write(b'{"custom_id": "ok-1", "prompt": "hello", "max_tokens": 4}\n{"prompt": "')
        chunk = b"a" * (1 << 20)
        for _ in range(100):
            f.write(chunk)
        f.write(b'"}\n{"custom_id": "ok-3", "prompt": "world", "max_tokens": 4}\n')
    job = queue.client.submit(path, model=ECHO)
    entries = queue.r.xrange(queue.client.keys.requests)  # the two lines (and the job's open / close ops)
    bodies = [f[b"body"] for _, f in entries if b"body" in f]
    assert len(bodies) <= 2 and max(map(len, bodies), default=0) < 1000  # the huge line never went to Redis
    queue.drain(job)
    limit = queue.settings.max_line_bytes
    check_job(queue, job, {2: bad("line_too_long", f"{100 * (1 << 20) + 15} bytes", f"limit of {limit}",
                                  "BATCHINFER_MAX_LINE_BYTES")}, [1, 3])


def test_duplicate_custom_ids_are_accepted_and_reported(queue):
    args = ["--redis-url", queue.settings.redis_url, "--prefix", PREFIX]
    path = DATA / "duplicate_custom_id.jsonl"
    result = CliRunner().invoke(cli, [*args, "submit", str(path), "--model", ECHO, "--json"],
                                catch_exceptions=False)
    assert result.exit_code == 0, result.output
    submitted = json.loads(result.stdout)
    job = submitted["job_id"]
    [warning] = submitted["warnings"]
    assert "duplicate custom_id" in warning and "lines 1, 3, 6; lines 2, 5" in warning
    assert warning in result.stderr  # people see it at once
    queue.drain(job)
    rows = check_job(queue, job, {}, [1, 2, 3, 4, 5, 6])
    assert [rows[n]["custom_id"] for n in range(1, 7)] == ["a", "b", "a", "c", "b", "a"]
    assert queue.client.status(job).errors == [warning]
    status = CliRunner().invoke(cli, [*args, "status", job], catch_exceptions=False)
    assert status.exit_code == 0 and "lines 1, 3, 6; lines 2, 5" in status.output


def _submit_cli(queue: Queue, path: Path) -> tuple[int, str]:
    args = ["--redis-url", queue.settings.redis_url, "--prefix", PREFIX, "submit", str(path), "--model", ECHO]
    result = CliRunner().invoke(cli, args, catch_exceptions=False)
    return result.exit_code, result.output


def test_empty_and_unreadable_inputs_are_refused_before_queueing(queue, tmp_path):
    before_jobs, before_entries = len(queue.client.jobs(10_000)), queue.r.xlen(queue.client.keys.requests)
    for name in ("empty.jsonl", "blank_lines.jsonl"):
        code, out = _submit_cli(queue, DATA / name)
        assert (code, out.strip()) == (EXIT_INPUT, f"error: {name}: no requests (the input is empty)")
    # a folder is a dataset (issue 31): one with no data file in it is refused, saying what it lacks
    empty = tmp_path / "empty"
    (empty / "_manifests").mkdir(parents=True)
    (empty / ".hidden.parquet").write_bytes(b"")
    code, out = _submit_cli(queue, empty)
    assert code == EXIT_INPUT and f"{empty} holds no file: a dataset folder holds Parquet, CSV" in out, out
    not_gzip = tmp_path / "in.jsonl.gz"
    not_gzip.write_bytes(b"this is not gzip data\n")
    code, out = _submit_cli(queue, not_gzip)
    assert code == EXIT_INPUT and "in.jsonl.gz: read failed after line 0" in out
    code, out = _submit_unreadable(queue)
    assert code == EXIT_INPUT and "secret.jsonl: cannot be read: Permission denied" in out, out
    assert len(queue.client.jobs(10_000)) == before_jobs  # no job was created
    assert queue.r.xlen(queue.client.keys.requests) == before_entries  # and nothing was queued


def _submit_unreadable(queue: Queue) -> tuple[int, str]:
    """A file without read permission. Root reads anything, so as root the CLI runs in a child process
    that dropped to nobody's uid (forked, not exec'd: the interpreter's own files may be root's only)."""
    folder = Path(tempfile.mkdtemp(prefix="batchinfer-unreadable-"))
    try:
        folder.chmod(0o755)  # only the file itself is closed
        path = folder / "secret.jsonl"
        path.write_text('{"prompt": "x"}\n')
        path.chmod(0)
        return _submit_cli(queue, path) if os.geteuid() != 0 else _as_nobody(lambda: _submit_cli(queue, path))
    finally:
        shutil.rmtree(folder)


def _as_nobody(fn) -> tuple[int, str]:
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child
        try:
            os.close(read_end)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            outcome = fn()
        except BaseException as e:  # noqa: BLE001 - reported to the parent, which fails the test
            outcome = (-1, f"child failed: {e!r}")
        os.write(write_end, json.dumps(outcome).encode())
        os._exit(0)
    os.close(write_end)
    ready, _, _ = select.select([read_end], [], [], 120)
    if not ready:  # never hang the suite on a stuck child
        os.kill(pid, signal.SIGKILL)
    with os.fdopen(read_end) as pipe:
        data = pipe.read() if ready else ""
    os.waitpid(pid, 0)
    assert data, "the child running as nobody did not answer"
    code, out = json.loads(data)
    return code, out


def test_a_truncated_gzip_cancels_its_job_with_a_clear_error(queue, tmp_path):
    line = b'{"prompt": "%s", "max_tokens": 2}\n'
    lines = b"".join(line % os.urandom(16).hex().encode() for _ in range(300))  # compresses little
    path = tmp_path / "cut.jsonl.gz"
    path.write_bytes(gzip.compress(lines)[:-100])  # the end of the stream is missing
    code, out = _submit_cli(queue, path)
    assert code == EXIT_INPUT and "cut.jsonl.gz: read failed after line" in out, out
    [record] = [r for r in queue.client.jobs(10_000) if r.input_name == "cut.jsonl.gz"]
    assert record.status in (JobStatus.CANCELLING, JobStatus.CANCELLED)
    assert any("read failed" in e for e in record.errors)


class Mkdir:
    """A pickle payload that creates a folder when loaded: proof that nobody loaded it."""

    def __init__(self, path: Path):
        self.path = str(path)

    def __reduce__(self):
        return os.mkdir, (self.path,)


def test_foreign_producer_entries_get_error_rows(queue):
    """Entries XADDed by hand: malformed, other versions, not UTF-8, over-size, pickles. Routable ones
    answer their job; the others answer results:direct (and their reply_to)."""
    r, keys = queue.r, queue.client.keys
    job = "foreign-1"
    JobStore(r, keys).create(job, model=ECHO)
    good = json.dumps({"prompt": "hello", "max_tokens": 2})
    route = {"job": job}
    entries = [  # (fields, expected) in idx order; idx / line added below
        ({"v": "1", "body": good}, None),
        ({"v": "1"}, bad("protocol_error", "body", "no 'body' field")),
        ({"v": "2", "body": good}, bad("protocol_error", "unsupported protocol version v='2'")),
        ({"v": "1", "body": good, "urgency": "9"}, bad(PE, "unknown intake field(s): urgency")),
        ({"v": "1", "body": good, "priority": "high"}, bad(PE, "priority must be an integer", "priority")),
        ({"v": "1", "body": b'{"prompt": "caf\xe9"}'}, bad(PE, "not UTF-8", "body")),
        ({"v": "1", "body": pickle.dumps(Mkdir(queue.marker))}, bad(PE, "not UTF-8", "body")),
        ({"v": "1", "body": pickle.dumps(Mkdir(queue.marker), protocol=0)}, bad(IJ, "invalid JSON")),
        ({"v": "1", "body": '{"prompt": "' + "a" * (11 << 20) + '"}'},
         bad("line_too_long", "body", "limit of 10485760")),
        ({"v": "1", "body": good}, None),
    ]
    for idx, (fields, _) in enumerate(entries):
        r.xadd(keys.requests, {**fields, **route, "idx": idx, "line": idx + 1})
    Publisher(r, keys).finish_submission(job, len(entries))
    reply = keys.reply("foreign")
    unroutable = {  # entries without a usable job / idx: their rows are direct
        r.xadd(keys.requests, {"hello": "world"}): bad("protocol_error", "no protocol version field 'v'"),
        r.xadd(keys.requests, {"v": "1", "body": good, "job": job}): bad("protocol_error", "needs 'idx'"),
        r.xadd(keys.requests, {"v": "1", "body": good, "job": "../../etc", "idx": "0"}):
            bad("protocol_error", "job id '../../etc' is invalid"),
        r.xadd(keys.requests, {"v": "3", "body": good, "reply_to": reply}): bad("protocol_error", "v='3'"),
    }
    queue.drain(job)
    expected = {idx + 1: want for idx, (_, want) in enumerate(entries) if want is not None}
    check_job(queue, job, expected, [1, 10])
    direct_rows = (json.loads(fields[b"row"]) for _, fields in r.xrange(keys.results("direct")))
    direct = {row["request_id"]: row for row in direct_rows}
    for entry_id, want in unroutable.items():
        row = direct[entry_id.decode()]
        assert (row["status"], row["error_code"]) == ("failed", want.code)
        assert all(words in row["error_message"] for words in want.says), row["error_message"]
    [(_, replied)] = r.xrange(reply)
    assert json.loads(replied[b"row"])["error_code"] == "protocol_error"  # the producer hears back
    assert not queue.marker.exists(), "a pickled payload was loaded"


def test_pickles_and_malformed_entries_on_a_batch_stream_are_rejected_not_loaded(queue):
    """A producer writing to a worker's batch stream directly: whole pickled entries and entries that
    are no batch are dead-lettered (and acked); a pickled field inside a request gives that request an
    error row; the rest of the batch completes."""
    r, keys = queue.r, queue.client.keys
    job = "foreign-batch"
    JobStore(r, keys).create(job, model=ECHO)

    def request(idx: int, **override) -> dict:
        return {"request_id": f"{job}:{idx}", "job_id": job, "idx": idx, "line": idx + 1, "model": ECHO,
                "prompt_token_ids": [104, 105], "sampling_params": {"max_tokens": 2}, **override}

    stream = keys.batches(ECHO)
    dead_before = r.xlen(keys.deadletter)
    evil = pickle.dumps(Mkdir(queue.marker))
    junk = [r.xadd(stream, {"v": "1", "requests": evil}),  # the whole entry is a pickle
            r.xadd(stream, {"payload": evil}),  # not a batch entry at all
            r.xadd(stream, {"v": "2", "requests": json.dumps([request(0)])}),  # a version we do not speak
            r.xadd(stream, {"v": "1", "requests": json.dumps([{"prompt_token_ids": [1]}])})]  # no route
    r.xadd(stream, {"v": "1", "requests": json.dumps([
        request(0), request(1, sampling_params=pickle.dumps(Mkdir(queue.marker), protocol=0).decode()),
        request(2)])})
    Publisher(r, keys).finish_submission(job, 3)
    queue.drain(job)
    rows = queue.rows(job)
    assert [rows[n]["status"] for n in (1, 2, 3)] == ["completed", "failed", "completed"]
    assert rows[2]["error_code"] == "invalid_request"
    assert rows[2]["error_message"] == "sampling parameters must be an object, got str"
    assert queue.client.status(job).status == JobStatus.COMPLETED
    assert r.xlen(keys.deadletter) - dead_before == len(junk)
    assert r.xpending(stream, WORKERS_GROUP)["pending"] == 0  # nothing left to be re-delivered forever
    assert not any(r.xrange(stream, min=e, max=e) for e in junk)
    assert not queue.marker.exists(), "a pickled payload was loaded"


def test_daemons_survived_and_still_serve(queue):
    """After everything above: no daemon died, no row is an internal error, and a new job completes."""
    assert queue.alive()
    for record in queue.client.jobs(10_000):
        codes = {row.get("error_code") for row in queue.client.result_rows(record.id)}
        assert "internal_error" not in codes, (record.id, codes)
    job = queue.client.submit([{"prompt": "still here", "max_tokens": 3}], model=ECHO)
    queue.drain(job)
    check_job(queue, job, {}, [1])


# -- the parser alone: whatever the text, a RequestError or a spec, and a row that can be written --------

_pieces = st.sampled_from(['{', '}', '[', ']', ',', ':', '"prompt"', '"custom_id"', '"messages"', '"role"',
                           '"content"', '"user"', '"max_tokens"', '"metadata"', '"k"', '1', '-1', '1e999',
                           'null', 'true', '"x"', '"\\ud800"', '"\\udfff"', '"\\ud83d\\ude00"', '"caf\u00e9"',
                           '"\\u0000"', 'NaN', ' '])


# text with lone surrogates now and then (hypothesis' own text strategies leave them out)
_any_text = st.lists(st.text(max_size=3) | st.sampled_from(["\ud800", "\udc80", "\U0001f600"]),
                     max_size=3).map("".join)
_bodies = st.fixed_dictionaries({"custom_id": _any_text, "prompt": _any_text,
                                 "metadata": st.dictionaries(_any_text, _any_text, max_size=2)},
                                optional={"temperature": st.just(-1)})


@settings(max_examples=300, deadline=None)
@given(st.lists(_pieces, max_size=30).map("".join) | _bodies.map(json.dumps))
def test_parser_answers_every_text_with_a_writable_row(text):
    try:
        spec = parse_body(text, line=2)
    except RequestError as e:
        row = ResultRow.error(e.code, e.message, job_id="j", idx=0, line=e.line,
                              custom_id=e.context.get("custom_id"))
    else:
        row = ResultRow.error("probe", "ok", job_id="j", idx=0, custom_id=spec.custom_id,
                              metadata=spec.metadata)
        for value in (spec.prompt, spec.custom_id, json.dumps(spec.messages, ensure_ascii=False)):
            if value is not None:
                value.encode("utf-8")  # every string is Unicode, so tokenisers and Redis take it
    row.to_json().encode("utf-8")  # the row can be published


def test_corpus_files_are_small():
    """The 100 MB line is generated by its test; nothing big is committed."""
    sizes = {p.name: p.stat().st_size for p in DATA.iterdir()}
    assert set(CASES) <= set(sizes) and sum(sizes.values()) < 64 * 1024
