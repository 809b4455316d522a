"""The HTTP API's end-to-end stack for tests: daemons as real subprocesses and ``batchinfer api``.

:class:`ApiStack` is a :class:`daemons.Stack` (one Redis, one fresh key prefix, every daemon in its
own process group with its log in ``<tmp>/<name>.log``) that starts, in :meth:`ApiStack.start_all`:

- ``scheduler`` and ``exporter``;
- ``worker``: the model folder given (the ``tiny_llama`` fixture's, served as ``tiny-llama``, the
  folder's name), started but not awaited: it loads while the test goes on; a test that needs it
  live (a batch that must finish, a synchronous request) calls :meth:`ApiStack.wait_for_model`
  first. Without a model folder no worker starts;
- ``api``: ``batchinfer api --port <free port>`` with ``BATCHINFER_FILES_DIR=<tmp>/files``, awaited
  until its ``/readyz`` answers 200.

Then:

- ``.root_url`` ``http://127.0.0.1:<port>``, ``.base_url`` the same + ``/v1`` (OpenAI's base URL);
- ``.key(name, **limits)`` -> a new key's secret (ApiKeys.create on the stack's Redis and prefix);
- ``.openai(secret, url=None)`` / ``.anthropic(secret, url=None)`` -> the official SDK clients
  (``max_retries=0``, so an error shows at once) on this API or on ``url`` (another replica's);
- ``.http(secret=None, url=None)`` -> an ``httpx2.Client`` on the root URL (raw requests; the secret
  as ``Authorization: Bearer``);
- ``.start_api(name)`` -> a second replica ``name`` on its own port (same Redis, prefix and file
  store): its base URL; ``.restart_api(name="api")`` stops a replica (SIGTERM) and starts it
  again on the same port; ``.kill(name)`` / ``.stop(name)`` from Stack work on replicas too;
- ``.client`` (a batchinfer Client on the same queue), ``.until``, ``.wait``, ``.logs()`` from Stack.

The fixture ``api_stack`` (tests/conftest.py) gives one started stack per test, with the tiny
Llama, and closes it (printing the daemons' log tails, which pytest shows for a failing test).
"""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

from daemons import START_TIMEOUT_S, Stack

from batchinfer.store.apikeys import ApiKeys

API_READY_TIMEOUT_S = 60.0
MODEL_NAME = "tiny-llama"  # the served name of the tiny_llama fixture's folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _ready(root_url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{root_url}/readyz", timeout=2) as reply:
            return reply.status == 200
    except (urllib.error.URLError, OSError):
        return False


class ApiStack(Stack):
    """Scheduler, exporter, a worker and ``batchinfer api`` replicas on one queue (module docstring)."""

    def __init__(self, redis_url: str, tmp: Path, model_dir: Path | None = None,
                 env: dict[str, str] | None = None):
        tmp.mkdir(parents=True, exist_ok=True)
        super().__init__(redis_url, tmp, env={"BATCHINFER_FILES_DIR": str(tmp / "files"), **(env or {})})
        self.model_dir = model_dir
        self.ports: dict[str, int] = {}  # API replica name -> its port
        self.api_keys = ApiKeys(self.client.redis, self.client.keys)

    # -- processes --------------------------------------------------------------------------------

    def start_all(self) -> ApiStack:
        """Start the scheduler, the exporter, the worker (not awaited) and ``api`` (awaited)."""
        self.start("scheduler", "scheduler")
        self.start("exporter", "exporter")
        if self.model_dir is not None:
            self.worker("worker", self.model_dir)
        self.start_api("api")
        return self

    def start_api(self, name: str = "api", port: int | None = None, args: tuple[str, ...] = ()) -> str:
        """Start API replica ``name`` (``batchinfer api --port PORT *ARGS``; a free port by default)
        and wait for its ``/readyz``; its base URL (``.../v1``)."""
        port = port or self.ports.get(name) or free_port()
        self.ports[name] = port
        self.start(name, "api", "--port", str(port), *args)
        root = self.url_of(name)
        self.until(lambda: _ready(root), API_READY_TIMEOUT_S, f"{name} /readyz on {root}", poll=0.1)
        return f"{root}/v1"

    def restart_api(self, name: str = "api") -> str:
        """Stop replica ``name`` (SIGTERM: a graceful stop) and start it again on the same port."""
        self.stop(name)
        return self.start_api(name, self.ports[name])

    def wait_for_model(self, timeout: float = START_TIMEOUT_S) -> None:
        """Until the worker serves the model (a daemon dying meanwhile fails the test)."""
        assert self.model_dir is not None, "this stack has no worker"
        self.wait_for_worker("worker", timeout)

    # -- addresses and clients --------------------------------------------------------------------

    def url_of(self, name: str = "api") -> str:
        """Replica ``name``'s root URL."""
        return f"http://127.0.0.1:{self.ports[name]}"

    @property
    def root_url(self) -> str:
        return self.url_of("api")

    @property
    def base_url(self) -> str:
        return f"{self.root_url}/v1"

    def key(self, name: str, **limits: int | None) -> str:
        """A new API key ``name`` (``max_file_bytes``, ``max_files``, ``max_queued_requests``): its secret."""
        secret, _ = self.api_keys.create(name, **limits)
        return secret

    def openai(self, secret: str, url: str | None = None) -> Any:
        import openai

        base = (url or self.base_url).rstrip("/")
        base = base if base.endswith("/v1") else f"{base}/v1"
        return openai.OpenAI(base_url=base, api_key=secret, max_retries=0)

    def anthropic(self, secret: str, url: str | None = None) -> Any:
        import anthropic

        root = (url or self.root_url).rstrip("/").removesuffix("/v1")
        return anthropic.Anthropic(base_url=root, api_key=secret, max_retries=0)

    def http(self, secret: str | None = None, url: str | None = None) -> Any:
        import httpx2  # the HTTP client the openai and anthropic SDKs use

        root = (url or self.root_url).rstrip("/").removesuffix("/v1")
        headers = {"Authorization": f"Bearer {secret}"} if secret else {}
        return httpx2.Client(base_url=root, headers=headers, timeout=60)


def serve_sync_and_batch(stack: ApiStack) -> None:
    """Start ``stack``; through the official SDK, 8 synchronous completions (direct requests: a random
    partition each) and a 6-line chat batch (a job: its id's partition) are answered, and the
    partitions' intake streams carried them all."""
    stack.start_all()
    stack.wait_for_model()
    client = stack.openai(stack.key("p"))
    texts = [client.completions.create(model=MODEL_NAME, prompt=f"say {i}", max_tokens=3, temperature=0)
             for i in range(8)]
    assert all(t.usage.completion_tokens == 3 for t in texts)
    lines = [{"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": MODEL_NAME, "messages": [{"role": "user", "content": f"say {i}"}],
                       "max_tokens": 4}} for i in range(6)]
    data = "".join(json.dumps(x) + "\n" for x in lines).encode()
    file_id = client.files.create(file=("in.jsonl", data), purpose="batch").id
    batch = client.batches.create(input_file_id=file_id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = stack.until(lambda: (b := client.batches.retrieve(batch.id)).status == "completed" and b, 120,
                       "the batch", poll=0.2)
    assert (done.request_counts.total, done.request_counts.completed) == (6, 6)
    out = client.files.content(done.output_file_id).content.decode().splitlines()
    assert sorted(json.loads(x)["custom_id"] for x in out) == [f"b{i}" for i in range(6)]
    keys = stack.client.keys
    added = [stack.client.redis.xinfo_stream(k.requests)["entries-added"] for k in keys.parts()]
    assert keys.partitions > 1 and sum(added) >= 8 + 6  # the sync requests and the batch's lines
