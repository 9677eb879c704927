"""The node's alarm relay (tether.job.relay): the agent's end sends each alarm to every rank
connected, and the last ones to a rank that connects late; a rank's responder answers what the
relay brings without a request to the store while no alarm is raised, looks in the store itself
once the agent lets go of it, and stops once the agent died. An elastic worker's membership
connection beats to the agent and hears the decisions; the agent's look reads one counter until
there is news."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from tests._jobs import until
from tests.watchdog.test_alarm import responder_on
from tether._exceptions import AgentGoneError, StoreUnreachableError
from tether.job.alarm import Alarm, AlarmBoard
from tether.job.elastic import Decision, Membership
from tether.job.relay import HISTORY, AlarmLook, MemberLink, RelayClient, RelayServer, relay_name
from tether.testing.stores import CountingStore
from tether.watchdog.responder import ORPHANED_EXIT_CODE

pytestmark = [pytest.mark.timeout(30), pytest.mark.every_torch]


@pytest.fixture
def server() -> Iterator[RelayServer]:
    relay = RelayServer(relay_name())
    yield relay
    relay.close()


def alarm(epoch: int) -> Alarm:
    return Alarm(epoch, f"20261207T000000.00000{epoch}Z-hang", "hang", origin="rank 3")


def test_every_rank_connected_gets_each_alarm_and_a_late_one_the_last(
    server: RelayServer,
) -> None:
    early = [RelayClient.connect(server.name) for _ in range(3)]
    try:
        server.send(alarm(1))
        assert [c.next(5.0) for c in early] == [alarm(1)] * 3
        assert early[0].next(0.05) is None, "nothing more"
        for epoch in range(2, HISTORY + 3):
            server.send(alarm(epoch))
        late = RelayClient.connect(server.name)
        got = [late.next(5.0) for _ in range(HISTORY)]
        assert [a.epoch for a in got if a is not None] == list(range(3, HISTORY + 3))
        late.close()
    finally:
        for c in early:
            c.close()


def test_a_rank_hears_its_agent_end_whatever_ended_it(server: RelayServer) -> None:
    client = RelayClient.connect(server.name)
    until(lambda: server.connected == 1, "the rank never connected", timeout=10.0)
    server.close()
    with pytest.raises(AgentGoneError, match="closed the relay"):
        client.next(5.0)
    with pytest.raises(OSError):
        RelayClient.connect(server.name)  # nobody listens there any more

    # An agent killed outright: the kernel closes its end.
    name = relay_name()
    agent = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"from tether.job.relay import RelayServer; RelayServer({name!r})"
            "; print('ready', flush=True); import time; time.sleep(60)",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert agent.stdout is not None and agent.stdout.readline() == "ready\n"
        killed = RelayClient.connect(name)
        agent.kill()
        with pytest.raises(AgentGoneError):
            killed.next(5.0)
        killed.close()
    finally:
        agent.kill()
        agent.wait(10)


def test_what_is_no_alarm_ends_the_relay_for_the_rank() -> None:
    name = relay_name()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as fake:
        fake.bind("\0" + name)
        fake.listen(1)
        client = RelayClient.connect(name)
        conn, _ = fake.accept()
        conn.sendall(b'{"epoch": "one"}\n')
        with pytest.raises(AgentGoneError, match="not an alarm"):
            client.next(5.0)
        conn.close()
        client.close()


def test_a_full_rank_is_dropped_and_the_others_still_hear(server: RelayServer) -> None:
    stuck = RelayClient.connect(server.name)  # never reads
    fine = RelayClient.connect(server.name)
    big = Alarm(1, "20261207T000000.000001Z-hang", "hang", origin="x", detail="d" * 60_000)
    try:
        for epoch in range(1, 40):  # ~2.4 MB: past what the kernel buffers for a socket
            server.send(Alarm(epoch, big.event_id, "hang", origin="x", detail=big.detail))
            got = fine.next(5.0)
            assert got is not None and got.epoch == epoch
        assert server.connected == 1, "the rank that reads nothing was dropped"
    finally:
        stuck.close()
        fine.close()


def test_a_rank_under_an_agent_asks_the_store_nothing_until_an_alarm(
    server: RelayServer, tmp_path: Path
) -> None:
    store = CountingStore(dist.HashStore())
    board = AlarmBoard(store)  # type: ignore[arg-type]
    dumped: list[Alarm] = []
    r = responder_on(board, tmp_path, dumped, world_size=2, relay=server.name)
    r.start()
    try:
        until(lambda: r.alarm_source == "agent", "it never reached its agent", timeout=10.0)
        settled = dict(store.counts)
        threading.Event().wait(1.0)  # ten looks, were it looking in the store itself
        assert dict(store.counts) == settled, "no request to the store while nothing happens"
        raised = AlarmBoard(dist.HashStore()).raise_alarm("manual", origin="cli")
        server.send(raised)
        assert r.wait_answered(0, 10.0)
        assert [a.event_id for a in dumped] == [raised.event_id]
        assert store.counts["set"] == 1, "its part marked done in the store, and that is all"
    finally:
        r.close()


def test_a_rank_whose_agent_is_gone_looks_in_the_store_itself(
    server: RelayServer, tmp_path: Path
) -> None:
    board = AlarmBoard(dist.HashStore())
    dumped: list[Alarm] = []
    r = responder_on(board, tmp_path, dumped, world_size=2, relay=server.name)
    r.start()
    try:
        until(lambda: server.connected == 1, "the rank never connected", timeout=10.0)
        server.close()
        raised = board.raise_alarm("manual", origin="cli")
        assert r.wait_answered(0, 10.0), "answered from the store"
        assert [a.event_id for a in dumped] == [raised.event_id]
    finally:
        r.close()


@pytest.mark.timeout(90)
def test_a_rank_whose_agent_died_stops_saying_so() -> None:
    """``tether run`` killed (SIGKILL, the OOM killer): its ranks are orphans that nothing would
    end, restart or report; each stops on a clear error. A rank whose agent let go of it (the
    test above) looks in the store instead."""
    run = subprocess.run(
        [sys.executable, "-m", "tests.watchdog._orphan", "harness"],
        capture_output=True,
        text=True,
        timeout=80,
        cwd=Path(__file__).parents[2],
    )
    assert f"rank exit {ORPHANED_EXIT_CODE}" in run.stdout, run.stdout + run.stderr
    assert "[rank 1] tether: this node's tether run is gone" in run.stderr, run.stderr


def test_a_member_beats_to_its_agent_and_hears_each_decision_once(server: RelayServer) -> None:
    early = Decision(1, (0, 1, 3), dead={2: "signal SIGKILL"})
    server.send_decision(early)
    listener = RelayClient.connect(server.name)  # a rank's alarm connection: no decisions
    member = MemberLink.join(server.name, 2)
    sent = 0

    def beat() -> list[Decision]:
        nonlocal sent
        sent += 1
        return member.beat()

    try:
        assert until(lambda: beat() or None, "the newest decision never came") == [early]
        for _ in range(5):
            assert beat() == []
        until(lambda: server.beats(2) == sent, "each beat counted once", timeout=10.0)
        assert server.beats(7) is None, "a rank that never joined here: its launcher asks the store"
        later = Decision(2, (0, 1, 2, 3), joined=(2,), fresh=(2,))
        server.send_decision(later)
        server.send_decision(early)  # older than what was sent: nothing
        assert until(lambda: beat() or None, "the next decision never came") == [later]
        server.send_lost("the look failed")
        with pytest.raises(StoreUnreachableError, match="the look failed"):
            until(lambda: beat() or None, "the store's loss was never told")
    finally:
        member.close()
    until(lambda: server.beats(2) is None, "a member that left is the store's again", timeout=10.0)
    # A member's connection as the agent's end sees it: after its first line, no alarm comes.
    raw = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    raw.connect("\0" + server.name)
    raw.settimeout(5.0)
    lines = raw.makefile("rb")

    def next_line() -> dict[str, Any]:
        got = json.loads(lines.readline())
        assert isinstance(got, dict)
        return got

    try:
        raw.sendall(b'{"member": 4}\n')
        assert next_line()["decision"]["epoch"] == 2, "the newest decision as it joins"
        server.send(alarm(1))
        assert listener.next(5.0) == alarm(1), "alarms go to the ranks' connections"
        server.send_decision(Decision(3, (0, 1, 2, 3)))
        assert next_line()["decision"]["epoch"] == 3, "and not to the members'"
        assert listener.next(0.05) is None, "decisions never reach a rank's connection"
    finally:
        lines.close()
        raw.close()
        listener.close()


def test_a_member_hears_its_agent_gone_and_a_line_that_is_no_decision() -> None:
    name = relay_name()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listening:
        listening.bind("\0" + name)
        listening.listen(1)
        member = MemberLink.join(name, 0)
        conn, _ = listening.accept()
        assert conn.recv(100) == b'{"member": 0}\n'
        conn.sendall(b'{"decision": {"epoch": "x"}}\n')
        with pytest.raises(AgentGoneError, match="not a decision"):
            until(lambda: member.beat() or None, "the bad line was never read")
        member.close()
        member = MemberLink.join(name, 0)
        conn2, _ = listening.accept()
        conn2.close()
        with pytest.raises(AgentGoneError, match=r"closed the relay|connection failed"):
            until(lambda: member.beat() or None, "the close was never seen")
        member.close()
        conn.close()


def test_the_node_look_reads_one_counter_until_there_is_news() -> None:
    store = CountingStore(dist.HashStore())
    board = AlarmBoard(store)  # type: ignore[arg-type]
    found: list[Alarm] = []
    look = AlarmLook(board, epoch=1, found=found.append, every=0.02)
    look.start()
    try:
        until(lambda: look.news == 0, "the look never read the news counter", timeout=10.0)
        total, adds = store.total(), store.counts["add"]
        until(lambda: store.counts["add"] >= adds + 10, "ten more looks", timeout=10.0)
        assert store.total() - total == store.counts["add"] - adds, "each look one read"
        store.inner.set(board.key(1), b"not an alarm")  # someone else's key: passed over
        AlarmBoard(store.inner).raise_alarm("manual", origin="cli", start=1)
        until(lambda: found, "the alarm behind the bad key was never found", timeout=10.0)
        assert [a.epoch for a in found] == [2] and look.news == 1
        Membership(store.inner).propose(Decision(1, (0,)))
        until(lambda: look.news == 2, "a decision moves the counter too", timeout=10.0)
    finally:
        look.close()
