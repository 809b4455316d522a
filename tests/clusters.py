"""Redis Cluster for tests: ``masters`` masters with ``replicas`` replicas each, real redis-server
processes on loopback ports, which fail over for real when a master is killed.

batchinfer puts every key a Lua script touches under one hash tag (``batchinfer/keys.py``), so that
the queue runs on Redis Cluster; these nodes let a test check that for real: a misplaced key gets a
``CROSSSLOT`` error, a killed master's replica takes its slots over.

Each node is a :class:`RedisServer` in a folder of its own (its ``nodes.conf`` is its own), with
its cluster bus on a free port of its own (``--cluster-port``, not the usual port + 10000, which
may be taken or past 65535). Three masters or more are joined by ``redis-cli --cluster create``;
fewer (``ClusterSet(directory, masters=1, replicas=0)``: one node owning all 16384 slots, a cheap
way to run ordinary tests under cluster semantics) by hand, as ``redis-cli`` refuses them.

A node that stops answering is suspected after ``node_timeout_ms`` (1 s), declared failed by the
majority of masters soon after, and its replica (``--cluster-replica-validity-factor 0``: however
stale, it may stand) promoted within a second or so: a failover takes a few seconds. Full coverage
stays required (Redis's default): from the moment the killed master is declared failed until its
replica takes over, the cluster refuses every command (``CLUSTERDOWN``), as a client would see it;
:meth:`ClusterSet.wait_promoted` waits until every live node says ``cluster_state:ok`` again.
:attr:`ClusterSet.url` is the ``redis://`` URL of one master, from which a cluster client discovers
the others.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis
from conftest import RedisServer, free_port
from daemons import wait_until
from redis.cluster import key_slot

SLOTS = 16384
START_TIMEOUT_S = 20


@dataclass
class NodeView:
    """One line of ``CLUSTER NODES``: a node as some node sees it."""

    id: str
    port: int
    flags: set[str]
    master_id: str | None
    slots: list[tuple[int, int]] = field(default_factory=list)  # inclusive ranges

    @property
    def failed(self) -> bool:
        return "fail" in self.flags  # "fail?" (only suspected) is another flag

    @property
    def is_master(self) -> bool:
        return "master" in self.flags

    def serves(self, slot: int) -> bool:
        return any(lo <= slot <= hi for lo, hi in self.slots)


def parse_nodes(text: str) -> list[NodeView]:
    """``CLUSTER NODES``' reply: ``<id> <ip:port@cport> <flags> <master> <ping> <pong> <epoch>
    <link> <slot>...``, a slot being ``n``, ``lo-hi`` or ``[n->-id]`` (migrating: skipped)."""
    nodes = []
    for line in text.splitlines():
        parts = line.split()
        if len(parts) < 8:
            continue
        address = parts[1].split("@")[0]
        slots = []
        for slot in parts[8:]:
            if slot.startswith("["):
                continue
            lo, _, hi = slot.partition("-")
            slots.append((int(lo), int(hi or lo)))
        nodes.append(NodeView(id=parts[0], port=int(address.rsplit(":", 1)[1] or 0),
                              flags=set(parts[2].split(",")), master_id=None if parts[3] == "-" else parts[3],
                              slots=slots))
    return nodes


@dataclass
class _Killed:
    """What a killed master was, taken just before the kill: its replicas are the candidates."""

    id: str
    replica_ports: list[int]


class ClusterSet:
    """``nodes`` (:class:`RedisServer`, ``masters * (1 + replicas)`` of them). Which become masters
    is ``redis-cli``'s choice (in practice the first ``masters``); ask :meth:`masters`."""

    def __init__(self, directory: Path, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000):
        assert masters >= 1 and replicas >= 0
        self.dir = directory
        self.n_masters = masters
        self.n_replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        count = masters * (1 + replicas)
        ports: list[int] = []
        while len(ports) < 2 * count:  # a client port and a bus port each, all distinct
            port = free_port()
            if port not in ports:
                ports.append(port)
        self.nodes: list[RedisServer] = []
        self.bus_ports: dict[int, int] = {}  # a node's port -> its cluster bus port
        for i in range(count):
            folder = directory / f"node{i}"
            folder.mkdir(parents=True, exist_ok=True)
            self.nodes.append(RedisServer(
                folder, ports[2 * i],
                "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                "--cluster-port", str(ports[2 * i + 1]), "--cluster-node-timeout", str(node_timeout_ms),
                "--cluster-replica-validity-factor", "0", "--repl-diskless-sync-delay", "0"))
            self.bus_ports[ports[2 * i]] = ports[2 * i + 1]
        self._entry: int | None = None  # the first master once formed: url's
        self._killed: dict[int, _Killed] = {}

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self) -> ClusterSet:
        """Start every node, form the cluster, wait until every node says ``cluster_state:ok`` and
        every replica's link to its master is up. On failure nothing is left running."""
        try:
            for node in self.nodes:
                node.start()
            if self.n_masters >= 3:
                self._create_with_cli()
            else:
                self._create_by_hand()
            self._until(self._formed, START_TIMEOUT_S, "the cluster to form")
            self._entry = self.masters()[0]
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """SIGKILL every node (and wait for it). Idempotent."""
        for node in self.nodes:
            node.stop(kill=True)

    def _create_with_cli(self) -> None:
        exe = shutil.which("redis-cli")
        assert exe is not None, "redis-cli is not on PATH"
        args = [exe, "--cluster", "create", *(f"127.0.0.1:{n.port}" for n in self.nodes),
                "--cluster-replicas", str(self.n_replicas), "--cluster-yes"]
        done = subprocess.run(args, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
        if done.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed ({done.returncode}):\n"
                               f"{done.stdout[-3000:]}{done.stderr[-3000:]}")

    def _create_by_hand(self) -> None:
        """What ``redis-cli --cluster create`` does, for fewer than 3 masters: slots split among
        the first ``n_masters`` nodes, every node met, the others made their replicas in turn."""
        masters = self.nodes[:self.n_masters]
        for i, node in enumerate(masters):
            lo, hi = SLOTS * i // len(masters), SLOTS * (i + 1) // len(masters) - 1
            self._call(node.port, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
            self._call(node.port, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        first = self.nodes[0]
        for node in self.nodes[1:]:
            self._call(node.port, "CLUSTER", "MEET", "127.0.0.1", first.port, self.bus_ports[first.port])
        if len(self.nodes) == 1:
            return
        self._until(lambda: all(self._knows_all(n.port) for n in self.nodes), START_TIMEOUT_S,
                    "the nodes to meet")
        ids = [self._call(m.port, "CLUSTER", "MYID") for m in masters]
        for i, node in enumerate(self.nodes[self.n_masters:]):
            self._call(node.port, "CLUSTER", "REPLICATE", ids[i % len(ids)])

    def _knows_all(self, port: int) -> bool:
        view = self._nodes_of(port)
        return len(view) == len(self.nodes) and not any({"handshake", "noaddr"} & n.flags for n in view)

    def _formed(self) -> bool:
        for node in self.nodes:
            info = self._cluster_info(node.port)
            if info.get("cluster_state") != "ok" or int(info["cluster_known_nodes"]) != len(self.nodes):
                return False
            info = self._replication(node.port)
            if info["role"] == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    # -- the cluster as its nodes see it ----------------------------------------------------------

    @property
    def url(self) -> str:
        """``redis://`` URL of the first master once formed, or of the first live master if that one
        was killed (a cluster client finds the others from any one)."""
        port = self._entry
        if port is None or not self._alive(port):
            port = self.masters()[0]
        return f"redis://127.0.0.1:{port}/0"

    def live_ports(self) -> list[int]:
        return [n.port for n in self.nodes if n.proc is not None and n.proc.poll() is None]

    def view(self) -> list[NodeView]:
        """``CLUSTER NODES`` as the first live node that answers says."""
        for port in self.live_ports():
            try:
                return self._nodes_of(port)
            except redis.RedisError:
                continue
        raise RuntimeError("no live cluster node answers")

    def masters(self) -> list[int]:
        """Ports of the masters not marked failed, in slot order (a master without slots last)."""
        masters = [n for n in self.view() if n.is_master and not n.failed]
        masters.sort(key=lambda n: min(n.slots, default=(SLOTS, SLOTS)))
        return [n.port for n in masters]

    def master_of(self, key: str) -> int:
        """Port of the master serving ``key``'s slot (its hash tag's)."""
        slot = key_slot(key.encode())
        for node in self.view():
            if node.is_master and not node.failed and node.serves(slot):
                return node.port
        raise LookupError(f"no live master serves slot {slot} ({key!r})")

    def replicas_of(self, port: int) -> list[int]:
        view = self.view()
        ids = [n.id for n in view if n.port == port]
        return [n.port for n in view if ids and n.master_id == ids[0]]

    # -- faults -----------------------------------------------------------------------------------

    def kill_master(self, port: int) -> None:
        """SIGKILL the master on ``port`` (no shutdown): its replica is promoted in a few seconds."""
        self._killed[port] = self._before_kill(port)
        self._server(port).stop(kill=True)

    def _before_kill(self, port: int) -> _Killed:
        view = self.view()
        me = next((n for n in view if n.port == port), None)
        if me is None or not me.is_master:
            raise ValueError(f"{port} is not a master of the cluster")
        return _Killed(me.id, [n.port for n in view if n.master_id == me.id])

    def wait_promoted(self, old_port: int, timeout: float = 30) -> None:
        """Until every live node marks the old master failed (with no slots left to it) and says
        ``cluster_state:ok``, and one of its former replicas answers ``role:master``. Needs three
        masters or more: a majority of the masters must agree that the old one failed."""
        killed = self._killed.get(old_port)
        if killed is None:  # killed some other way, before its replica took over
            killed = self._killed[old_port] = self._before_kill(old_port)

        def promoted() -> bool:
            live = self.live_ports()
            if not any(p in live and self._replication(p)["role"] == "master" for p in killed.replica_ports):
                return False
            for port in live:
                if self._cluster_info(port).get("cluster_state") != "ok":
                    return False
                old = next((n for n in self._nodes_of(port) if n.id == killed.id), None)
                if old is not None and (not old.failed or old.slots):
                    return False
            return True

        self._until(promoted, timeout, f"a replica of {old_port} to be promoted")

    def pause(self, port: int) -> None:
        """SIGSTOP the node on ``port``."""
        proc = self._server(port).proc
        assert proc is not None
        proc.send_signal(signal.SIGSTOP)

    def cut_replica(self, port: int) -> None:
        """The replica on ``port`` drops its link to its master and is SIGSTOPped before it connects
        again (it does so once a second): the master's writes from now on never reach it, even those
        a paused replica would still find in its socket. :meth:`resume` it."""
        redis.Redis(port=port).client_kill_filter(_type="master")
        self.pause(port)

    def resume(self, port: int) -> None:
        proc = self._server(port).proc
        assert proc is not None
        proc.send_signal(signal.SIGCONT)

    def rejoin(self, port: int, timeout: float = 30) -> None:
        """Start the killed node on ``port`` again (its ``nodes.conf`` kept): it rejoins as a replica
        of the master that took its slots, and this returns once it is synced."""
        self._server(port).start()
        self._until(lambda: self._replication(port)["role"] == "slave"
                    and self._replication(port).get("master_link_status") == "up", timeout,
                    f"{port} to rejoin as a replica")
        self.wait_synced(timeout)

    def wait_synced(self, timeout: float = 20) -> None:
        """Until every live replica's link to its master is up and it has its master's offset."""
        def synced() -> bool:
            for port in self.live_ports():
                info = self._replication(port)
                if info["role"] != "slave":
                    continue
                if info.get("master_link_status") != "up":
                    return False
                if info["slave_repl_offset"] < self._replication(info["master_port"])["master_repl_offset"]:
                    return False
            return True

        self._until(synced, timeout, "the replicas to sync")

    # -- helpers ----------------------------------------------------------------------------------

    def _server(self, port: int) -> RedisServer:
        return next(n for n in self.nodes if n.port == port)

    def _alive(self, port: int) -> bool:
        return port in self.live_ports()

    def _call(self, port: int, *args: Any) -> Any:
        with redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=0.5, decode_responses=True) as r:
            return r.execute_command(*args)

    def _nodes_of(self, port: int) -> list[NodeView]:
        return parse_nodes(self._call(port, "CLUSTER", "NODES"))  # two words: redis-py parses none

    def _cluster_info(self, port: int) -> dict[str, str]:
        text = self._call(port, "CLUSTER", "INFO")
        return dict(line.split(":", 1) for line in text.splitlines() if ":" in line)

    def _replication(self, port: int) -> dict[str, Any]:
        with redis.Redis(port=port, socket_timeout=2, socket_connect_timeout=0.5, decode_responses=True) as r:
            return r.info("replication")

    def describe(self) -> str:
        """One line per node: port, alive, role, cluster_state (for a timeout's message)."""
        lines = []
        for node in self.nodes:
            if not self._alive(node.port):
                lines.append(f"  {node.port}: dead")
                continue
            try:
                role = self._replication(node.port)["role"]
                state = self._cluster_info(node.port).get("cluster_state")
                lines.append(f"  {node.port}: {role}, cluster_state:{state}")
            except redis.RedisError as e:
                lines.append(f"  {node.port}: {e!r}")
        return "\n".join(lines)

    def _until(self, cond, timeout: float, what: str) -> None:
        """``daemons.wait_until``, a node that does not answer (yet) counting as not there; a
        timeout says what every node was."""
        def quiet() -> bool:
            try:
                return bool(cond())
            except redis.RedisError:
                return False

        try:
            wait_until(quiet, timeout, what)
        except AssertionError as e:
            raise AssertionError(f"{e} within {timeout} s; the nodes:\n{self.describe()}") from None
