"""A real etcd cluster for tests, benches and demos: one member per simulated node, or members on
this host's loopback.

Members are Debian's ``etcd`` (3.4, ``make`` installs it), started with the cluster's initial
membership on the nodes' addresses; a member killed and started again from its data directory
rejoins (:meth:`EtcdCluster.restart`). Every wait is bounded; :meth:`EtcdCluster.close` kills
every member and removes the data directories.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import secrets
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from tether._exceptions import ClusterUnavailableError
from tether.testing.nodes import Node, SimCluster

__all__ = ["EtcdCluster", "EtcdMember", "etcd_on_loopback", "etcd_on_nodes"]

CLIENT_PORT, PEER_PORT = 2379, 2380
START_TIMEOUT_S = 20.0
ELECTION_MS = 500
"""etcd's election timeout for these clusters (etcd's default: 1000 ms), its heartbeat a tenth:
a member that hears nothing from the leader for this long (randomised up to twice) calls an
election, so it bounds what losing the leader's node costs. etcd's tuning guide asks for ten
round trips or more; on one LAN a round trip is well under a millisecond."""


@dataclasses.dataclass
class EtcdMember:
    name: str
    host: str
    client_port: int
    peer_port: int
    data_dir: Path
    node: Node | None = None
    """The simulated node the member runs on (None: this host's loopback)."""
    proc: subprocess.Popen[Any] | None = None

    @property
    def client_url(self) -> str:
        return f"http://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"


class EtcdCluster:
    """Members started by :meth:`start`, stopped by :meth:`close`."""

    def __init__(
        self,
        members: list[EtcdMember],
        *,
        nodes: SimCluster | None,
        root: Path,
        election_ms: int = ELECTION_MS,
    ) -> None:
        self.members = members
        self.nodes = nodes
        self.root = root
        self.election_ms = election_ms
        self.token = f"tether-{secrets.token_hex(4)}"

    @property
    def url(self) -> str:
        """``etcd://`` with every member's client address: tether's ``--store``."""
        return "etcd://" + ",".join(f"{m.host}:{m.client_port}" for m in self.members)

    def start(self) -> EtcdCluster:
        if shutil.which("etcd") is None:
            raise ClusterUnavailableError("etcd is not installed (`make etcd` installs Debian's)")
        try:
            for member in self.members:
                self._launch(member, state="new")
            self.wait_healthy(self.members)
        except BaseException:
            self.close()
            raise
        return self

    def _launch(self, member: EtcdMember, *, state: str) -> None:
        initial = ",".join(f"{m.name}={m.peer_url}" for m in self.members)
        argv = [
            "etcd", "--name", member.name, "--data-dir", str(member.data_dir),
            "--listen-client-urls", member.client_url,
            "--advertise-client-urls", member.client_url,
            "--listen-peer-urls", member.peer_url,
            "--initial-advertise-peer-urls", member.peer_url,
            "--initial-cluster", initial,
            "--initial-cluster-token", self.token,
            "--initial-cluster-state", state,
            "--election-timeout", str(self.election_ms),
            "--heartbeat-interval", str(self.election_ms // 10),
        ]  # fmt: skip
        log = open(self.root / f"{member.name}.log", "ab")  # noqa: SIM115  # the child's
        with log:
            if member.node is not None and self.nodes is not None:
                member.proc = self.nodes.start(member.node, argv, stdout=log, stderr=log)
            else:
                member.proc = subprocess.Popen(argv, stdout=log, stderr=log)

    def kill(self, member: EtcdMember) -> None:
        """The member is lost (SIGKILL); its data directory stays, for :meth:`restart`."""
        if member.proc is not None and member.proc.poll() is None:
            member.proc.kill()
            member.proc.wait(10)

    def restart(self, member: EtcdMember) -> None:
        """Start a killed member again from its data: it rejoins the cluster and catches up."""
        self.kill(member)
        self._launch(member, state="existing")
        self.wait_healthy([member])

    def wait_healthy(self, members: list[EtcdMember], timeout: float = START_TIMEOUT_S) -> None:
        """Until each of ``members`` says it is healthy (it has a leader and commits)."""
        deadline = time.monotonic() + timeout
        for member in members:
            while not self.healthy(member):
                if member.proc is not None and member.proc.poll() is not None:
                    raise ClusterUnavailableError(
                        f"etcd member {member.name} exited ({member.proc.returncode}): "
                        f"{self.log_tail(member)}"
                    )
                if time.monotonic() > deadline:
                    raise ClusterUnavailableError(
                        f"etcd member {member.name} not healthy after {timeout:g}s: "
                        f"{self.log_tail(member)}"
                    )
                time.sleep(0.1)

    def healthy(self, member: EtcdMember) -> bool:
        out = self._etcdctl(member, "endpoint", "health")
        return out is not None and out.returncode == 0

    def leader(self) -> EtcdMember | None:
        """The member that leads the cluster now, as one that answers says (None: none
        answers, or none leads)."""
        for member in self.members:
            ids = self._ids(member)
            if ids is not None and ids[0] == ids[1]:
                return member
        return None

    def lead(self, member: EtcdMember) -> None:
        """Make ``member`` the leader (etcd hands its leadership over), so that a fault meets
        the leader, or spares it, on purpose rather than by chance."""
        ids = self._ids(member)
        leader = self.leader()
        if ids is None or leader is None:
            raise ClusterUnavailableError(f"etcd: no leader to hand over to {member.name}")
        if leader is not member:
            out = self._etcdctl(leader, "move-leader", format(ids[0], "x"))
            if out is None or out.returncode != 0 or self.leader() is not member:
                why = out.stderr.strip() if out is not None else "no answer in 5 s"
                raise ClusterUnavailableError(f"etcd: {member.name} did not take the lead: {why}")

    def _ids(self, member: EtcdMember) -> tuple[int, int] | None:
        """``member``'s own id and its leader's, as it says (None: no answer)."""
        out = self._etcdctl(member, "endpoint", "status", "--write-out=json")
        if out is None or out.returncode != 0:
            return None
        try:
            status = json.loads(out.stdout)[0]["Status"]
            return int(status["header"]["member_id"]), int(status["leader"])
        except (ValueError, LookupError, TypeError):
            return None

    def _etcdctl(self, member: EtcdMember, *args: str) -> subprocess.CompletedProcess[str] | None:
        """``etcdctl`` against ``member``, from its node; None if it did not answer in 5 s."""
        argv = ["etcdctl", "--endpoints", member.client_url, "--command-timeout=1s", *args]
        if member.node is not None and self.nodes is not None:
            argv = ["ip", "netns", "exec", member.node.netns, *argv]
        env = {"ETCDCTL_API": "3", "PATH": "/usr/bin:/bin:/usr/sbin:/sbin"}
        try:
            return subprocess.run(argv, capture_output=True, text=True, timeout=5, env=env)
        except subprocess.TimeoutExpired:
            return None

    def log_tail(self, member: EtcdMember, lines: int = 3) -> str:
        path = self.root / f"{member.name}.log"
        text = path.read_text(errors="replace").splitlines() if path.exists() else []
        return " | ".join(text[-lines:])[-600:]

    def close(self) -> None:
        """Kill every member and remove their data. Never raises."""
        for member in self.members:
            with contextlib.suppress(Exception):
                self.kill(member)
        shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> EtcdCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


def etcd_on_nodes(
    nodes: SimCluster, count: int | None = None, *, election_ms: int = ELECTION_MS
) -> EtcdCluster:
    """One member on each of the first ``count`` nodes (all of them by default), on the node's
    own address and etcd's standard ports; not started yet."""
    root = Path(tempfile.mkdtemp(prefix="tether-etcd-"))
    members = [
        EtcdMember(f"etcd{n.index}", n.address, CLIENT_PORT, PEER_PORT, root / f"etcd{n.index}", n)
        for n in nodes.nodes[:count]
    ]
    return EtcdCluster(members, nodes=nodes, root=root, election_ms=election_ms)


def etcd_on_loopback(count: int = 1) -> EtcdCluster:
    """``count`` members on 127.0.0.1, on ports free when asked; not started yet."""
    root = Path(tempfile.mkdtemp(prefix="tether-etcd-"))
    ports = _free_ports(2 * count)
    members = [
        EtcdMember(f"etcd{k}", "127.0.0.1", ports[2 * k], ports[2 * k + 1], root / f"etcd{k}")
        for k in range(count)
    ]
    return EtcdCluster(members, nodes=None, root=root)


def _free_ports(count: int) -> list[int]:
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(count)]
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
