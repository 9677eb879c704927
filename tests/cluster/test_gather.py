"""A job on several nodes, piece by piece in one process: the event port that brings each node's
part of an event to one place (its token, what it refuses, what it never overwrites), and the
analyzer on events whose parts came from several hosts."""

from __future__ import annotations

import dataclasses
import io
import json
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests._fr_synth import Synth
from tether.analyze import analyze
from tether.events.layout import nodes_file
from tether.launcher import gather
from tether.launcher.gather import EventPort, _request, probe, send_part

pytestmark = pytest.mark.timeout(60)
EVENT = "20260101T000000.000000Z-hang"


@pytest.fixture
def port(tmp_path: Path) -> Iterator[EventPort]:
    port = EventPort(tmp_path / "head", node=0, host="node0", address="127.0.0.1")
    yield port
    port.close()


def _part(tmp_path: Path, files: dict[str, bytes]) -> Path:
    event_dir = tmp_path / "node1" / EVENT
    event_dir.mkdir(parents=True)
    for name, data in files.items():
        (event_dir / name).write_bytes(data)
    return event_dir


def test_a_part_is_written_once_and_what_the_receiver_has_is_not_sent_again(
    port: EventPort, tmp_path: Path
) -> None:
    head = tmp_path / "head" / EVENT
    head.mkdir(parents=True)
    (head / "rank_2").write_bytes(b"the receiver's own")  # a shared filesystem: already there
    part = _part(tmp_path, {"rank_2": b"node1's copy", "rank_3": b"three", "stacks_3.txt": b"s"})
    into, written = send_part(part, port.info(ranks=[0, 1]), node=1)
    assert (into, sorted(written)) == (EVENT, ["rank_3", "stacks_3.txt"])
    assert (head / "rank_2").read_bytes() == b"the receiver's own"
    assert (head / "rank_3").read_bytes() == b"three"
    got = port.wait_parts(EVENT, [1], timeout=5)
    assert sorted(got[1].names) == ["rank_2", "rank_3", "stacks_3.txt"]


def test_the_port_asks_for_the_token(port: EventPort, tmp_path: Path) -> None:
    part = _part(tmp_path, {"rank_2": b"x"})
    wrong = dataclasses.replace(port.info(ranks=[0]), token="not the token")
    with pytest.raises(OSError, match="403"):
        send_part(part, wrong, node=1)
    assert not (tmp_path / "head" / EVENT / "rank_2").exists()
    assert probe(port.info(ranks=[0])) == "alive"


def test_a_tar_naming_a_path_outside_the_event_is_refused(port: EventPort, tmp_path: Path) -> None:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("../escape")
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    with pytest.raises(OSError, match="400"):
        _request(
            port.info(ranks=[0]), "PUT", f"/event/{EVENT}", body=buf.getvalue(), timeout=5,
            headers={"X-Tether-Node": "1"},
        )  # fmt: skip
    assert not (tmp_path / "head" / "escape").exists()
    with pytest.raises(OSError, match="400"):  # an event id that is not a plain name
        _request(port.info(ranks=[0]), "GET", "/event/..", timeout=5)


def test_a_cut_off_nodes_part_joins_the_event_about_it(port: EventPort, tmp_path: Path) -> None:
    port.join(EVENT, node=1)
    own = tmp_path / "node1" / "20260101T000001.000000Z-cut_off"
    own.mkdir(parents=True)
    (own / "rank_2").write_bytes(b"two")
    into, _ = send_part(own, port.info(ranks=[0]), node=1, cut_off=True)
    assert into == EVENT
    assert (tmp_path / "head" / EVENT / "rank_2").read_bytes() == b"two"


def test_two_survivors_cut_off_at_once_make_one_event_whoever_decides_first(
    port: EventPort, tmp_path: Path
) -> None:
    # Node 2 lost the store first and sent its own event here before this node (node 1 of the
    # survivors, which assembles) decided: this node takes that event for its own...
    theirs = tmp_path / "node2" / "20260101T000001.000000Z-cut_off"
    theirs.mkdir(parents=True)
    (theirs / "rank_2").write_bytes(b"two")
    into, _ = send_part(theirs, port.info(ranks=[1]), node=2, cut_off=True)
    assert into == theirs.name
    assert port.adopt("20260101T000002.000000Z-cut_off") == theirs.name
    # ... and a later survivor's part goes into it too, whatever its own event's name.
    late = tmp_path / "node3" / "20260101T000003.000000Z-cut_off"
    late.mkdir(parents=True)
    (late / "rank_3").write_bytes(b"three")
    into, _ = send_part(late, port.info(ranks=[1]), node=3, cut_off=True)
    assert into == theirs.name
    assert sorted(p.name for p in (tmp_path / "head").iterdir()) == [theirs.name]
    assert sorted(port.wait_parts(theirs.name, [2, 3], timeout=5)) == [2, 3]


def test_a_survivor_that_decides_first_keeps_its_own_event(port: EventPort) -> None:
    mine = "20260101T000002.000000Z-cut_off"
    assert port.adopt(mine) == mine
    assert port.joined(2) == mine
    assert port.adopt("20260101T000009.000000Z-cut_off") == mine  # decided once


def test_a_node_that_misses_one_probe_is_asked_again_when_settling(
    port: EventPort, monkeypatch: pytest.MonkeyPatch
) -> None:
    # One SYN lost (resent after 1 s), or a loaded host's bridge late: one 0.5 s probe fails.
    real, calls = gather.ping_state, []

    def first_lost(address: str, port: int, token: str, timeout: float) -> str:
        calls.append(timeout)
        return "unreachable" if len(calls) == 1 else real(address, port, token, timeout)

    monkeypatch.setattr(gather, "ping_state", first_lost)
    info = port.info(ranks=[0])
    assert probe(info) == "unreachable"  # the watch's probe: one look
    calls.clear()
    assert probe(info, settle=gather.SETTLE_S) == "alive"
    assert calls[1] >= calls[0]  # asked again with a bound no shorter than the first
    port.close()
    assert probe(info, settle=gather.SETTLE_S) == "gone"  # refused: no need to ask again


def test_a_node_whose_part_is_missing_is_unreachable_not_dead(tmp_path: Path) -> None:
    job = Synth(world_size=4)
    job.collective("all_reduce")
    job.collective("all_reduce", skip=[2, 3])
    event = tmp_path / EVENT
    job.write(event, ranks=[0, 1])
    nodes = [
        {"node": 0, "host": "node0", "ranks": [0, 1], "part": "here"},
        {"node": 1, "host": "node1", "ranks": [2, 3], "part": "missing",
         "why": "node1 (ranks 2-3): its part could not be brought (unreachable)",
         "last_heard_ns": 1_700_000_000_000_000_000},
    ]  # fmt: skip
    nodes_file(event).write_text(json.dumps({"nodes": nodes}))
    d = analyze(event)
    assert d.verdict == "node_unreachable", d.evidence
    assert [(n.host, n.ranks) for n in d.nodes] == [("node1", [2, 3])]
    assert not any("died" in e for e in d.evidence), d.evidence
    assert any("could not be brought" in e for e in d.evidence)
