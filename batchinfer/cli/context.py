"""What every ``batchinfer`` command shares: :class:`Ctx`, the exit codes (docs/cli.md), the error
mapping and ``--json`` output. The group (:mod:`batchinfer.cli.main`), the daemon commands and the
runner all import it, and it imports none of them, so the CLI has no import circle.
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
EXIT_INTERRUPTED = 130  # Ctrl-C


class Ctx:
    """What the group hands to every command."""

    def __init__(self, settings: Settings, json_output: bool, quiet: bool):
        self.settings = settings
        self.json = json_output
        self.quiet = quiet

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
        from batchinfer.client.inputs import InputError
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


def json_option(fn: Callable[..., Any]) -> Callable[..., Any]:
    """``--json`` on a read command (the group's ``--json`` works too)."""
    return click.option("--json", "json_flag", is_flag=True, help="Print one JSON document.")(fn)


def emit(ctx: Ctx, json_flag: bool, payload: Any, human: Callable[[], None]) -> None:
    if ctx.json or json_flag:
        click.echo(json.dumps(payload, ensure_ascii=False, default=str))
    else:
        human()
