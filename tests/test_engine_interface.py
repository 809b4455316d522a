"""``WorkerEngine``: both engines implement it member for member, and the daemon uses nothing else."""

from __future__ import annotations

import ast
import inspect
from pathlib import Path

import pytest
from tiny_embedders import make_tiny_embedding_model

from batchinfer.workers.engine.embedder import EmbeddingEngine
from batchinfer.workers.engine.engine import Engine
from batchinfer.workers.engine.interface import WorkerEngine
from batchinfer.workers.engine_config import EngineConfig
from batchinfer.workers.service.echo_engine import EchoEngine

DAEMON = Path(__file__).resolve().parents[1] / "workers" / "service" / "daemon.py"
# The daemon and the managers it drives the engine through (issue 26's split of daemon.py)
DAEMON_MODULES = [DAEMON.with_name(f"{m}.py") for m in ("daemon", "feeder", "reader", "registration")]


def protocol_members() -> set[str]:
    """The protocol's public methods, properties and annotated attributes."""
    defined = {name for name in vars(WorkerEngine) if not name.startswith("_")}
    return defined | set(WorkerEngine.__annotations__)


def test_the_protocol_holds_what_the_daemon_drives():
    assert protocol_members() == {
        "task", "model_name", "eos_token_ids", "tokenizer_files", "capacity", "add_request", "abort", "step",
        "has_unfinished", "num_unfinished", "num_running", "num_waiting", "num_preemptions", "kv_usage",
        "num_computed_tokens", "lora_adapters", "resident_adapters", "step_stats", "spec_stats"}


@pytest.fixture(scope="module")
def engines(tiny_llama, tmp_path_factory) -> list[WorkerEngine]:
    """Every engine the worker daemon serves: generation (model and echo) and embeddings."""
    bert = make_tiny_embedding_model(tmp_path_factory.mktemp("bert") / "bert")
    return [Engine(EngineConfig(model=str(tiny_llama), num_kv_blocks=8)), EchoEngine(),
            EmbeddingEngine.from_model(bert, max_num_batched_tokens=128)]


def test_the_fixture_holds_every_worker_engine(engines):
    # a new WorkerEngine class (``class X(WorkerEngine)`` anywhere in workers/) must join the fixture
    trees = [ast.parse(path.read_text()) for path in DAEMON.parents[1].rglob("*.py")]  # all of workers/
    declared = {node.name for tree in trees for node in ast.walk(tree) if isinstance(node, ast.ClassDef)
                and any(ast.unparse(b) == "WorkerEngine" for b in node.bases)}
    assert declared == {type(e).__name__ for e in engines}


def _defining_class(cls: type, name: str) -> type | None:
    return next((c for c in cls.__mro__ if name in vars(c)), None)


def _check_signature(impl: inspect.Signature, proto: inspect.Signature, where: str) -> None:
    """Every protocol parameter, by name and kind, in order; extra parameters only with defaults."""
    impl_params, proto_params = list(impl.parameters.values()), list(proto.parameters.values())
    assert [(p.name, p.kind) for p in impl_params[:len(proto_params)]] == \
           [(p.name, p.kind) for p in proto_params], where
    for mine, theirs in zip(impl_params, proto_params, strict=False):
        if theirs.default is not inspect.Parameter.empty:
            assert mine.default == theirs.default, f"{where}: default of {mine.name}"
    extra = impl_params[len(proto_params):]
    assert all(p.default is not inspect.Parameter.empty or p.kind is p.VAR_KEYWORD for p in extra), where


def test_both_engines_implement_every_member(engines):
    for engine in engines:
        cls = type(engine)
        assert WorkerEngine in cls.__mro__ and isinstance(engine, WorkerEngine)  # declared, and structural
        for name in sorted(protocol_members()):
            where = f"{cls.__name__}.{name}"
            owner = _defining_class(cls, name)
            proto_member = vars(WorkerEngine).get(name)
            if proto_member is None:  # an annotated attribute: the constructor sets it
                assert name in vars(engine) or (owner is not None and owner is not WorkerEngine), where
                continue
            # Defined by the engine itself, not the protocol's empty stub inherited by subclassing.
            assert owner is not None and owner is not WorkerEngine, f"{where} is only the protocol's stub"
            impl_member = vars(owner)[name]
            if isinstance(proto_member, property):
                assert isinstance(impl_member, property), f"{where} must be a property"
                _check_signature(inspect.signature(impl_member.fget), inspect.signature(proto_member.fget),
                                 where)
            else:
                assert callable(impl_member), where
                _check_signature(inspect.signature(impl_member), inspect.signature(proto_member), where)


def test_the_members_answer_with_their_types(engines):
    # tokens computed for 3 prompt tokens: the model adds the second generated token; the echo engine
    # counts both of its answer's tokens; the embedder computes the prompt alone
    computed = {Engine: 4, EchoEngine: 5, EmbeddingEngine: 3}
    for engine in engines:
        embeds = engine.task == "embed"
        assert engine.task == ("embed" if isinstance(engine, EmbeddingEngine) else "generate")
        assert isinstance(engine.model_name, str) and engine.model_name
        assert all(isinstance(t, int) for t in engine.eos_token_ids)
        assert bool(list(engine.eos_token_ids)) is not embeds  # nothing generated: no eos
        assert "tokenizer.json" in engine.tokenizer_files()
        assert set(engine.capacity()) == {"max_model_len", "max_num_seqs", "max_num_batched_tokens",
                                          "kv_tokens"}
        assert engine.lora_adapters() == [] and engine.resident_adapters() == []
        before = engine.num_computed_tokens
        if embeds:
            engine.add_request("r", prompt_token_ids=[5, 6, 7], pooling_params={})
        else:
            engine.add_request("r", prompt_token_ids=[5, 6, 7], sampling_params={"max_tokens": 2,
                                                                                  "temperature": 0.0})
        assert engine.has_unfinished() and engine.num_unfinished() == 1
        while engine.has_unfinished():
            engine.step()
        assert engine.num_computed_tokens - before == computed[type(engine)]
        assert (engine.num_running, engine.num_waiting, engine.num_preemptions) == (0, 0, 0)
    model, echo, embedder = engines
    assert model.kv_usage == 0.0 and echo.kv_usage is None and embedder.kv_usage is None


def _engine_uses(tree: ast.AST) -> tuple[list[str], list[str]]:
    """(``getattr`` calls whose object mentions the engine, attributes read off ``self.engine``)."""
    def is_engine(node: ast.AST) -> bool:
        return (isinstance(node, ast.Attribute) and node.attr == "engine") or (
            isinstance(node, ast.Name) and node.id == "engine")

    getattrs, members = [], []
    for node in ast.walk(tree):
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "getattr"
                and node.args and any(is_engine(n) for n in ast.walk(node.args[0]))):
            getattrs.append(ast.unparse(node))
        if isinstance(node, ast.Attribute) and is_engine(node.value):
            members.append(node.attr)
    return getattrs, members


def test_the_usage_scan_sees_getattr_on_the_engine():
    code = "def f(self, engine):\n    getattr(self.engine, 'kv_usage', None)\n    engine.step()\n"
    assert _engine_uses(ast.parse(code)) == (["getattr(self.engine, 'kv_usage', None)"], ["step"])


# What an "embed" engine has besides the protocol (WorkerEngine.task's docstring; the service's
# EmbedderInfo), read only to register an embedding model.
EMBEDDER_MEMBERS = {"embedding_dim", "matryoshka"}


def test_the_daemon_drives_the_engine_through_the_protocol_only():
    allowed = protocol_members() | EMBEDDER_MEMBERS
    for path in DAEMON_MODULES:
        getattrs, members = _engine_uses(ast.parse(path.read_text()))
        assert getattrs == [], path.name
        assert members and set(members) <= allowed, (path.name, set(members) - allowed)
