"""Redis with Sentinel for tests: a master, a replica and three sentinels, real processes on
loopback ports, which fail over for real when the master is killed.

The sentinels watch the service ``svc`` with quorum 2 and declare a silent master down after
``DOWN_AFTER_MS``, so that a failover takes a few seconds. :attr:`SentinelSet.url` is the
``redis+sentinel://`` URL the daemons are given.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
from pathlib import Path

import redis
from conftest import RedisServer, free_port
from daemons import TcpProxy, wait_until

SERVICE = "svc"
DOWN_AFTER_MS = 1000
FAILOVER_TIMEOUT_MS = 5000


class SentinelSet:
    """``master`` and ``replica`` (:class:`RedisServer`), three sentinel processes. The replica
    replicates through a :class:`TcpProxy`, so that a test can cut replication off."""

    def __init__(self, directory: Path):
        self.dir = directory
        self.master = RedisServer(self._folder("master"))
        self.replica = RedisServer(self._folder("replica"))
        self.sentinel_ports = [free_port() for _ in range(3)]
        self.sentinels: list[subprocess.Popen] = []
        self.link: TcpProxy | None = None

    def _folder(self, name: str) -> Path:
        folder = self.dir / name
        folder.mkdir(parents=True, exist_ok=True)
        return folder

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{p}" for p in self.sentinel_ports)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self) -> SentinelSet:
        self.master.start()
        self.link = TcpProxy(self.master.port)
        self.replica.extra_args = ["--replicaof", "127.0.0.1", str(self.link.port)]
        self.replica.start()
        self.wait_synced()
        exe = shutil.which("redis-server")
        assert exe is not None
        for i, port in enumerate(self.sentinel_ports):
            folder = self._folder(f"sentinel{i}")
            conf = folder / "sentinel.conf"  # a sentinel rewrites its file: one each, writable
            conf.write_text(f"port {port}\nbind 127.0.0.1\ndir {folder}\n"
                            f"sentinel monitor {SERVICE} 127.0.0.1 {self.master.port} 2\n"
                            f"sentinel down-after-milliseconds {SERVICE} {DOWN_AFTER_MS}\n"
                            f"sentinel failover-timeout {SERVICE} {FAILOVER_TIMEOUT_MS}\n"
                            f"sentinel parallel-syncs {SERVICE} 1\n")
            self.sentinels.append(subprocess.Popen([exe, str(conf), "--sentinel"], stdout=subprocess.DEVNULL,
                                                   stderr=subprocess.DEVNULL))
        self._until(lambda: all(self._sees_replica(p) for p in self.sentinel_ports), 20,
                    "the sentinels to see the master and its replica")
        return self

    def _sentinel(self, port: int) -> redis.Redis:
        return redis.Redis(port=port, socket_timeout=1, socket_connect_timeout=0.5, decode_responses=True)

    def _sees_replica(self, port: int) -> bool:
        try:
            s = self._sentinel(port)
            return bool(s.sentinel_slaves(SERVICE)) and len(s.sentinel_sentinels(SERVICE)) == 2
        except redis.RedisError:
            return False

    def master_port(self) -> int | None:
        """The master's port as the sentinels' majority says."""
        votes: dict[int, int] = {}
        for port in self.sentinel_ports:
            try:
                _, master = self._sentinel(port).sentinel_get_master_addr_by_name(SERVICE)
            except (redis.RedisError, TypeError):
                continue
            votes[int(master)] = votes.get(int(master), 0) + 1
        best = max(votes.items(), key=lambda kv: kv[1], default=None)
        return best[0] if best and best[1] >= 2 else None

    def wait_synced(self, timeout: float = 20) -> None:
        """Until the replica's link to the master is up and it has the master's offset."""
        def synced() -> bool:
            info = redis.Redis(port=self.replica.port).info("replication")
            if info.get("master_link_status") != "up":
                return False
            offset = redis.Redis(port=self.master.port).info("replication")["master_repl_offset"]
            return info["slave_repl_offset"] >= offset
        self._until(synced, timeout, "the replica to sync")

    def kill_master(self) -> None:
        """SIGKILL the master (no shutdown): the sentinels fail over to the replica."""
        self.master.stop(kill=True)

    def cut_replication(self) -> None:
        """The replica stops receiving the master's writes (they wait in the link, unsent)."""
        assert self.link is not None
        self.link.cut()

    def drop_link(self) -> None:
        """Close the link: what the master wrote since the cut never reaches the replica."""
        assert self.link is not None
        self.link.close()

    def pause_replica(self) -> None:
        """SIGSTOP the replica: replication stalls, the master goes on taking writes."""
        assert self.replica.proc is not None
        self.replica.proc.send_signal(signal.SIGSTOP)

    def resume_replica(self) -> None:
        assert self.replica.proc is not None
        self.replica.proc.send_signal(signal.SIGCONT)

    def wait_promoted(self, timeout: float = 30) -> None:
        """Until the sentinels name the replica master and it answers as one."""
        def promoted() -> bool:
            if self.master_port() != self.replica.port:
                return False
            return redis.Redis(port=self.replica.port).info("replication")["role"] == "master"
        self._until(promoted, timeout, "the replica's promotion")

    def rejoin_old_master(self, timeout: float = 30) -> None:
        """Start the killed master again (empty, on its port) as a replica of the promoted one (what
        the sentinels would tell it, in their own time: told here, so the test does not wait on
        them); returns once the promoted master counts it as a connected replica. It starts as a
        replica (``--replicaof``), not as a master told afterwards, and only once every sentinel names
        the promoted master (a stale one is re-pointed): a CI run saw the job's record and every
        worker's registration "missing" when clients reached the restarted, empty node at the old
        address."""
        # A sentinel that still names the old address (a majority was all wait_promoted asked for; one
        # stayed stale for 30 s and more here) would send a client that asks it first to the
        # restarted node: point it at the promoted master, as its own convergence would in time.
        want = str(self.replica.port)
        for port in self.sentinel_ports:
            s = self._sentinel(port)
            if s.sentinel_get_master_addr_by_name(SERVICE)[1] != want:
                s.sentinel_remove(SERVICE)
                s.sentinel_monitor(SERVICE, "127.0.0.1", self.replica.port, 2)
                s.sentinel_set(SERVICE, "down-after-milliseconds", DOWN_AFTER_MS)
                s.sentinel_set(SERVICE, "failover-timeout", FAILOVER_TIMEOUT_MS)
        self.master.extra_args = ["--replicaof", "127.0.0.1", str(self.replica.port)]
        self.master.start()

        def rejoined() -> bool:
            info = redis.Redis(port=self.replica.port).info("replication")
            return info["role"] == "master" and int(info.get("connected_slaves", 0)) >= 1

        self._until(rejoined, timeout, "the old master to rejoin as a replica")

    def _until(self, cond, timeout: float, what: str) -> None:
        """``daemons.wait_until``, a Redis that does not answer (yet) counting as not there."""
        def quiet() -> bool:
            try:
                return bool(cond())
            except redis.RedisError:
                return False

        wait_until(quiet, timeout, what)

    def stop(self) -> None:
        for proc in self.sentinels:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.sentinels = []
        if self.replica.proc is not None and self.replica.proc.poll() is None:
            self.replica.proc.send_signal(signal.SIGCONT)  # a test that failed while it was paused
        self.replica.stop(kill=True)
        self.master.stop(kill=True)
        if self.link is not None:
            self.link.close()
