"""On etcd, a node's workers take turns to beat there (``_Heartbeat._node_beat``): one beat every
``NODE_BEAT_S`` for the whole node, each worker in its turn, whatever the node's size; each
worker's own beats go to its launcher. The frozen-node check reads these (tether.job.elastic's
``NodePresence``): a node of live workers must show a beat in every ``FROZEN_S``."""

from __future__ import annotations

from itertools import pairwise
from types import SimpleNamespace

import pytest

from tether.elastic import world as world_module
from tether.job.elastic import FROZEN_S

pytestmark = pytest.mark.timeout(30)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.mark.parametrize("per_node", [1, 4, 16])
def test_a_nodes_workers_take_turns_one_beat_a_turn_for_the_node(
    monkeypatch: pytest.MonkeyPatch, per_node: int
) -> None:
    clock = Clock()
    monkeypatch.setattr(world_module.time, "monotonic", clock)
    beats: list[tuple[float, int]] = []
    first = 3 * per_node  # the node's ranks: torchrun numbers them node by node
    workers = []
    for rank in range(first, first + per_node):
        hb = world_module._Heartbeat.__new__(world_module._Heartbeat)
        hb.world = SimpleNamespace(per_node=per_node, stable_rank=rank)  # type: ignore[assignment]
        hb._turn = -1
        store = SimpleNamespace(beat=lambda r: beats.append((clock.now, r)))
        hb._store = lambda store=store: store  # type: ignore[method-assign]
        workers.append(hb)
    seconds, period = 8.0, 0.1  # each worker's loop runs every 0.1 s
    for step in range(int(seconds / period)):
        clock.now = 1000.0 + step * period + 0.013 * (step % 3)  # loops are not in step
        for hb in workers:
            hb._node_beat()
    turns = seconds / world_module.NODE_BEAT_S
    assert turns - 1 <= len(beats) <= turns + 1, beats  # 4 a second for the node, not 10 each
    assert {r for _, r in beats} == set(range(first, first + per_node))
    times = [t for t, _ in beats]
    assert max(b - a for a, b in pairwise(times)) < FROZEN_S / 2
