"""Simulated nodes on one machine: a Linux network namespace per node on a bridge of its own.

Each node has its own address (``10.97.0.<k+1>``), its own hostname (its processes run in a UTS
namespace of their own), its own dump directory standing for its local disk, and a loopback that
is up. Processes are started on a node exactly as a user starts them on a host
(:meth:`SimCluster.start`); faults are injected at node level: :meth:`~SimCluster.kill` (every
process, the launcher included), :meth:`~SimCluster.link_down` (a partition, the processes
alive), :meth:`~SimCluster.freeze` (every process stopped); :meth:`~SimCluster.limit_rate` gives
a node's link a rate (1 or 10 Gb/s, say).

The bridge carries no address: the nodes talk only to each other, and two clusters built at once
(parallel test runs) never see each other's traffic. Every name carries a random tag, and
:meth:`SimCluster.close` removes all of it, also after a failed test. It needs root (network
namespaces); without it, :class:`ClusterUnavailableError` says why.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Collection, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from tether._exceptions import ClusterUnavailableError

__all__ = ["ClusterUnavailableError", "Node", "SimCluster", "simulated_cluster"]

SUBNET = "10.97.0"
"""Every cluster's nodes take ``SUBNET.<k+1>/24``; bridges without an address keep clusters
apart, so one subnet serves them all."""
IFNAME = "eth0"
"""The node's interface, as gloo's ``GLOO_SOCKET_IFNAME`` names it."""
_IP_TIMEOUT_S = 10.0


@dataclasses.dataclass(frozen=True)
class Node:
    index: int
    hostname: str
    """The node's own hostname (``node<k>``), as its processes see it."""
    netns: str
    address: str
    host_veth: str
    """The host's end of the node's link: down is a partition."""
    dump_dir: Path
    """The node's "local disk": nothing else writes there."""


class SimCluster:
    """``nodes`` simulated nodes, built by :meth:`build` and removed by :meth:`close`."""

    def __init__(self, nodes: int, *, root: Path | None = None) -> None:
        if nodes < 1:
            raise ValueError(f"a cluster has at least one node, not {nodes}")
        self.tag = secrets.token_hex(3)
        self.bridge = f"tb{self.tag}"
        self._own_root = root is None
        self.root = root or Path(tempfile.mkdtemp(prefix=f"tether-nodes-{self.tag}-"))
        self.nodes = [
            Node(
                index=k,
                hostname=f"node{k}",
                netns=f"tether-{self.tag}-n{k}",
                address=f"{SUBNET}.{k + 1}",
                host_veth=f"tv{self.tag}n{k}",
                dump_dir=self.root / f"node{k}" / "dumps",
            )
            for k in range(nodes)
        ]
        self._procs: list[subprocess.Popen[Any]] = []

    # -- building and removing --------------------------------------------------------------
    def build(self) -> SimCluster:
        why = ""
        if os.geteuid() != 0:
            why = "simulated nodes need root (network namespaces); run as root"
        elif shutil.which("ip") is None or shutil.which("unshare") is None:
            why = "simulated nodes need `ip` (iproute2) and `unshare`"
        if why:
            self.close()  # (the nodes' directories, if this cluster made them)
            raise ClusterUnavailableError(why)
        try:
            _ip("link", "add", self.bridge, "type", "bridge")
            _ip("link", "set", self.bridge, "up")
            for node in self.nodes:
                node.dump_dir.mkdir(parents=True, exist_ok=True)
                _ip("netns", "add", node.netns)
                _ip("link", "add", node.host_veth, "type", "veth", "peer", "name", IFNAME,
                    "netns", node.netns)  # fmt: skip
                _ip("link", "set", node.host_veth, "master", self.bridge)
                _ip("link", "set", node.host_veth, "up")
                _ns(node, "ip", "addr", "add", f"{node.address}/24", "dev", IFNAME)
                _ns(node, "ip", "link", "set", IFNAME, "up")
                _ns(node, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def close(self) -> None:
        """Kill every process of every node, remove the namespaces, links and bridge (and the
        nodes' directories, if this cluster made them). Never raises."""
        for node in self.nodes:
            with contextlib.suppress(Exception):
                self.kill(node)
        for proc in self._procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        for node in self.nodes:
            with contextlib.suppress(Exception):
                _ip("link", "del", node.host_veth, check=False)
            with contextlib.suppress(Exception):
                _ip("netns", "del", node.netns, check=False)
        with contextlib.suppress(Exception):
            _ip("link", "del", self.bridge, check=False)
        if self._own_root:
            shutil.rmtree(self.root, ignore_errors=True)

    def __enter__(self) -> SimCluster:
        return self.build()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- processes --------------------------------------------------------------------------
    def command(self, node: Node, argv: Sequence[str]) -> list[str]:
        """``argv`` run on ``node``: in its network namespace, under its own hostname, with gloo
        bound to the node's interface (without it gloo resolves the hostname, falls back to
        127.0.0.1, and every pair across nodes is refused)."""
        return [
            "ip", "netns", "exec", node.netns,
            "unshare", "--uts", "--",
            "sh", "-c", 'hostname "$0" && exec "$@"', node.hostname,
            "env", f"GLOO_SOCKET_IFNAME={IFNAME}", *argv,
        ]  # fmt: skip

    def start(
        self, node: Node, argv: Sequence[str], *, env: Mapping[str, str] | None = None, **popen: Any
    ) -> subprocess.Popen[Any]:
        """Start ``argv`` on ``node``; ``env``: its whole environment (None: this process's).
        ``popen``: :class:`subprocess.Popen`'s own arguments."""
        proc = subprocess.Popen(self.command(node, argv), env=env, **popen)
        self._procs.append(proc)
        return proc

    def pids(self, node: Node) -> list[int]:
        """Every process of ``node`` (the kernel's list of its network namespace)."""
        out = _ip("netns", "pids", node.netns, check=False)
        return [int(p) for p in out.split()]

    # -- faults -----------------------------------------------------------------------------
    def kill(self, node: Node) -> None:
        """The node is lost: every process of it, its launcher included, is SIGKILLed."""
        self._signal(node, signal.SIGKILL)

    def freeze(self, node: Node, *, spare: Collection[int] = ()) -> None:
        """The node stops making progress: every process of it but ``spare`` is stopped
        (SIGSTOP); spare its launcher, and its workers alone are frozen."""
        self._signal(node, signal.SIGSTOP, spare=spare)

    def thaw(self, node: Node) -> None:
        self._signal(node, signal.SIGCONT)

    def link_down(self, node: Node) -> None:
        """A partition: the node's link goes down, its processes stay alive."""
        _ip("link", "set", node.host_veth, "down")

    def link_up(self, node: Node) -> None:
        _ip("link", "set", node.host_veth, "up")

    def limit_rate(self, node: Node, bits_per_s: float) -> None:
        """The node's link carries at most ``bits_per_s`` each way (a token bucket on both ends
        of its veth: the host's end shapes what reaches the node, the node's end what leaves
        it). The kernel here has ``tbf`` but no ``netem``: rate, no delay or loss."""
        rate = str(int(bits_per_s))
        # The bucket holds 10 ms at the rate and at least a 64 KiB segment (veths pass TSO-sized
        # ones); a shallower one caps the rate below what is set, a deeper one lets bursts past.
        burst = str(max(int(bits_per_s / 8 / 100), 64 << 10) + 1514)
        shape = ("qdisc", "replace", "dev")
        spec = ("root", "tbf", "rate", rate, "burst", burst, "latency", "50ms")
        _run(["tc", *shape, node.host_veth, *spec])
        _run(["ip", "netns", "exec", node.netns, "tc", *shape, IFNAME, *spec])

    def _signal(self, node: Node, sig: signal.Signals, *, spare: Collection[int] = ()) -> None:
        # New processes may start while we signal (a launcher starting a worker): go round until
        # no new one appears (bounded).
        seen: set[int] = set(spare)
        for _ in range(5):
            fresh = [p for p in self.pids(node) if p not in seen]
            if not fresh:
                return
            for pid in fresh:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
            seen.update(fresh)
            time.sleep(0.01)  # a fork in progress shows up in the namespace's list next round


def _ip(*args: str, check: bool = True) -> str:
    return _run(["ip", *args], check=check)


def _run(argv: list[str], *, check: bool = True) -> str:
    try:
        out = subprocess.run(
            argv, capture_output=True, text=True, timeout=_IP_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise ClusterUnavailableError(f"{' '.join(argv)}: {exc}") from exc
    if check and out.returncode != 0:
        raise ClusterUnavailableError(f"{' '.join(argv)}: {out.stderr.strip()}")
    return out.stdout


def _ns(node: Node, *argv: str) -> None:
    _ip("netns", "exec", node.netns, *argv)


@contextlib.contextmanager
def simulated_cluster(nodes: int, *, root: Path | None = None) -> Iterator[SimCluster]:
    """``with simulated_cluster(2) as cluster:`` ... removed on the way out, whatever happened."""
    cluster = SimCluster(nodes, root=root)
    cluster.build()
    try:
        yield cluster
    finally:
        cluster.close()
