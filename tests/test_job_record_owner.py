"""The job record has one owner: batchinfer/store/jobstore.py names its fields and statuses, and
every Lua script is a file in batchinfer/store/lua/ loaded by batchinfer/store/scripts.py."""

from __future__ import annotations

import ast
import re
from dataclasses import fields
from pathlib import Path

from batchinfer.keys import Keys
from batchinfer.store import scripts
from batchinfer.store.jobstore import (
    JobField,
    JobRecord,
    JobStatus,
    JobStore,
    parse_fields,
    parse_status,
    read_status,
)

ROOT = Path(__file__).resolve().parents[1]
SOURCES = [ROOT / "batchinfer", ROOT / "workers", ROOT / "jobs"]
OWNER = ROOT / "batchinfer" / "store" / "jobstore.py"
LUA = ROOT / "batchinfer" / "store" / "lua"

STATUSES = {s.value for s in JobStatus}
# Result rows share completed / failed / cancelled / expired as *row* statuses (protocol/rows.py),
# so only the job-only names are unambiguous as plain str literals.
JOB_ONLY = {"validating", "in_progress", "finalizing", "cancelling"}
HASH_COMMANDS = {"hget", "hmget", "hset", "hsetnx", "hincrby", "hincrbyfloat", "hdel", "hexists"}


def _modules() -> list[tuple[str, ast.AST]]:
    out = []
    for folder in SOURCES:
        for path in sorted(folder.rglob("*.py")):
            if path != OWNER:
                tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
                out.append((str(path.relative_to(ROOT)), tree))
    return out


def raw_job_literals(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, literal) of job statuses / field names spelled out instead of taken from jobstore."""
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant):
            if isinstance(node.value, bytes) and node.value.decode(errors="replace") in STATUSES:
                found.append((node.lineno, repr(node.value)))  # a raw HGET reply compared as bytes
            elif isinstance(node.value, str) and node.value in JOB_ONLY:
                found.append((node.lineno, repr(node.value)))
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
              and node.func.attr in HASH_COMMANDS):
            fields_named = {f.value for f in JobField}
            for arg in node.args[1:]:
                if isinstance(arg, ast.Constant) and arg.value in fields_named:
                    found.append((arg.lineno, f"{node.func.attr}(..., {arg.value!r})"))
    return found


def test_the_scan_sees_what_it_must_and_nothing_else():
    bad = ast.parse('if st in (b"validating", b"expired"): r.hget(k, "status"); x = "in_progress"\n'
                    'pipe.hincrby(job_key, "submitted", 1)\n')
    assert sorted(raw_job_literals(bad)) == [
        (1, "'in_progress'"), (1, "b'expired'"), (1, "b'validating'"), (1, "hget(..., 'status')"),
        (2, "hincrby(..., 'submitted')")]
    fine = ast.parse('row.status == "completed"; ResultRow.error(c, m, status="expired")\n'
                     'r.hget(keys.model(m), "fingerprint"); r.hset(k, field, 1); d = {"status": s}\n')
    assert raw_job_literals(fine) == []


def test_no_raw_job_status_or_field_literals_outside_jobstore():
    offenders = [f"{name}:{line}: {lit}" for name, tree in _modules() for line, lit in raw_job_literals(tree)]
    assert offenders == []


def _calls(tree: ast.AST, attr: str) -> list[ast.Call]:
    return [n for n in ast.walk(tree)
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == attr]


def test_no_inline_lua_and_no_plain_eval():
    offenders = []
    for name, tree in _modules():
        for node in ast.walk(tree):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and "redis.call(" in node.value:
                offenders.append(f"{name}:{node.lineno}: inline Lua")
        # `model.eval()` (torch) takes no arguments; Redis EVAL always does
        offenders += [f"{name}:{c.lineno}: eval(...)" for c in _calls(tree, "eval") if c.args or c.keywords]
        offenders += [f"{name}:{c.lineno}: register_script" for c in _calls(tree, "register_script")
                      if not name.endswith("store/scripts.py")]
        offenders += [f"{name}:{c.lineno}: execute_command(EVAL)" for c in _calls(tree, "execute_command")
                      if c.args and isinstance(c.args[0], ast.Constant)
                      and str(c.args[0].value).upper().startswith("EVAL")]
    assert offenders == []


def test_every_lua_file_is_registered_by_name_and_every_name_has_its_file():
    registered = set()
    for _, tree in [*_modules(), ("jobstore", ast.parse(OWNER.read_text(encoding="utf-8")))]:
        for call in _calls(tree, "register"):
            if (isinstance(call.func.value, ast.Name) and call.func.value.id == "scripts"
                    and len(call.args) == 2 and isinstance(call.args[1], ast.Constant)):
                registered.add(call.args[1].value)
    files = {p.stem for p in LUA.glob("*.lua")} - set(scripts.PRELUDES)  # libraries, not scripts
    assert registered == files


def test_jobfield_names_every_record_field_and_every_status_time():
    names = {f.value for f in JobField}
    assert {f.name for f in fields(JobRecord)} <= names
    assert {s.timestamp_field.value for s in JobStatus} <= names
    assert JobStatus.EXPIRED.timestamp_field is JobField.EXPIRED_AT


def test_protocol_doc_lists_every_job_field_and_names_the_owner():
    text = (ROOT / "docs" / "protocol.md").read_text(encoding="utf-8")
    section = text.split("## Job record", 1)[1].split("\n## ", 1)[0]
    named = set(re.findall(r"`([a-z_]+)`", section))
    assert {f.value for f in JobField} - named == set()
    assert {s.value for s in JobStatus} - named == set()
    assert "batchinfer/store/jobstore.py" in section


def test_parse_helpers_on_a_real_record(redis_server):
    r = redis_server.client()
    keys = Keys("{own}")
    store = JobStore(r, keys)
    store.create("j1", model="m", priority=3)
    assert read_status(r, keys, "j1") is JobStatus.VALIDATING and read_status(r, keys, "nope") is None
    store.set_status("j1", JobStatus.IN_PROGRESS)
    names = (JobField.STATUS, JobField.MODEL, JobField.PRIORITY, JobField.TOTAL, JobField.IN_PROGRESS_AT)
    parsed = parse_fields(names, r.hmget(keys.job("j1"), *names))
    assert parsed[JobField.STATUS] is JobStatus.IN_PROGRESS
    assert parsed[JobField.MODEL] == "m" and parsed[JobField.PRIORITY] == 3 and parsed[JobField.TOTAL] is None
    assert isinstance(parsed[JobField.IN_PROGRESS_AT], int) and parsed[JobField.IN_PROGRESS_AT] > 0
    # a status some other producer wrote is not a crash for the daemons that read it
    r.hset(keys.job("j1"), JobField.STATUS, "queued")
    assert parse_status(r.hget(keys.job("j1"), JobField.STATUS)) is None
    assert parse_status(b"cancelling") is JobStatus.CANCELLING
