"""The one loader of batchinfer's Lua scripts (``batchinfer/store/lua/<name>.lua``, one file per script).

Every script runs as a redis-py :class:`~redis.commands.core.Script`: EVALSHA, and on NOSCRIPT
(a Redis restart, ``SCRIPT FLUSH``) SCRIPT LOAD and EVALSHA again; never a plain EVAL, which
would send the whole text on every call. A script that calls ``maybe_finalize(`` gets the
``finalize.lua`` prelude prepended.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

PRELUDE = "finalize"  # a library of functions, not a script of its own


@cache
def lua_source(name: str) -> str:
    """The text of ``batchinfer/store/lua/<name>.lua``, after the ``finalize.lua`` prelude if it uses it."""
    lua = resources.files("batchinfer.store") / "lua"
    text = (lua / f"{name}.lua").read_text(encoding="utf-8")
    if name != PRELUDE and "maybe_finalize(" in text:
        text = (lua / f"{PRELUDE}.lua").read_text(encoding="utf-8") + "\n" + text
    return text


def register(redis_client: redis.Redis, name: str) -> Script:
    """Script ``name`` bound to ``redis_client``: call it as ``script(keys=[...], args=[...])``.

    Registering costs no round trip; the script is loaded on its first NOSCRIPT reply.
    """
    return redis_client.register_script(lua_source(name))
