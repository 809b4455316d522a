"""End to end through the CLI daemons, as real subprocesses on a real redis-server.

Scheduler, worker (tiny Llama on CPU, or ``--echo``) and exporter run as ``python -m
batchinfer.cli ...``; jobs go in through the CLI (JSONL plain and OpenAI lines, Parquet) or a
raw XADD, and their Parquet output is compared with the in-process ``LLM.generate`` tokens.
Daemon logs are printed at teardown, so pytest shows them when a test fails. The daemons are
driven by ``tests/daemons.py``'s :class:`Stack`, shared with the fault-injection suite.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import threading
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from daemons import CLI, JOB_TIMEOUT_S, START_TIMEOUT_S, Stack

from batchinfer.store.jobstore import JobStatus

pytestmark = pytest.mark.slow

MODEL = "tiny-llama"  # the served name: the tiny_llama folder's name
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_stack(redis_session, tiny_llama, tmp_path_factory):
    """Scheduler + one tiny-Llama worker + exporter, shared by the tests of this module."""
    allowed = {"BATCHINFER_OUTPUT_URI_PREFIXES": tmp_path_factory.getbasetemp().as_uri()}  # file:// outputs
    stack = Stack(redis_session.url, tmp_path_factory.mktemp("model-stack"), env=allowed)
    stack.start("scheduler", "scheduler")
    stack.worker("worker", tiny_llama)
    stack.start("exporter", "exporter")
    stack.wait_for_workers(1)
    yield stack
    stack.close()
    print(stack.logs())  # shown by pytest when a test of this module failed


@pytest.fixture
def echo_stack(redis_session, tmp_path):
    stack = Stack(redis_session.url, tmp_path)
    stack.start("scheduler", "scheduler")
    stack.start("exporter", "exporter")
    yield stack
    stack.close()
    print(stack.logs())


@pytest.fixture(scope="module")
def llm(tiny_llama):
    from batchinfer.workers.entrypoints.llm import LLM

    return LLM(tiny_llama)


def reference(llm, prompt, **params) -> list[int]:
    """Tokens of the in-process engine for one prompt (a string, token ids or chat messages)."""
    from batchinfer.workers.sampling_params import SamplingParams

    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
        prompt = {"prompt_token_ids": llm.get_tokenizer().apply_chat_template(prompt, tokenize=True)}
    elif isinstance(prompt, list):
        prompt = {"prompt_token_ids": prompt}
    [out] = llm.generate([prompt], SamplingParams(**params), use_tqdm=False)
    return list(out.outputs[0].token_ids)


def read_rows(path: Path) -> list[dict]:
    return pq.read_table(path).to_pylist()


CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there!"}]
JSONL_LINES = [
    {"custom_id": "plain", "prompt": "Hello world", "max_tokens": 8, "temperature": 0},
    {"custom_id": "ids", "prompt_token_ids": [5, 6, 7, 8], "max_tokens": 6, "temperature": 0,
     "ignore_eos": True},
    {"custom_id": "chat", "messages": CHAT, "max_tokens": 6, "temperature": 0},
    "{this is not json",
    {"custom_id": "oa-chat", "method": "POST", "url": "/v1/chat/completions",
     "body": {"model": MODEL, "messages": CHAT, "max_completion_tokens": 5, "temperature": 0}},
    "",
    {"custom_id": "oa-cmpl", "method": "POST", "url": "/v1/completions",
     "body": {"prompt": "The quick brown fox", "max_tokens": 7, "temperature": 0}},
    {"custom_id": "colour", "prompt": "x", "colour": "red"},
    {"custom_id": "cold", "prompt": "x", "temperature": -1},
    {"custom_id": "seeded", "prompt": "The engine", "max_tokens": 8, "temperature": 0.8, "seed": 11},
]


def test_jsonl_plain_and_openai_lines_with_bad_lines(model_stack, llm, tmp_path):
    f = tmp_path / "in.jsonl"
    f.write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in JSONL_LINES) + "\n")
    out = tmp_path / "out.parquet"
    sub = model_stack.cli("submit", str(f), "--model", MODEL, "--output", out.as_uri(), "--json")
    assert sub.returncode == 0, sub.stderr
    job = json.loads(sub.stdout)["job_id"]
    waited = model_stack.cli("wait", job, "--timeout", str(JOB_TIMEOUT_S), "--json")
    assert waited.returncode == 0, f"{waited.stdout}\n{waited.stderr}\n{model_stack.logs()}"
    record = json.loads(waited.stdout)
    assert record["status"] == "completed" and record["output"] == out.as_uri()
    assert record["request_counts"] == {"total": 9, "completed": 6, "failed": 3, "cancelled": 0, "expired": 0,
                                        "held": 0}

    rows = read_rows(out)
    assert [r["idx"] for r in rows] == list(range(9))
    assert [r["line"] for r in rows] == [1, 2, 3, 4, 5, 7, 8, 9, 10]  # the blank line 6 is not a request
    by_line = {r["line"]: r for r in rows}
    bad = {line: (by_line[line]["status"], by_line[line]["error_code"], by_line[line]["error_message"])
           for line in (4, 8, 9)}
    assert bad[4][:2] == ("failed", "invalid_json") and "invalid JSON" in bad[4][2]
    assert bad[8][:2] == ("failed", "invalid_request") and "colour" in bad[8][2]
    assert bad[9][:2] == ("failed", "invalid_request") and "temperature" in bad[9][2]
    assert (by_line[8]["custom_id"], by_line[9]["custom_id"]) == ("colour", "cold")  # as OpenAI does

    expected = {
        1: reference(llm, "Hello world", max_tokens=8, temperature=0),
        2: reference(llm, [5, 6, 7, 8], max_tokens=6, temperature=0, ignore_eos=True),
        3: reference(llm, CHAT, max_tokens=6, temperature=0),
        5: reference(llm, CHAT, max_tokens=5, temperature=0),
        7: reference(llm, "The quick brown fox", max_tokens=7, temperature=0),
        10: reference(llm, "The engine", max_tokens=8, temperature=0.8, seed=11),
    }
    for line, tokens in expected.items():
        row = by_line[line]
        assert row["status"] == "completed", row
        assert row["output_token_ids"] == tokens, (line, row)
        assert row["completion_tokens"] == len(tokens) and row["model"] == MODEL
        assert row["worker"] == "worker"
    assert by_line[5]["custom_id"] == "oa-chat" and by_line[7]["custom_id"] == "oa-cmpl"

    openai_out = tmp_path / "openai.jsonl"
    res = model_stack.cli("results", job, "-o", str(openai_out), "--format", "openai")
    assert res.returncode == 0, res.stderr
    lines = {x["custom_id"]: x for x in map(json.loads, openai_out.read_text().splitlines())}
    assert lines["oa-chat"]["response"]["body"]["object"] == "chat.completion"
    assert lines["oa-cmpl"]["response"]["body"]["object"] == "text_completion"
    assert lines["colour"]["error"]["code"] == "invalid_request"


def test_parquet_input(model_stack, llm, tmp_path):
    import pyarrow as pa

    prompts = ["Hello world", "The cache", "There is the worker and the queue"]
    table = pa.table({"custom_id": [f"p{i}" for i in range(3)], "prompt": prompts,
                      "max_tokens": [4, 6, 5], "temperature": [0.0, 0.0, 0.0]})
    f = tmp_path / "in.parquet"
    pq.write_table(table, f)
    out = tmp_path / "out.parquet"
    sub = model_stack.cli("submit", str(f), "--model", MODEL, "--output", out.as_uri(), "--wait", "--json")
    assert sub.returncode == 0, f"{sub.stdout}\n{sub.stderr}\n{model_stack.logs()}"
    rows = read_rows(out)
    assert [r["custom_id"] for r in rows] == ["p0", "p1", "p2"] and [r["line"] for r in rows] == [1, 2, 3]
    for row, prompt, n in zip(rows, prompts, [4, 6, 5], strict=True):
        assert row["output_token_ids"] == reference(llm, prompt, max_tokens=n, temperature=0), row


def test_direct_xadd_producer_with_reply_to(model_stack, llm):
    r = model_stack.client.redis
    reply = f"{model_stack.prefix}:reply:{uuid.uuid4().hex}"
    body = {"custom_id": "direct-1", "model": MODEL, "prompt": "Hello", "max_tokens": 5, "temperature": 0}
    fields = {"v": "1", "body": json.dumps(body), "reply_to": reply}
    entry_id = r.xadd(f"{model_stack.prefix}:requests", fields)
    got = r.xread({reply: "0-0"}, block=JOB_TIMEOUT_S * 1000)
    assert got, f"no reply on {reply}\n{model_stack.logs()}"
    row = json.loads(got[0][1][0][1][b"row"])
    assert row["status"] == "completed" and row["custom_id"] == "direct-1" and row["job_id"] is None
    assert row["request_id"] == entry_id.decode()
    assert row["output_token_ids"] == reference(llm, "Hello", max_tokens=5, temperature=0)
    direct = [json.loads(f[b"row"]) for _, f in r.xrange(f"{model_stack.prefix}:results:direct")]
    assert [d["custom_id"] for d in direct].count("direct-1") == 1
    r.delete(reply)


def test_cancel_mid_job(model_stack, tmp_path):
    client = model_stack.client
    # Long enough that the cancel (a CLI process: ~0.5 s) lands mid-job: 600 x 48 tokens took
    # ~1.2 s on the 2-core VM, and the first rows came at ~0.5 s.
    n = 1000
    job = client.submit([{"prompt": f"request {i}", "max_tokens": 128, "ignore_eos": True, "temperature": 0}
                         for i in range(n)], model=MODEL)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while client.status(job).completed < 1:
        model_stack.check_alive()
        assert time.monotonic() < deadline, model_stack.logs()
        time.sleep(0.1)
    res = model_stack.cli("cancel", job, "--json")
    assert res.returncode == 0 and json.loads(res.stdout)["status"] == "cancelling", res.stderr
    record = model_stack.wait(job)
    assert record.status == JobStatus.CANCELLED, (record, model_stack.logs())
    rows = list(client.result_rows(job))
    idxs = sorted(r["idx"] for r in rows)
    assert idxs == list(range(n)), "every request has exactly one row"
    statuses = {s: sum(r["status"] == s for r in rows) for s in ("completed", "cancelled")}
    assert statuses["completed"] >= 1 and statuses["cancelled"] >= 1
    assert statuses["completed"] + statuses["cancelled"] == n
    assert record.completed == statuses["completed"] and record.cancelled == statuses["cancelled"]
    assert record.failed == 0  # cancelled rows are counted apart
    waited = model_stack.cli("wait", job)
    assert waited.returncode == 5  # the job ended, but not completed


def test_two_echo_workers_share_a_job(echo_stack, tiny_llama):
    echo_stack.worker("echo-a", tiny_llama, echo=True)
    echo_stack.worker("echo-b", tiny_llama, echo=True)
    echo_stack.wait_for_workers(2)
    n = 3000
    records = [{"custom_id": str(i), "prompt_token_ids": [10 + i % 200, 11, 12, 13], "max_tokens": 3}
               for i in range(n)]
    job = echo_stack.client.submit(records, model=MODEL)
    record = echo_stack.wait(job)
    assert record.status == JobStatus.COMPLETED, (record, echo_stack.logs())
    rows = read_rows(Path(record.output))
    assert [r["idx"] for r in rows] == list(range(n))
    assert all(r["output_token_ids"] == [10 + i % 200, 11, 12] for i, r in enumerate(rows))
    assert {r["worker"] for r in rows} == {"echo-a", "echo-b"}


def test_scheduler_restart_mid_job_loses_and_duplicates_nothing(echo_stack, tiny_llama):
    echo_stack.worker("echo", tiny_llama, echo=True)
    echo_stack.wait_for_workers(1)
    n = 3000
    job = echo_stack.client.submit([{"prompt_token_ids": [20, 21, 22], "max_tokens": 2}] * n, model=MODEL)
    deadline = time.monotonic() + JOB_TIMEOUT_S
    while echo_stack.client.status(job).done < 1:
        echo_stack.check_alive()
        assert time.monotonic() < deadline, echo_stack.logs()
        time.sleep(0.05)
    echo_stack.stop("scheduler", signal.SIGKILL)
    echo_stack.start("scheduler-2", "scheduler")
    record = echo_stack.wait(job)
    assert record.status == JobStatus.COMPLETED, (record, echo_stack.logs())
    assert record.request_counts == {"total": n, "completed": n, "failed": 0, "cancelled": 0, "expired": 0,
                                     "held": 0}
    rows = list(echo_stack.client.result_rows(job))
    assert sorted(r["idx"] for r in rows) == list(range(n))


def test_batchinfer_run_end_to_end(tiny_llama, llm, tmp_path):
    out = tmp_path / "out.parquet"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("BATCHINFER_REDIS_URL", None)
    proc = subprocess.run([*CLI, "run", str(REPO / "examples" / "prompts.jsonl"), "-o", str(out),
                           "--model", str(tiny_llama), "--logs", str(tmp_path / "logs"), "--json"],
                          env=env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, cwd=tmp_path)
    logs = "\n".join(p.read_text() for p in (tmp_path / "logs").glob("*.log"))
    assert proc.returncode == 0, f"{proc.stdout}\n{proc.stderr}\n{logs}"
    assert json.loads(proc.stdout)["status"] == "completed"
    rows = read_rows(out)
    n = len((REPO / "examples" / "prompts.jsonl").read_text().splitlines())
    assert len(rows) == n
    failed = {r["line"]: r["error_code"] for r in rows if r["status"] != "completed"}
    assert failed == {n - 1: "invalid_request", n: "invalid_json"}  # the two deliberately bad lines
    japan = next(r for r in rows if r["custom_id"] == "japan")
    expected = reference(llm, "The capital of Japan is", max_tokens=48, temperature=0, stop=["."])
    assert japan["output_token_ids"] == expected


def _processes_mentioning(text: str) -> list[int]:
    """Live processes whose command line or environment contains ``text`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            data = (entry / "cmdline").read_bytes() + (entry / "environ").read_bytes()
            state = (entry / "stat").read_text().split()[2]
        except OSError:
            continue
        if text.encode() in data and state != "Z":
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc")
def test_run_stops_everything_on_ctrl_c(tiny_llama, tmp_path):
    f = tmp_path / "long.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"line {i}", "max_tokens": 200, "ignore_eos": True}) + "\n"
                         for i in range(400)))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("BATCHINFER_REDIS_URL", None)
    args = ["run", str(f), "-o", str(tmp_path / "out.parquet"), "--model", str(tiny_llama)]
    proc = subprocess.Popen([*CLI, *args], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, cwd=tmp_path)
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(iter(proc.stderr.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + START_TIMEOUT_S
    while not any(line.startswith("job ") for line in seen):
        assert proc.poll() is None and time.monotonic() < deadline, "".join(seen)
        time.sleep(0.1)
    socket_line = next(line for line in seen if line.startswith("redis: embedded redis-server on unix://"))
    socket_path = socket_line.split("unix://", 1)[1].strip()
    assert _processes_mentioning(socket_path), "the daemons and Redis should be running now"
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, "".join(seen)
    reader.join(timeout=10)
    assert _processes_mentioning(socket_path) == [], "run must stop everything it started"
    assert not Path(socket_path).parent.exists()
