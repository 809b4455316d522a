"""The HTTP API's commands: ``batchinfer api`` (the server, a daemon like the others: its process is
batchinfer/api/server.py), ``batchinfer serve`` (all in one, for a laptop) and ``batchinfer api-keys
create|list|revoke``; :mod:`batchinfer.cli.main` adds them to the group.

``serve`` starts what ``batchinfer run`` starts (Redis, scheduler, worker(s), exporter; the code is
runner.py's) and ``api`` as one more daemon, prints the base URL and an SDK snippet once the API
answers, and stops everything on Ctrl-C / SIGTERM, or when a daemon dies (with its log's tail).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as dt
import json
import signal
import time
import urllib.error
import urllib.request
from typing import Any

import click

from batchinfer.cli.context import (
    EXIT_DAEMON,
    EXIT_NOT_FOUND,
    EXIT_STARTUP,
    Ctx,
    fail,
    global_options,
    handle_errors,
    json_option,
)
from batchinfer.cli.daemons import PORT, POSITIVE, override_settings, run_daemon
from batchinfer.config import Settings

SERVE_KEY_NAME = "serve"  # the key `serve --auth keys` makes on its embedded Redis
API_READY_TIMEOUT_S = 60.0
POLL_S = 0.5


@click.command()
@global_options
@click.option("--host", default="127.0.0.1", show_default=True,
              help="Address to listen on; 0.0.0.0 for every interface (use keys, and TLS or a proxy).")
@click.option("--port", type=PORT, default=8000, show_default=True)
@click.option("--auth", type=click.Choice(["keys", "none"]),
              help="keys: every request needs an API key (`api-keys create`); none: every caller is the "
                   "anonymous key [keys, BATCHINFER_API_AUTH].")
@click.option("--ssl-keyfile", type=click.Path(exists=True, dir_okay=False),
              help="TLS: the private key (PEM).")
@click.option("--ssl-certfile", type=click.Path(exists=True, dir_okay=False),
              help="TLS: the certificate chain (PEM).")
@click.option("--workers", type=POSITIVE, default=1, show_default=True,
              help="Server processes sharing the port (each its own /metrics).")
@click.pass_obj
def api(ctx: Ctx, host: str, port: int, auth: str | None, ssl_keyfile: str | None, ssl_certfile: str | None,
        workers: int) -> None:
    """Run the HTTP API: OpenAI Files and Batches, Anthropic Message Batches, synchronous endpoints
    (docs/api.md). Stateless: run as many replicas as needed behind a load balancer."""
    if bool(ssl_keyfile) != bool(ssl_certfile):
        raise click.UsageError("TLS needs both --ssl-keyfile and --ssl-certfile")
    from batchinfer.api.server import main

    override_settings(ctx.settings, api_auth=auth)
    run_daemon(main, ctx.settings, host=host, port=port, workers=workers, ssl_keyfile=ssl_keyfile,
               ssl_certfile=ssl_certfile)


# -- serve -----------------------------------------------------------------------------------------


class _Stopped(Exception):
    """SIGTERM reached ``serve``: stop as on Ctrl-C."""


def _raise_stopped(signum: int, frame: object) -> None:
    raise _Stopped()


@click.command()
@global_options
@click.option("--model", default="demo", show_default=True,
              help="Model folder, .gguf file, or demo, tiny, minilm (as `run`).")
@click.option("--served-model-name", "served_model_names", multiple=True, metavar="NAME",
              help="Name(s) the model is served under, repeatable [the model's name, as `run`].")
@click.option("--host", default="127.0.0.1", show_default=True, help="The API's address.")
@click.option("--port", type=PORT, default=8000, show_default=True, help="The API's port.")
@click.option("--device", help="[cuda:0 when available, else cpu]")
@click.option("--workers", "num_workers", type=POSITIVE, default=1, show_default=True,
              help="Worker processes (engines).")
@click.option("--auth", type=click.Choice(["none", "keys"]),
              help="[none on a loopback --host, else keys; with keys and the embedded Redis, a key is made "
                   "and printed]")
@click.option("--echo", is_flag=True, help="Echo engine instead of the model (no generation).")
@click.option("--logs", "log_dir", type=click.Path(file_okay=False), help="Keep the daemons' logs here.")
@click.pass_obj
@handle_errors
def serve(ctx: Ctx, model: str, served_model_names: tuple[str, ...], host: str, port: int, device: str | None,
          num_workers: int, auth: str | None, echo: bool, log_dir: str | None) -> None:
    """All in one, for a laptop: Redis, scheduler, worker(s), exporter and the API; Ctrl-C stops
    everything.

    Redis is an embedded redis-server unless --redis-url is given on this command line (as `run`)."""
    from batchinfer.api.server import is_loopback, listen
    from batchinfer.cli import runner
    from batchinfer.cli.daemons import default_device
    from batchinfer.ops.startup import StartupError

    auth = auth or ("none" if is_loopback(host) else "keys")
    try:
        listen(host, port).close()  # the port is free: say so now, not in a daemon's log
    except StartupError as e:
        fail(EXIT_STARTUP, str(e))
    model_path, default_name = runner.resolve_model(model)  # a usage error before anything starts
    served = list(dict.fromkeys(served_model_names)) or [default_name]
    say = (lambda msg: None) if ctx.quiet else (lambda msg: click.echo(msg, err=True))
    previous_sigterm = signal.signal(signal.SIGTERM, _raise_stopped)
    with contextlib.ExitStack() as stack:  # closed in reverse: daemons, logs, Redis, SIGTERM
        stack.callback(signal.signal, signal.SIGTERM, previous_sigterm)
        daemons: runner.Daemons | None = None
        try:
            given_url = ctx.given.get("redis_url")
            redis_url = runner.start_redis(stack, ctx.settings, given_url, say)
            logs = runner.LogFolder.open(stack, log_dir)
            daemons = runner.Daemons(logs.path, runner.daemon_env(ctx.settings, redis_url))
            stack.callback(daemons.stop)
            runner.start_daemons(daemons, model_path, served, num_workers=num_workers,
                                 device=device or default_device(), echo=echo)
            daemons.start("api", "api", "--host", host, "--port", str(port), "--auth", auth)
            say(f"started scheduler, {num_workers} worker(s) ({served[0]}), exporter, api; "
                f"logs in {logs.path}")
            secret = _serve_key(ctx.settings) if auth == "keys" and not given_url else None
            base = f"http://{_reachable(host)}:{port}"
            _until_ready(f"{base}/readyz", daemons)
            click.echo(_banner(base, served[0], auth, secret))
            _watch(ctx.settings, daemons, served[0], say)
        except runner.DaemonExited as e:  # raised only once the daemons (and their logs) exist
            assert daemons is not None
            logs.keep = True
            click.echo(f"error: {e}\n{daemons.tails()}\nlogs kept in {logs.path}", err=True)
            raise SystemExit(EXIT_DAEMON) from None
        except (KeyboardInterrupt, _Stopped):
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the stop short
            stack.callback(signal.signal, signal.SIGINT, signal.default_int_handler)
            say("stopping...")
            if daemons is not None:
                daemons.stop(runner.INTERRUPT_GRACE_S)
            say("stopped")


def _reachable(host: str) -> str:
    """An address of ``host`` a local client can connect to (a wildcard address is not one)."""
    if host in ("0.0.0.0", ""):
        return "127.0.0.1"
    if host == "::":
        return "[::1]"
    return f"[{host}]" if ":" in host else host


def _serve_key(settings: Settings) -> str:
    """A fresh key on serve's own (embedded) Redis: its secret, printed in the banner."""
    from batchinfer.store.apikeys import ApiKeys

    r = settings.connect()
    try:
        secret, _ = ApiKeys(r, settings.keys()).create(SERVE_KEY_NAME)
    finally:
        r.close()
    return secret


def _until_ready(url: str, daemons: Any) -> None:
    """Until the API's ``/readyz`` answers 200 (a daemon dying meanwhile raises DaemonExited)."""
    deadline = time.monotonic() + API_READY_TIMEOUT_S
    while True:
        daemons.check()
        with contextlib.suppress(urllib.error.URLError, OSError), \
                urllib.request.urlopen(url, timeout=2) as reply:  # noqa: S310 (our own http URL)
            if reply.status == 200:
                return
        if time.monotonic() > deadline:
            from batchinfer.cli.runner import DaemonExited

            raise DaemonExited(f"the API did not answer {url} within {API_READY_TIMEOUT_S:g} s")
        time.sleep(POLL_S / 5)


def _banner(base: str, model: str, auth: str, secret: str | None) -> str:
    key = secret or ("none" if auth == "none" else "<a key from `batchinfer api-keys create NAME`>")
    lines = [f"batchinfer API on {base}/v1  (model {model!r}; Ctrl-C stops everything)"]
    if secret:
        lines.append(f"API key (shown once): {secret}")
    lines += ["", "  from openai import OpenAI",
              f'  client = OpenAI(base_url="{base}/v1", api_key="{key}")',
              f'  reply = client.chat.completions.create(model="{model}", '
              'messages=[{"role": "user", "content": "Hello!"}])',
              "  print(reply.choices[0].message.content)", ""]
    return "\n".join(lines)


def _watch(settings: Settings, daemons: Any, model: str, say: Any) -> None:
    """Until Ctrl-C / SIGTERM (raised) or a daemon dies (DaemonExited); says once when a worker
    serves ``model`` (requests sent before wait for it)."""
    from batchinfer.store.registry import Registry

    r = settings.connect(socket_timeout=5)
    registry = Registry(r, settings.keys())
    serving = False
    try:
        while True:
            daemons.check()
            if not serving:
                with contextlib.suppress(Exception):  # a slow Redis only delays the note
                    serving = bool(registry.live_workers(model))
                    if serving:
                        say(f"model {model!r} loaded: a worker serves it")
            time.sleep(POLL_S)
    finally:
        r.close()


# -- api-keys --------------------------------------------------------------------------------------


@click.group("api-keys")
def api_keys() -> None:
    """Create, list and revoke the HTTP API's keys (stored hashed in Redis)."""


def _store(ctx: Ctx) -> Any:
    from batchinfer.store.apikeys import ApiKeys

    return ApiKeys(ctx.settings.connect(), ctx.settings.keys())


def _key_dict(key: Any) -> dict[str, Any]:
    return dataclasses.asdict(key)


def _when(ms: int | None) -> str:
    if ms is None:
        return "-"
    return dt.datetime.fromtimestamp(ms / 1000, dt.timezone.utc).strftime("%Y-%m-%d %H:%M:%SZ")


@api_keys.command("create")
@global_options
@click.argument("name")
@click.option("--max-file-bytes", type=POSITIVE,
              help="Largest file it may upload [BATCHINFER_API_MAX_FILE_BYTES].")
@click.option("--max-files", type=POSITIVE,
              help="Files it may keep stored [BATCHINFER_API_MAX_FILES_PER_KEY].")
@click.option("--max-queued-requests", type=POSITIVE,
              help="Requests of its unfinished batches [BATCHINFER_API_MAX_QUEUED_REQUESTS_PER_KEY].")
@json_option
@click.pass_obj
@handle_errors
def create_key(ctx: Ctx, name: str, max_file_bytes: int | None, max_files: int | None,
               max_queued_requests: int | None, json_flag: bool) -> None:
    """Create the key NAME; its secret is printed once (stdout), never stored."""
    secret, key = _store(ctx).create(name, max_file_bytes=max_file_bytes, max_files=max_files,
                                     max_queued_requests=max_queued_requests)
    if ctx.json or json_flag:
        click.echo(json.dumps({**_key_dict(key), "secret": secret}))
        return
    click.echo(secret)
    if not ctx.quiet:
        click.echo(f"created API key {key.name!r} ({key.id}); the secret above is shown only this once",
                   err=True)


@api_keys.command("list")
@global_options
@json_option
@click.pass_obj
@handle_errors
def list_keys(ctx: Ctx, json_flag: bool) -> None:
    """List the keys, revoked ones too (never a secret)."""
    keys = _store(ctx).list()
    if ctx.json or json_flag:
        click.echo(json.dumps([_key_dict(k) for k in keys]))
        return
    rows = [("ID", "NAME", "CREATED", "REVOKED", "MAX FILE BYTES", "MAX FILES", "MAX QUEUED")]
    rows += [(k.id, k.name, _when(k.created_at), _when(k.revoked_at), *(str(v) if v is not None else "default"
              for v in (k.max_file_bytes, k.max_files, k.max_queued_requests))) for k in keys]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    for row in rows:
        click.echo("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


@api_keys.command("revoke")
@global_options
@click.argument("name_or_id")
@json_option
@click.pass_obj
@handle_errors
def revoke_key(ctx: Ctx, name_or_id: str, json_flag: bool) -> None:
    """Revoke a key (by name or id): effective at once, on every API replica."""
    _change_key(ctx, json_flag, name_or_id, lambda store: store.revoke(name_or_id),
                lambda key: f"revoked API key {key.name!r} ({key.id})")


def _change_key(ctx: Ctx, json_flag: bool, name_or_id: str, change: Any, said: Any) -> None:
    """Apply ``change(store)`` to a key and print the key (``--json``) or ``said(key)``; an unknown
    key exits 4."""
    try:
        key = change(_store(ctx))
    except KeyError:
        fail(EXIT_NOT_FOUND, f"no API key named {name_or_id!r} or with that id "
                             "(see `batchinfer api-keys list`)")
        return
    click.echo(json.dumps(_key_dict(key)) if ctx.json or json_flag else said(key))


@api_keys.command("set-limits")
@global_options
@click.argument("name_or_id")
@click.option("--max-file-bytes", help="Largest file it may upload; 'default' for the setting's.")
@click.option("--max-files", help="Files it may keep stored; 'default' for the setting's.")
@click.option("--max-queued-requests",
              help="Requests of its unfinished batches; 'default' for the setting's.")
@json_option
@click.pass_obj
@handle_errors
def set_key_limits(ctx: Ctx, name_or_id: str, max_file_bytes: str | None, max_files: str | None,
                   max_queued_requests: str | None, json_flag: bool) -> None:
    """Change a key's limits (by name or id); the limits not given stay as they are. Effective at
    once: every replica reads them on each request."""
    given = {"max_file_bytes": max_file_bytes, "max_files": max_files,
             "max_queued_requests": max_queued_requests}
    limits = {name: _limit(name, text) for name, text in given.items() if text is not None}
    if not limits:
        raise click.UsageError("give at least one of --max-file-bytes, --max-files, --max-queued-requests")
    _change_key(ctx, json_flag, name_or_id, lambda store: store.set_limits(name_or_id, **limits),
                lambda key: f"API key {key.name!r} ({key.id}): " + ", ".join(
                    f"{name} {'default' if value is None else value}" for name, value in limits.items()))


def _limit(name: str, text: str) -> int | None:
    """A limit option's value: a positive integer, or ``default`` (None: the setting's)."""
    if text.strip().lower() == "default":
        return None
    if not text.strip().isdigit() or int(text) < 1:
        raise click.BadParameter(f"must be a positive integer or 'default', got {text!r}",
                                 param_hint="--" + name.replace("_", "-"))
    return int(text)


COMMANDS = (api, serve, api_keys)
