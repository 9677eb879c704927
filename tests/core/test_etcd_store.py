"""The job's store on etcd keeps TCPStore's semantics (each case runs on both, against a real
etcd member on loopback), fails over to the next member, and fails bounded and typed when none
answers."""

from __future__ import annotations

import contextlib
import http.server
import json
import socket
import sys
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch.distributed as dist

from tests._jobs import closed_port, new_store, until
from tether._exceptions import ConfigError, StoreUnreachableError
from tether.job.alarm import AlarmBoard
from tether.job.client import StoreAddress
from tether.job.elastic import FROZEN_S, WATCH_S, Decision, Membership, Node, NodePresence
from tether.job.etcd import EtcdKV, etcd_store, parse_endpoints
from tether.testing.etcd import EtcdCluster, etcd_on_loopback

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def etcd() -> Iterator[EtcdCluster]:
    with etcd_on_loopback(1) as cluster:
        yield cluster


@pytest.fixture(params=["tcp", "etcd"])
def client(request: pytest.FixtureRequest, etcd: EtcdCluster) -> Callable[[], Any]:
    """A factory of clients of one fresh store: TCPStore's, or the job's keys in etcd."""
    if request.param == "tcp":
        server = new_store()
        return lambda: new_client(server)
    return lambda: etcd_store(etcd.url, prefix=f"/{request.node.name}/", timeout=10)


@pytest.fixture
def store(client: Callable[[], Any]) -> Any:
    return client()


def test_get_blocks_until_another_client_sets(store: Any, client: Callable[[], Any]) -> None:
    setter = threading.Timer(0.2, client().set, args=("late", b"value"))
    setter.start()
    try:
        assert store.get("late") == b"value"
    finally:
        setter.join(5)
    store.set("now", "text")
    assert store.get("now") == b"text"


def test_a_wait_that_times_out_raises_torchs_store_error(store: Any) -> None:
    with pytest.raises(dist.DistStoreError, match="wait timeout"):
        store.wait(["never"], timedelta(milliseconds=300))
    assert store.check(["never"]) is False


def test_add_counts_from_zero_across_clients(store: Any, client: Callable[[], Any]) -> None:
    threads = [threading.Thread(target=client().add, args=("n", 1)) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10)
    assert store.add("n", 0) == 8
    assert store.add("n", -3) == 5


def test_compare_set_matches_tcpstore(store: Any) -> None:
    assert store.compare_set("c", "wrong", "x") == b"wrong"  # absent, expected given: unchanged
    assert store.check(["c"]) is False
    assert store.compare_set("c", "", "first") == b"first"  # absent, expected empty: created
    assert store.compare_set("c", "", "second") == b"first"  # present: the value it holds
    assert store.compare_set("c", "first", "third") == b"third"
    assert store.get("c") == b"third"


def test_delete_key(store: Any) -> None:
    store.set("gone", b"1")
    assert store.delete_key("gone") is True
    assert store.check(["gone"]) is False
    assert store.delete_key("gone") is False


def test_keys_of_one_job_are_apart_from_anothers(etcd: EtcdCluster) -> None:
    one = etcd_store(etcd.url, prefix="/apart-one/")
    other = etcd_store(etcd.url, prefix="/apart-other/")
    one.set("k", b"1")
    one.set("j", b"2")
    assert other.check(["k"]) is False
    assert (one.num_keys(), other.num_keys()) == (2, 0)
    assert sorted(one.list_keys()) == ["j", "k"]


def test_a_closed_client_ends_a_wait_in_progress_as_timed_out(etcd: EtcdCluster) -> None:
    # A connect given up on waits for a member that never comes: closing its client ends the
    # wait within a watch slice, not at the client's 30 s.
    store = etcd_store(etcd.url, prefix="/closed/", timeout=30)
    failed: list[BaseException] = []
    waiting = threading.Thread(target=lambda: _catch(failed, store.get, "never"), daemon=True)
    waiting.start()
    until(lambda: _in(waiting, "_watch_once"), "the get never started watching", timeout=5)
    store.close()
    waiting.join(5)
    assert not waiting.is_alive(), "the wait outlived its client's close"
    assert len(failed) == 1 and isinstance(failed[0], dist.DistStoreError), failed
    with pytest.raises(dist.DistStoreError):
        store.wait(["never"], timedelta(seconds=30))  # and any later wait, at once


def _in(thread: threading.Thread, function: str) -> bool:
    frame = sys._current_frames().get(thread.ident or 0)
    while frame is not None:
        if frame.f_code.co_name == function:
            return True
        frame = frame.f_back
    return False


def _catch(into: list[BaseException], call: Callable[..., Any], *args: Any) -> None:
    try:
        call(*args)
    except BaseException as exc:
        into.append(exc)


def test_a_dead_member_first_in_the_list_is_passed_over(etcd: EtcdCluster) -> None:
    [member] = etcd.members
    dead = ("127.0.0.1", closed_port())
    kv = EtcdKV([dead, (member.host, member.client_port)], prefix="/failover/", timeout=5)
    kv.put("k", b"v")
    assert kv.get("k") == b"v"


@pytest.fixture
def cut_member() -> Iterator[tuple[str, int]]:
    """A member killed as it answers: it reads each request, sends the head of a reply whose
    body is cut short, and closes the connection."""
    server = socket.create_server(("127.0.0.1", 0))
    server.settimeout(0.2)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.recv(65536)
                conn.sendall(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                    b'Content-Length: 100\r\n\r\n{"header": {'
                )

    thread = threading.Thread(target=serve, name="test-cut-member", daemon=True)
    thread.start()
    try:
        yield server.getsockname()[:2]
    finally:
        stop.set()
        thread.join(timeout=5)
        server.close()


def test_a_member_killed_as_it_answers_is_passed_over(
    etcd: EtcdCluster, cut_member: tuple[str, int]
) -> None:
    [member] = etcd.members
    kv = EtcdKV([cut_member, (member.host, member.client_port)], prefix="/cut/", timeout=5)
    kv.put("k", b"v")
    assert kv.add("n", 1) == 1
    assert kv.get("k") == b"v"


def test_a_frozen_member_is_not_asked_first_again(etcd: EtcdCluster) -> None:
    # A member whose process is stopped: its kernel takes the connection, nobody answers. A
    # lease renewal bounded by one request's timeout fails there once; the next one must be
    # asked of a member that answers, or the lease expires while a quorum is up.
    [member] = etcd.members
    with socket.create_server(("127.0.0.1", 0)) as frozen:
        lease = EtcdKV([(member.host, member.client_port)], prefix="/f/").grant(5)
        kv = EtcdKV([frozen.getsockname()[:2], (member.host, member.client_port)], prefix="/f/")
        with pytest.raises(StoreUnreachableError):
            kv.keep_alive(lease, timeout=0.5)  # held by the frozen member (the first asked)
        began = time.monotonic()
        assert kv.keep_alive(lease, timeout=0.5)
        assert time.monotonic() - began < kv.request_timeout  # not held again


def test_a_lease_is_taken_for_expired_only_when_the_quorum_has_dropped_its_key(
    etcd: EtcdCluster,
) -> None:
    # A member stopped and run again answers a renewal from its own lease table (every lease
    # ran out while it was stopped) until it hears of the new leader: "expired" from one
    # member is no verdict; the node's key, read through the quorum, is.
    [member] = etcd.members
    kv = EtcdKV([(member.host, member.client_port)], prefix="/presence/")

    class Stale:
        def __getattr__(self, name: str) -> Any:
            return getattr(kv, name)

        def keep_alive(self, lease: int, *, timeout: float | None = None) -> bool:
            return False

    presence = NodePresence(Stale(), Node(1, "node1", (2, 3)), ttl_s=5)
    try:
        assert not presence.expired() and not presence.cut_off
        kv.revoke(presence.lease)  # the job's quorum lets it go: the key goes with it
        assert presence.expired()
        assert presence.cut_off == "this node's lease expired: the job declared it lost"
    finally:
        presence.close(leaving=False)


@pytest.fixture
def stale_leader() -> Iterator[tuple[str, int]]:
    """A member stopped while it led, running again: it answers as the leader of its old term,
    from its own lease table, in which every lease ran out while it was stopped."""

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            body = json.dumps({"result": {"header": {"raft_term": "1"}, "ID": "1"}}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, name="test-stale-leader", daemon=True)
    thread.start()
    try:
        yield server.server_address[:2]  # type: ignore[misc]
    finally:
        server.shutdown()
        server.server_close()


def test_a_reply_from_an_older_term_than_seen_is_no_answer(
    etcd: EtcdCluster, stale_leader: tuple[str, int]
) -> None:
    [member] = etcd.members
    kv = EtcdKV([(member.host, member.client_port), stale_leader], prefix="/term/")
    lease = kv.grant(5)  # the cluster's answer, of its current term (2 or more)
    kv._first = 1  # the next call starts at the member that was stopped while it led
    assert kv.keep_alive(lease, timeout=5)  # its "expired" is passed over for the quorum's word


def test_no_member_answering_is_a_bounded_typed_error() -> None:
    kv = EtcdKV([("127.0.0.1", closed_port())], prefix="/none/", timeout=0.5)
    with pytest.raises(StoreUnreachableError, match=r"did not store a key within 0\.5s"):
        kv.put("k", b"v")


@pytest.mark.parametrize(
    ("url", "endpoints"),
    [
        ("etcd://h1:2379,h2,h3:2380", [("h1", 2379), ("h2", 2379), ("h3", 2380)]),
        ("etcd://10.0.0.1", [("10.0.0.1", 2379)]),
    ],
)
def test_endpoints_are_parsed(url: str, endpoints: list[tuple[str, int]]) -> None:
    assert parse_endpoints(url) == endpoints


@pytest.mark.parametrize("url", ["http://h1:2379", "etcd://h1:port", "etcd://"])
def test_a_bad_store_url_is_a_config_error(url: str) -> None:
    with pytest.raises(ConfigError):
        parse_endpoints(url)


def test_without_the_client_the_error_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "etcd3gw", None)
    with pytest.raises(ConfigError, match=r"pip install 'tether\[etcd\]'"):
        EtcdKV([("127.0.0.1", 2379)], prefix="/x/")


def test_the_job_protocol_runs_unchanged_on_it(client: Callable[[], Any]) -> None:
    # Two launchers decide epoch 1 at once, each from its own node's view: one decision holds.
    proposals = [
        Decision(1, (0, 1, 2), dead={3: "signal SIGKILL"}),
        Decision(1, (0, 2, 3), dead={1: "no heartbeat for 2.0s"}),
    ]
    won: list[Decision] = []
    deciders = [
        threading.Thread(target=lambda d=d: won.append(Membership(client()).propose(d)))
        for d in proposals
    ]
    for t in deciders:
        t.start()
    for t in deciders:
        t.join(10)
    assert len(won) == 2 and won[0] == won[1] and won[0] in proposals, won
    assert Membership(client()).latest() == won[0]
    # A hang seen from two ranks is one alarm, which a third hears.
    first = AlarmBoard(client()).raise_alarm("hang", origin="rank 1", join=True)
    second = AlarmBoard(client()).raise_alarm("hang", origin="rank 3", join=True)
    assert second == first
    assert AlarmBoard(client()).wait(first.epoch, 5.0) == first


def test_launchers_and_workers_agree_on_one_fresh_prefix_per_start(etcd: EtcdCluster) -> None:
    server = new_store()
    args = {"host": "127.0.0.1", "port": server.port, "etcd": etcd.url, "job_id": "train"}
    first = [StoreAddress.agree(new_client(server), **args, attempt=0) for _ in range(3)]
    assert len(set(first)) == 1 and first[0].prefix.startswith("/tether/train/"), first
    again = StoreAddress.agree(new_client(server), **args, attempt=1)  # torchrun restarted it
    assert again.prefix != first[0].prefix
    plain = StoreAddress.agree(server, **{**args, "etcd": ""}, attempt=0)
    assert plain == StoreAddress("127.0.0.1", server.port) and plain.ports == {server.port}
    assert first[0].ports == {server.port, etcd.members[0].client_port}
    first[0].connect().set("k", b"v")
    assert again.connect().check(["k"]) is False


def new_client(server: Any) -> Any:
    return dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))


def revoked(watcher: NodePresence, node: Node) -> str:
    """Wait (10 s at most) until ``node``'s key is gone; why, as ``watcher`` reads it."""
    until(lambda: node.index not in watcher.present(), f"{node.host}'s lease was never revoked", 10)
    return watcher.why_lost(node)


PONG = b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}"


@contextlib.contextmanager
def answering(
    listener: socket.socket, *, answers: bool = True, on_ping: Callable[[], Any] | None = None
) -> Iterator[threading.Semaphore]:
    """node1's launcher, on a thread of its own until the block ends: accept every connection
    ``listener`` gets and answer its ping (``answers``), or hold it unanswered (a stopped
    launcher: its kernel took the connection). Each connection accepted calls ``on_ping``, then
    releases the semaphore yielded."""
    accepted = threading.Semaphore(0)
    accepting = threading.Event()
    accepting.set()
    listener.settimeout(0.05)
    held: list[socket.socket] = []

    def accept() -> None:
        while accepting.is_set():
            with contextlib.suppress(OSError):
                conn = listener.accept()[0]
                if answers:
                    with conn:
                        conn.settimeout(1)
                        conn.recv(4096)
                        conn.sendall(PONG)
                else:
                    held.append(conn)
                if on_ping is not None:
                    on_ping()
                accepted.release()

    server = threading.Thread(target=accept, name="test-node1-launcher", daemon=True)
    server.start()
    try:
        yield accepted
    finally:
        accepting.clear()
        server.join(timeout=5)
        for conn in held:
            conn.close()
    assert not server.is_alive()


def test_a_node_whose_launcher_is_gone_is_evicted_by_the_one_before_it(
    etcd: EtcdCluster,
) -> None:
    # node1's launcher listens, then is gone (its port refuses): node0, which watches the next
    # node round the ring, revokes node1's lease at once and says why; while node1's launcher
    # listened, nothing happened to it, even for several watch periods.
    [member] = etcd.members
    kv = EtcdKV([(member.host, member.client_port)], prefix="/evict/")
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    node1 = NodePresence(kv, Node(1, "node1", (2, 3), "127.0.0.1", port), ttl_s=30)
    node0 = NodePresence(kv, Node(0, "node0", (0, 1), "127.0.0.1", closed_port()), ttl_s=30)
    try:
        seen = node0.present()
        assert set(seen) == {0, 1} and seen[1].port == port and seen[1].lease == node1.lease
        with answering(listener) as accepted:
            for _ in range(5):  # node0 watched node1 five times, answered: its lease stays
                assert accepted.acquire(timeout=10), "node0 does not watch node1"
            assert set(node0.present()) == {0, 1}
        listener.close()
        assert revoked(node0, seen[1]) == (
            f"its launcher is gone (node0 found nothing listening at 127.0.0.1:{port})"
        )
        assert node0.why_lost(seen[0]) == "its lease expired", "no eviction: its lease's word"
    finally:
        listener.close()
        node0.close(leaving=False)
        node1.close(leaving=False)


def test_a_frozen_node_is_evicted_once_its_workers_stop_beating_too(etcd: EtcdCluster) -> None:
    # node1's host takes connections but its launcher answers no ping (stopped). Its workers
    # never beat yet: a node starting, left to its lease. Its workers beat between the pings: a
    # slow launcher on a live node, left too. Once they stop beating, node0 revokes its lease
    # (30 s: not its expiry) within a second, naming why.
    [member] = etcd.members
    kv = EtcdKV([(member.host, member.client_port)], prefix="/frozen/")
    listener = socket.create_server(("127.0.0.1", 0), backlog=64)
    port = listener.getsockname()[1]
    node1 = NodePresence(kv, Node(1, "node1", (2, 3), "127.0.0.1", port, "t"), ttl_s=30)
    node0 = NodePresence(kv, Node(0, "node0", (0, 1), "127.0.0.1", closed_port()), ttl_s=30)
    workers_beat = threading.Event()

    def beat() -> None:
        if workers_beat.is_set():
            kv.add("tether/elastic/hb/3", 1)

    try:
        seen = node0.present()
        with answering(listener, answers=False, on_ping=beat) as asked:
            for beating in (False, True):  # each phase outlasts FROZEN_S
                if beating:
                    workers_beat.set()
                for _ in range(2 + int(FROZEN_S / (3 * WATCH_S))):
                    assert asked.acquire(timeout=10), "node0 does not watch node1"
                assert set(node0.present()) == {0, 1}, f"evicted (workers beating: {beating})"
            workers_beat.clear()
            why = revoked(node0, seen[1])
        assert why.startswith(
            "frozen: its host takes connections, but neither its launcher nor its workers have "
            "answered for "
        ), why
        assert why.endswith(f"s (node0 pinged 127.0.0.1:{port})"), why
    finally:
        listener.close()
        node0.close(leaving=False)
        node1.close(leaving=False)


def test_a_node_that_stops_answering_is_evicted_by_the_one_before_it(
    etcd: EtcdCluster,
) -> None:
    # node1's address stops answering connections at all (its host down, its link cut): a
    # listener whose one-connection backlog is held full drops every new connection's SYN, as
    # a host gone does. node0 revokes node1's lease without waiting for it (30 s), naming why;
    # while node1 answered, nothing happened to it.
    [member] = etcd.members
    kv = EtcdKV([(member.host, member.client_port)], prefix="/unanswered/")
    listener = socket.create_server(("127.0.0.1", 0), backlog=0)
    port = listener.getsockname()[1]
    node1 = NodePresence(kv, Node(1, "node1", (2, 3), "127.0.0.1", port), ttl_s=30)
    node0 = NodePresence(kv, Node(0, "node0", (0, 1), "127.0.0.1", closed_port()), ttl_s=30)
    held: list[socket.socket] = []
    try:
        seen = node0.present()
        assert set(seen) == {0, 1} and seen[1].port == port
        with answering(listener) as accepted:
            for _ in range(8):  # node0 watched node1 eight times, answered: its lease stays
                assert accepted.acquire(timeout=10), "node0 does not watch node1"
            assert set(node0.present()) == {0, 1}
        while True:  # fill the backlog: from now on nothing answers there
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=0.2))
            except OSError:
                break
        why = revoked(node0, seen[1])
        assert why.startswith(
            f"unreachable: its host down or its link cut (node0 had no answer from "
            f"127.0.0.1:{port} for "
        ), why
    finally:
        for sock in held:
            sock.close()
        listener.close()
        node0.close(leaving=False)
        node1.close(leaving=False)
