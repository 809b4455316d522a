"""Security (issue 5): Redis ACL users and TLS end to end, with no secret in any output.

The TLS server is a real redis-server started with a CA and a certificate made here (the
``cryptography`` package when installed, else the ``openssl`` command); when the redis-server on
PATH has no TLS support, and only then, these tests skip.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis
from daemons import wait_for

from batchinfer.cli.context import EXIT_REDIS
from batchinfer.cli.runner import python_module
from batchinfer.client.client import Client
from batchinfer.config import Settings
from batchinfer.keys import Keys
from batchinfer.redis_conn import connect
from batchinfer.store.registry import Registry

CLI = python_module("batchinfer.cli")
PREFIX = "{sec}"
DAEMON_PW = "Dmn-pw-7f1c9e2a"  # distinctive, so that a leak anywhere is found by a plain search
PRODUCER_PW = "Prd-pw-51d0aa3b"
# docs/reliability.md's producer user (Redis 7: %R~ = read-only keys): its own namespace "svc-" of job
# ids and reply streams; it sends entries, polls its jobs, reads their results and its replies.
PRODUCER_ACL = (f"user producer on >{PRODUCER_PW} resetkeys ~{PREFIX}:requests ~{PREFIX}:reply:svc-* "
                f"%R~{PREFIX}:job:svc-* %R~{PREFIX}:results:svc-* resetchannels -@all +xadd +xread +xrange "
                "+xrevrange +xlen +hmget +hget +hgetall +del +ping +info +client|setname")


# -- a TLS redis-server with ACL users -----------------------------------------------------------------


def make_certs(folder: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 / localhost; returns (ca, cert, key) paths."""
    try:
        import cryptography  # noqa: F401
    except ImportError:
        return _certs_openssl(folder)
    return _certs_cryptography(folder)


def _certs_openssl(folder: Path) -> tuple[Path, Path, Path]:
    if shutil.which("openssl") is None:
        pytest.fail("making test certificates needs the cryptography package or the openssl command")
    ca, ca_key, cert, key = (folder / n for n in ("ca.crt", "ca.key", "server.crt", "server.key"))
    ext = folder / "server.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\nbasicConstraints=CA:FALSE\n"
                   "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
                   "subjectKeyIdentifier=hash\nauthorityKeyIdentifier=keyid\n")
    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    for args in (
        ["req", "-x509", *ec, "-keyout", ca_key, "-out", ca, "-days", "2", "-subj", "/CN=batchinfer test CA",
         "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign"],
        ["req", *ec, "-keyout", key, "-out", folder / "server.csr", "-subj", "/CN=localhost"],
        ["x509", "-req", "-in", folder / "server.csr", "-CA", ca, "-CAkey", ca_key, "-CAcreateserial",
         "-out", cert, "-days", "2", "-extfile", ext],
    ):
        subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True, timeout=60)
    return ca, cert, key


def _certs_cryptography(folder: Path) -> tuple[Path, Path, Path]:
    import datetime as dt
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = dt.datetime.now(dt.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "batchinfer test CA")])

    def builder(subject, public_key):
        return (x509.CertificateBuilder().subject_name(subject).issuer_name(ca_name).public_key(public_key)
                .serial_number(x509.random_serial_number()).not_valid_before(now - dt.timedelta(minutes=5))
                .not_valid_after(now + dt.timedelta(days=2))
                .add_extension(x509.SubjectKeyIdentifier.from_public_key(public_key), critical=False))

    usage = dict(content_commitment=False, data_encipherment=False, key_agreement=False,
                 encipher_only=False, decipher_only=False)
    ca_cert = (builder(ca_name, ca_key.public_key())
               .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
               .add_extension(x509.KeyUsage(digital_signature=False, key_encipherment=False,
                                            key_cert_sign=True, crl_sign=True, **usage), critical=True)
               .sign(ca_key, hashes.SHA256()))
    server = (builder(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")]), key.public_key())
              .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                          x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                             critical=False)
              .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
              .add_extension(x509.KeyUsage(digital_signature=True, key_encipherment=True, key_cert_sign=False,
                                           crl_sign=False, **usage), critical=True)
              .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
              .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
                             critical=False)
              .sign(ca_key, hashes.SHA256()))
    ca, cert, key_file = folder / "ca.crt", folder / "server.crt", folder / "server.key"
    ca.write_bytes(ca_cert.public_bytes(serialization.Encoding.PEM))
    cert.write_bytes(server.public_bytes(serialization.Encoding.PEM))
    key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return ca, cert, key_file


class TlsRedis:
    """redis-server on a TLS port only (``--port 0``), the default user off, two ACL users:
    ``batchinfer`` for the daemons and ``producer``, who may only send requests and read replies."""

    def __init__(self, folder: Path):
        self.dir = folder
        self.ca, cert, key = make_certs(folder)
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
        acl = folder / "users.acl"
        acl.write_text("user default off\n"
                       f"user batchinfer on >{DAEMON_PW} ~* &* +@all\n"
                       f"{PRODUCER_ACL}\n")
        self.log = folder / "redis.log"
        args = ["--port", "0", "--tls-port", str(self.port), "--bind", "127.0.0.1", "--tls-cert-file", cert,
                "--tls-key-file", key, "--tls-ca-cert-file", self.ca, "--tls-auth-clients", "no",
                "--aclfile", acl, "--dir", folder, "--save", "", "--appendonly", "no", "--logfile", self.log]
        self.proc = subprocess.Popen([shutil.which("redis-server") or "redis-server", *map(str, args)],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 15
        while True:
            try:
                self.client("batchinfer", DAEMON_PW).ping()
                return
            except redis.ConnectionError:
                if self.proc.poll() is not None:
                    self._explain_exit()
                assert time.monotonic() < deadline, f"TLS redis-server did not start:\n{self._log_text()}"
                time.sleep(0.05)

    def _log_text(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def _explain_exit(self) -> None:
        text = self._log_text()
        if re.search(r"tls", text, re.I) and re.search(r"Bad directive|without TLS|not supported", text):
            pytest.skip(f"the redis-server on PATH has no TLS support: {text.strip().splitlines()[-1]}")
        pytest.fail(f"TLS redis-server exited with {self.proc.returncode}:\n{text}")

    def url(self, user: str, password: str) -> str:
        return f"rediss://{user}:{password}@127.0.0.1:{self.port}/0"

    def client(self, user: str, password: str) -> redis.Redis:
        return connect(self.url(user, password), str(self.ca), socket_timeout=10)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture(scope="module")
def tls(tmp_path_factory):
    server = TlsRedis(tmp_path_factory.mktemp("tls"))
    yield server
    server.stop()


def test_tls_only_and_acl_users(tls):
    """Plain text is refused (no port), the CA is required, the default user is off, and a producer
    may only send requests and read its replies."""
    assert tls.client("batchinfer", DAEMON_PW).acl_whoami() == "batchinfer"

    def once(url: str, **kw) -> redis.Redis:  # no retries: these must fail at once
        return redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5, **kw)

    with pytest.raises(redis.ConnectionError, match="certificate verify failed"):
        once(tls.url("batchinfer", DAEMON_PW)).ping()  # the system's CAs do not know ours
    with pytest.raises(redis.AuthenticationError):
        once(tls.url("batchinfer", "wrong"), ssl_ca_certs=str(tls.ca)).ping()
    with pytest.raises(redis.AuthenticationError):  # the default user is off
        once(f"rediss://127.0.0.1:{tls.port}/0", ssl_ca_certs=str(tls.ca)).ping()
    with pytest.raises(redis.ConnectionError):  # no plain-text port
        once(f"redis://batchinfer:{DAEMON_PW}@127.0.0.1:{tls.port}/0").ping()
    producer, keys = tls.client("producer", PRODUCER_PW), Keys(PREFIX)
    assert producer.xadd(keys.requests, {"v": "1", "body": "{}"})
    _assert_producer_limits(producer, keys)


def _assert_producer_limits(producer: redis.Redis, keys: Keys, job: str = "svc-j") -> None:
    """What the producer user must not do: write job records (its own too), results (forged rows),
    batch streams; read other producers' jobs and results, ``results:direct``; FLUSHALL, CONFIG."""
    for forbidden in (lambda: producer.hset(keys.job(job), "status", "completed"),
                      lambda: producer.hset(keys.job("j"), "status", "completed"),
                      lambda: producer.delete(keys.job(job)),
                      lambda: producer.xadd(keys.results(job), {"row": "{}"}),
                      lambda: producer.xadd(keys.batches("m"), {"v": "1", "requests": "[]"}),
                      lambda: producer.hmget(keys.job("other"), "status"),
                      lambda: producer.xrange(keys.results("other")),
                      lambda: producer.xrange(keys.results("direct")), lambda: producer.flushall(),
                      lambda: producer.config_get("*")):
        with pytest.raises(redis.exceptions.NoPermissionError):
            forbidden()


class Daemons:
    """``batchinfer`` daemons started as subprocesses, each logging to its own file."""

    def __init__(self, folder: Path, env: dict[str, str]):
        self.dir, self.env = folder, env
        self.procs: dict[str, subprocess.Popen] = {}

    def start(self, name: str, *args: str) -> None:
        with open(self.dir / f"{name}.log", "wb") as log:
            self.procs[name] = subprocess.Popen([*CLI, *args], env=self.env, stdout=log,
                                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            assert proc.poll() is None, f"{name} exited with {proc.returncode}:\n{self.logs()}"

    def stop(self) -> dict[str, int]:
        codes = {}
        for name, proc in self.procs.items():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
            try:
                codes[name] = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                codes[name] = proc.wait(timeout=10)
        return codes

    def logs(self) -> str:
        files = sorted(self.dir.glob("*.log"))
        return "\n".join(f"----- {p.name}\n{p.read_text(errors='replace')}" for p in files)


def _cli(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], env=env, capture_output=True, text=True, timeout=timeout)


@pytest.mark.slow
def test_tls_acl_end_to_end_with_limits_and_no_secret_in_any_output(tls, tmp_path):
    """Scheduler, echo worker and exporter on rediss:// as an ACL user; jobs submitted and read
    back through the CLI; a producer with its own ACL user gets its reply. Afterwards no log line,
    no CLI output and no status shows a password; the scheduler's limit flags answered their lines."""
    url, ca = tls.url("batchinfer", DAEMON_PW), str(tls.ca)
    env = {**os.environ, "BATCHINFER_REDIS_URL": url, "BATCHINFER_REDIS_CA_FILE": ca,
           "BATCHINFER_PREFIX": PREFIX,
           "BATCHINFER_RESULTS_ROOT": str(tmp_path / "results"), "BATCHINFER_LOG_LEVEL": "DEBUG",
           "BATCHINFER_HEARTBEAT_SECONDS": "0.5", "PYTHONUNBUFFERED": "1"}
    daemons = Daemons(tmp_path, env)
    # the scheduler gets its URL and CA on argv (flags), the others from the environment
    daemons.start("scheduler", "--redis-url", url, "--redis-ca-file", ca, "scheduler",
                  "--max-prompt-tokens", "40", "--max-tokens-limit", "8", "--max-line-bytes", "2000")
    daemons.start("worker", "--log-format", "json", "worker", "--echo", "--name", "sec-w1")
    daemons.start("exporter", "exporter")
    outputs: list[str] = []
    try:
        r = tls.client("batchinfer", DAEMON_PW)
        wait_for(lambda: Registry(r, Keys(PREFIX)).live_workers("echo"), "the worker",
                 alive=daemons.check_alive)
        lines = [{"custom_id": "ok-1", "prompt": "hello", "max_tokens": 4},
                 {"custom_id": "long", "prompt": "p" * 60, "max_tokens": 2},  # 60 > --max-prompt-tokens 40
                 {"custom_id": "many", "prompt": "x", "max_tokens": 9},  # > --max-tokens-limit 8
                 {"custom_id": "wide", "prompt": "w" * 2100},  # > the scheduler's --max-line-bytes 2000
                 {"custom_id": "ok-5", "prompt": "world", "max_tokens": 4}]
        f = tmp_path / "in.jsonl"
        f.write_text("".join(json.dumps(x) + "\n" for x in lines))
        plain = {k: v for k, v in env.items() if not k.startswith("BATCHINFER_REDIS_")}  # flags only
        sub = _cli(plain, "--redis-url", url, "--redis-ca-file", ca, "submit", str(f), "--model", "echo",
                   "--wait", "--json", "--max-line-bytes", "3000", "--max-requests", "10")
        outputs += [sub.stdout, sub.stderr]
        assert sub.returncode == 0, f"{sub.stdout}\n{sub.stderr}\n{daemons.logs()}"
        record = json.loads(sub.stdout.strip().splitlines()[-1])
        assert record["status"] == "completed" and Path(record["output"]).is_file()
        rows = {row["custom_id"]: row for row in Client(settings=Settings(
            redis_url=url, redis_ca_file=ca, prefix=PREFIX)).result_rows(record["id"])}
        assert {k: v["error_code"] for k, v in rows.items()} == {
            "ok-1": None, "long": "prompt_too_long", "many": "invalid_request", "wide": "line_too_long",
            "ok-5": None}
        assert "limit of 40" in rows["long"]["error_message"] and "<= 8" in rows["many"]["error_message"]
        assert "limit of 2000" in rows["wide"]["error_message"]
        job = record["id"]
        copy = str(tmp_path / "r.jsonl")
        for args in (("status", job), ("status", job, "--json"), ("jobs",), ("jobs", "--json"),
                     ("workers", "--json"), ("results", job, "-o", copy, "--format", "jsonl")):
            out = _cli(env, *args)
            assert out.returncode == 0, (args, out.stderr)
            outputs += [out.stdout, out.stderr]
        # a service with the producer's rights only: one XADD, one XREAD
        producer, keys = tls.client("producer", PRODUCER_PW), Keys(PREFIX)
        reply = keys.reply("svc-1")
        body = json.dumps({"model": "echo", "prompt": "hi", "max_tokens": 2})
        producer.xadd(keys.requests, {"v": "1", "body": body, "reply_to": reply})
        got = producer.xread({reply: "0"}, block=60_000)
        assert json.loads(got[0][1][0][1][b"row"])["status"] == "completed"
        producer.delete(reply)
        # wrong password / no CA: a clear error naming the server, the password replaced by ***
        wrong = _cli(plain, "--redis-url", tls.url("batchinfer", "Wr0ng-pw-c4f1"), "--redis-ca-file", ca,
                     "status", job)
        no_ca = _cli(plain, "--redis-url", url, "status", job)
        for out in (wrong, no_ca):
            assert out.returncode == EXIT_REDIS, out.stderr
            assert f"cannot reach Redis at rediss://batchinfer:***@127.0.0.1:{tls.port}/0" in out.stderr
            outputs += [out.stdout, out.stderr]
        assert "Wr0ng-pw-c4f1" not in wrong.stderr and "certificate verify failed" in no_ca.stderr
    finally:
        codes = daemons.stop()
    logs = daemons.logs()
    assert codes == {"scheduler": 0, "worker": 0, "exporter": 0}, logs
    everything = "\n".join([logs, *outputs])
    for secret in (DAEMON_PW, PRODUCER_PW):
        assert secret not in everything, f"a password leaked:\n{everything}"
    assert "batchinfer:***@" in everything  # the URL is shown, redacted (exporter start, CLI errors)


@pytest.mark.slow
def test_the_documented_producer_user_runs_a_job_end_to_end(tls, tmp_path):
    """docs/reliability.md's ``producer`` ACL user, with a scheduler, an echo worker and the exporter
    running as the daemons' user: the INFO of a client's ready check, ``op open`` / entries /
    ``op close`` (acknowledged on its reply stream), polling the job hash to ``completed``, reading
    the job's results; and still none of what ``_assert_producer_limits`` forbids."""
    env = {**os.environ, "BATCHINFER_REDIS_URL": tls.url("batchinfer", DAEMON_PW),
           "BATCHINFER_REDIS_CA_FILE": str(tls.ca), "BATCHINFER_PREFIX": PREFIX,
           "BATCHINFER_RESULTS_ROOT": str(tmp_path / "results"), "BATCHINFER_HEARTBEAT_SECONDS": "0.5",
           "PYTHONUNBUFFERED": "1"}
    daemons = Daemons(tmp_path, env)
    for name, args in (("scheduler", ()), ("worker", ("--echo", "--name", "acl-w1")), ("exporter", ())):
        daemons.start(name, name, *args)
    try:
        wait_for(lambda: Registry(tls.client("batchinfer", DAEMON_PW), Keys(PREFIX)).live_workers("echo"),
                 "the worker", alive=daemons.check_alive)
        producer, keys = tls.client("producer", PRODUCER_PW), Keys(PREFIX)
        assert "redis_version" in producer.info()  # ioredis's ready check
        job, reply = "svc-job-1", keys.reply("svc-ops")
        producer.xadd(keys.requests, {"v": "1", "op": "open", "job": job, "model": "echo", "reply_to": reply})
        for i in range(2):
            body = json.dumps({"custom_id": f"c{i}", "prompt": f"hello {i}", "max_tokens": 3})
            producer.xadd(keys.requests, {"v": "1", "job": job, "idx": str(i), "body": body})
        producer.xadd(keys.requests, {"v": "1", "op": "close", "job": job, "total": "2", "reply_to": reply})
        wait_for(lambda: producer.hmget(keys.job(job), "status")[0] == b"completed", "the job completed",
                 alive=daemons.check_alive)
        status, total, completed = producer.hmget(keys.job(job), "status", "total", "completed")
        assert (total, completed) == (b"2", b"2")
        assert producer.xlen(keys.results(job)) == 2
        rows = [json.loads(f[b"row"]) for _, f in producer.xrange(keys.results(job))]
        assert sorted((row["custom_id"], row["status"]) for row in rows) == [("c0", "completed"),
                                                                             ("c1", "completed")]
        [(_, acks)] = producer.xread({reply: "0"}, block=10_000)
        assert [json.loads(f[b"row"])["op"] for _, f in acks] == ["open", "close"]
        assert producer.delete(reply) == 1
        _assert_producer_limits(producer, keys, job)
    finally:
        codes = daemons.stop()
    assert codes == {"scheduler": 0, "worker": 0, "exporter": 0}, daemons.logs()
