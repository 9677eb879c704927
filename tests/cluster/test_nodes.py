"""A job's nodes: their keys in a real TCPStore, their beats, and the watch over them."""

from __future__ import annotations

import dataclasses
import socket
from pathlib import Path

import pytest
import torch.distributed as dist

from tests._jobs import until
from tether.job.alarm import AlarmBoard
from tether.job.client import StoreAddress
from tether.job.nodes import FROZEN_S, SILENT_S, BeatPort, NodeInfo, NodeWatch
from tether.job.relay import AlarmLook
from tether.launcher.cluster import Cluster

INFO = NodeInfo(
    node=0, host="node0", address="10.0.0.1", port=1, token="t", ranks=(0, 1), pid=1, dump_dir="/d"
)


def test_a_silent_node_is_probed_and_judged_by_how_its_launcher_answers() -> None:
    watch = NodeWatch()
    assert watch.silent({1: 5, 2: 5, 3: 5}, now=0.0) == []
    assert set(watch.heard) == {1, 2, 3}
    assert watch.silent({1: 6, 2: 5, 3: 5}, now=SILENT_S - 0.1) == []  # not silent long enough
    assert watch.silent({1: 7, 2: 5, 3: 5}, now=SILENT_S) == [2, 3]
    assert watch.probed(2, "alive", now=SILENT_S) is None  # late, not gone: silent again later
    assert watch.silent({1: 8, 2: 5, 3: 5}, now=SILENT_S + 0.5) == [3]
    assert watch.probed(3, "frozen", now=SILENT_S) is None
    assert watch.probed(3, "frozen", now=FROZEN_S - 0.1) is None
    assert watch.probed(3, "frozen", now=FROZEN_S) == "frozen"
    assert watch.probed(2, "gone", now=2 * SILENT_S) == "lost"
    assert watch.probed(1, "unreachable", now=2 * SILENT_S) == "unreachable"


def test_a_node_that_beats_again_is_no_longer_counted_silent() -> None:
    watch = NodeWatch()
    watch.silent({4: 1}, now=0.0)
    assert watch.silent({4: 1}, now=SILENT_S) == [4]
    assert watch.probed(4, "frozen", now=SILENT_S) is None
    assert watch.silent({4: 2}, now=SILENT_S + 0.2) == []  # thawed
    # Its frozen time starts again from its next silence, not from the first one.
    assert watch.silent({4: 2}, now=2 * SILENT_S + 0.2) == [4]
    assert watch.probed(4, "frozen", now=FROZEN_S + 0.5) is None


def test_a_node_that_answered_its_probe_is_frozen_only_after_a_whole_silence_since() -> None:
    watch = NodeWatch()
    watch.silent({5: 1}, now=0.0)  # its beats never move again (blocked on their way)
    assert watch.silent({5: 1}, now=SILENT_S) == [5]
    assert watch.probed(5, "frozen", now=SILENT_S) is None  # one slow answer
    assert watch.probed(5, "alive", now=SILENT_S + 0.5) is None
    later = FROZEN_S + 5.0
    assert watch.silent({5: 1}, now=later) == [5]
    assert watch.probed(5, "frozen", now=later) is None  # not frozen since the first slow one
    assert watch.probed(5, "frozen", now=later + FROZEN_S - SILENT_S) == "frozen"


def test_beats_reach_the_assembler_only_from_nodes_that_know_their_key() -> None:
    assembler = BeatPort("127.0.0.1", "key-0")
    one, two = BeatPort("127.0.0.1", "key-1"), BeatPort("127.0.0.1", "key-2")
    keys = {1: "key-1", 2: "key-2"}
    to = dataclasses.replace(INFO, address="127.0.0.1", beat_port=assembler.port)
    try:
        assembler.take(keys.get)
        for _ in range(3):
            one.send(1, to)
        two.send(1, to)  # node 2's key, node 1's name: not a beat of node 1
        two.send(3, to)  # a node the assembler does not know
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as raw:
            raw.sendto(b"1 99 not-a-mac", ("127.0.0.1", assembler.port))
            raw.sendto(b"garbage", ("127.0.0.1", assembler.port))
        two.send(2, to)  # its third datagram: count 3
        counts = until(
            lambda: (c := assembler.counts([1, 2, 3]))[2] and c, "node 2's beat never came", 10
        )
        assert counts == {1: 3, 2: 3, 3: 0}
        again = BeatPort("127.0.0.1", "key-1")  # node 1's key: a replayed, older count
        again.send(1, to)
        again.close()
        two.send(2, to)  # after it, on the same queue: count 4
        until(lambda: assembler.counts([2])[2] == 4, "node 2's fourth beat never came", 10)
        assert assembler.counts([1]) == {1: 3}
        one.send(1, dataclasses.replace(to, beat_port=0))  # takes no beats: nothing sent
        one.send(1, to)
        assert until(lambda: assembler.counts([1])[1] == 4, "node 1's fourth beat never came", 10)
    finally:
        for port in (assembler, one, two):
            port.close()


@pytest.mark.timeout(60)
def test_a_node_whose_look_answers_beats_to_the_assembler_not_to_the_store(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    address = StoreAddress("127.0.0.1", store.port)
    clusters = [
        Cluster(
            address, attempt=0, node=n, nodes=2, ranks=[n], dump_dir=tmp_path / str(n),
            running=lambda: True, host=f"node{n}",
        )
        for n in (0, 1)
    ]  # fmt: skip
    look = AlarmLook(AlarmBoard(address.connect()), epoch=1, found=lambda alarm: None)
    beat_key = "tether/node/0/1/beat"
    try:
        look.start()
        clusters[1].follow(look)
        # Shorter than the beats watched below: the look's answers must stand for the store's.
        clusters[1].cut_off_s = 1.5
        assembler = clusters[0]
        moves: list[int] = []

        def moved(times: int) -> bool:  # each move a beat later: 0.25 s at least
            heard = assembler.heard.get(1)
            if heard is not None and moves[-1:] != [heard]:
                moves.append(heard)
            return len(moves) >= times

        # Two beats heard: a beat begun before it followed the look has ended by then.
        until(lambda: moved(2), "the assembler did not hear node 1 beat", 30)
        before = int(store.add(beat_key, 0))
        until(lambda: moved(8), "the assembler did not hear node 1 beat eight times", 30)
        assert int(store.add(beat_key, 0)) == before  # every beat went to the assembler
        assert not clusters[1].store_gone()
        look.close()  # as the launcher's watch closes before its cluster: the last answer stands
        assert not clusters[1].store_gone()
        # No look: the node beats to the store itself again.
        until(lambda: int(store.add(beat_key, 0)) > before, "node 1 never beat to the store", 30)
        assert not clusters[1].store_gone()
    finally:
        look.close()
        for cluster in clusters:
            cluster.close(ended="")


def test_a_round_probes_only_the_silent_nodes_that_did_not_end() -> None:
    watch = NodeWatch()
    watch.judge({1: 1, 2: 1, 3: 1}, 0.0, ended=lambda n: False, probe=lambda n: "alive")
    probed: list[int] = []

    def probe(node: int) -> str:
        probed.append(node)
        return "gone"

    got = watch.judge({1: 2, 2: 1, 3: 1}, SILENT_S, ended=lambda n: n == 3, probe=probe)
    assert got == [(2, "gone", "lost")] and probed == [2]
