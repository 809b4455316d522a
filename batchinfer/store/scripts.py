"""The one loader of batchinfer's Lua scripts (``batchinfer/store/lua/<name>.lua``, one file per script).

Every script runs as a redis-py :class:`~redis.commands.core.Script`: EVALSHA, and on NOSCRIPT
(a Redis restart, ``SCRIPT FLUSH``) SCRIPT LOAD and EVALSHA again; never a plain EVAL, which
would send the whole text on every call. A script that calls a prelude's function gets that
prelude prepended (and the preludes that one calls): ``maybe_finalize(`` the ``finalize.lua`` one,
``deliver_row(`` the ``deliver.lua`` one, ``publish_row`` the ``publish_row.lua`` one.
"""

from __future__ import annotations

from functools import cache
from importlib import resources

import redis
from redis.commands.core import Script

# libraries of local functions, not scripts of their own: file name -> the call that needs it; in
# the order they are prepended (a prelude only calls those before it)
PRELUDES = {"finalize": "maybe_finalize(", "deliver": "deliver_row(", "publish_row": "publish_row"}


@cache
def lua_source(name: str) -> str:
    """The text of ``batchinfer/store/lua/<name>.lua``, after the preludes whose functions it calls."""
    lua = resources.files("batchinfer.store") / "lua"
    text = (lua / f"{name}.lua").read_text(encoding="utf-8")
    if name in PRELUDES:
        return text
    used: list[str] = []
    for prelude, call in reversed(PRELUDES.items()):  # a prelude's own calls are to those before it
        if call in text or any(call in (lua / f"{p}.lua").read_text(encoding="utf-8") for p in used):
            used.insert(0, prelude)
    return "\n".join([*((lua / f"{p}.lua").read_text(encoding="utf-8") for p in used), text])


def register(redis_client: redis.Redis, name: str) -> Script:
    """Script ``name`` bound to ``redis_client``: call it as ``script(keys=[...], args=[...])``.

    Registering costs no round trip; the script is loaded on its first NOSCRIPT reply.
    """
    return redis_client.register_script(lua_source(name))



def preload(script: Script) -> None:
    """Load ``script`` on its client's servers now (on a Redis Cluster, every master). A plain
    pipeline loads its scripts itself before it runs them (redis-py: SCRIPT EXISTS, SCRIPT LOAD); a
    Cluster pipeline queues bare EVALSHAs, so a caller that pipelines a script there loads it first."""
    script.sha = script.registered_client.script_load(script.script)
