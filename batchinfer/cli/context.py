"""What every ``batchinfer`` command shares: :class:`Ctx`, the global options (accepted before and
after the command's name), the exit codes (docs/cli.md), the error mapping and ``--json`` output.
The group (:mod:`batchinfer.cli.main`), the daemon commands and the runner all import it, and it
imports none of them, so the CLI has no import circle.
"""

from __future__ import annotations

import functools
import json
import sys
from collections.abc import Callable
from typing import Any

import click

from batchinfer.config import Settings

# Exit codes (docs/cli.md).
EXIT_OK = 0
EXIT_ERROR = 1  # unexpected failure
EXIT_USAGE = 2  # bad option or argument (click's own code too)
EXIT_REDIS = 3  # Redis unreachable
EXIT_NOT_FOUND = 4  # no such job
EXIT_JOB_FAILED = 5  # the job ended failed, expired or cancelled
EXIT_TIMEOUT = 6  # --timeout passed before the job ended
EXIT_INPUT = 7  # the input file cannot be read
EXIT_DAEMON = 8  # `run`: a daemon it started exited early
EXIT_STARTUP = 9  # a daemon cannot start: missing model files, unusable device, duplicate name
EXIT_INTERRUPTED = 130  # Ctrl-C

# The global options: the group takes them before the command's name, every command after it too.
_STRING_OPTIONS = ("redis_url", "redis_ca_file", "prefix", "log_format", "log_level")
GLOBAL_NAMES = (*_STRING_OPTIONS, "json_output", "quiet")


def global_option_decorators(with_json: bool = True) -> list[Callable[[Any], Any]]:
    """The click options of the global flags (docs/cli.md), in order; ``--json`` left out when a
    command has its own (``json_option``)."""
    options = [
        click.option("--redis-url", help="redis://, rediss://, unix:// or redis+sentinel:// URL (any node "
                     "of a Redis Cluster: BATCHINFER_REDIS_CLUSTER) [BATCHINFER_REDIS_URL; `run`: "
                     "only this flag, else an embedded Redis]; prefer the variable for URLs with a "
                     "password (argv shows in `ps`)."),
        click.option("--redis-ca-file", type=click.Path(exists=True, dir_okay=False),
                     help="CA bundle that signed the server's certificate (rediss://) "
                          "[BATCHINFER_REDIS_CA_FILE]."),
        click.option("--prefix", help="Key prefix with its hash tag [BATCHINFER_PREFIX, default {bi}]."),
        click.option("--json", "json_output", is_flag=True, help="Machine-readable output on stdout."),
        click.option("--quiet", "-q", is_flag=True, help="No progress bars or chatter."),
        click.option("--log-format", type=click.Choice(["human", "json"]), help="Log lines on stderr."),
        click.option("--log-level", help="DEBUG, INFO, WARNING, ERROR [default INFO]."),
    ]
    return options if with_json else [o for i, o in enumerate(options) if i != 3]


class Ctx:
    """What the group hands to every command: the settings and the global flags as given."""

    def __init__(self, settings: Settings, json_output: bool, quiet: bool,
                 given: dict[str, Any] | None = None):
        self.settings = settings
        self.json = json_output
        self.quiet = quiet
        self.given = dict(given or {})  # the global options as typed, to merge a command's over

    @classmethod
    def create(cls, **given: Any) -> Ctx:
        """Settings from the environment and ``given`` (the global options), logging set up."""
        from batchinfer.ops.logs import setup_logging

        strings = {k: given.get(k) for k in _STRING_OPTIONS}
        quiet = bool(given.get("quiet"))
        try:
            settings = Settings.from_env(**strings)
            if quiet and not strings["log_level"]:  # -q: warnings only, in the daemons `run` starts too
                settings.log_level = "WARNING"
            setup_logging(settings.log_format, settings.log_level)
        except ValueError as e:
            raise click.UsageError(str(e)) from None
        return cls(settings, bool(given.get("json_output")), quiet, given)

    def merge(self, given: dict[str, Any]) -> None:
        """Apply the global options given after the command's name over the group's (they win)."""
        merged = {k: given.get(k) if given.get(k) is not None else self.given.get(k) for k in _STRING_OPTIONS}
        merged["json_output"] = bool(self.given.get("json_output") or given.get("json_output"))
        merged["quiet"] = bool(self.given.get("quiet") or given.get("quiet"))
        fresh = Ctx.create(**merged)
        self.settings, self.json, self.quiet = fresh.settings, fresh.json, fresh.quiet
        self.given = fresh.given

    def client(self):
        from batchinfer.client.client import Client

        return Client(settings=self.settings)


def fail(code: int, message: str) -> None:
    """One line on stderr, then exit with ``code``."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


def handle_errors(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Map the errors a person can act on to one line on stderr and a documented exit code."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        import redis

        from batchinfer.client.client import JobNotFound
        from batchinfer.datasets.errors import InputError  # no pyarrow: every command maps it
        from batchinfer.redis_conn import describe

        try:
            return fn(*args, **kwargs)
        except JobNotFound as e:
            fail(EXIT_NOT_FOUND, str(e))
        except InputError as e:
            fail(EXIT_INPUT, str(e))
        except (redis.ConnectionError, redis.TimeoutError) as e:
            ctx = click.get_current_context().find_object(Ctx)
            where = describe(ctx.settings.redis_url) if ctx else "Redis"
            fail(EXIT_REDIS, f"cannot reach Redis at {where}: {e}")
        except TimeoutError as e:
            fail(EXIT_TIMEOUT, str(e))
        except (ValueError, FileNotFoundError) as e:
            fail(EXIT_USAGE, str(e))
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(EXIT_INTERRUPTED)

    return wrapper


def global_options(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Accept the global flags after the command's name too (``submit f.jsonl --wait -q``).

    Put it above the command's own options and below ``@cli.command()``. Values given here win
    over the group's; flags (``--json``, ``-q``) add up.
    """
    own = {p.name for p in getattr(fn, "__click_params__", [])}

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        given = {k: kwargs.pop(k) for k in GLOBAL_NAMES if k in kwargs}
        ctx = click.get_current_context().find_object(Ctx)
        if ctx is not None and any(v for v in given.values()):
            ctx.merge(given)
        return fn(*args, **kwargs)

    for decorate in reversed(global_option_decorators(with_json="json_flag" not in own)):
        wrapper = decorate(wrapper)
    params = getattr(wrapper, "__click_params__", [])
    added = params[len(own):]  # click lists params in reverse: move ours first to show them last in --help
    del params[len(own):]
    params[0:0] = added
    return wrapper


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` on a read command (the group's ``--json`` works too)."""
    return click.option("--json", "json_flag", is_flag=True, help="Print one JSON document.")(fn)


def emit(ctx: Ctx, json_flag: bool, payload: Any, human: Callable[[], None]) -> None:
    if ctx.json or json_flag:
        click.echo(json.dumps(payload, ensure_ascii=False, default=str))
    else:
        human()
