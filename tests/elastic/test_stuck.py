"""When a worker gives up on an operation that a decision should have ended
(``World.give_up_if_stuck``): only when its training thread has stayed blocked, outside the
elastic world's own waits, in an operation issued on the connected group before the decision.
Leaving is the process's exit, so a false alarm costs a healthy rank: each condition is checked
here on its own, with a training thread blocked for real. (The whole path, in a real job:
``tests/elastic/test_elastic_integ.py``.)"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from tests._jobs import until
from tether.elastic import world as world_module
from tether.elastic.sockets import Connections
from tether.elastic.world import World
from tether.job.alarm import HANG_EXIT_CODE
from tether.job.elastic import Decision

pytestmark = pytest.mark.timeout(30)


class Exited(Exception):
    pass


def trainer(target: Callable[[], Any]) -> threading.Thread:
    """A training thread running ``target``."""
    thread = threading.Thread(target=target, name="trainer", daemon=True)
    thread.start()
    return thread


_HELD: list[threading.Event] = []
"""What the blocked training threads wait for: set once their test ends."""


@pytest.fixture(autouse=True)
def _release_blocked_threads() -> Iterator[None]:
    yield
    while _HELD:
        _HELD.pop().set()


def blocked() -> threading.Thread:
    """A training thread blocked in a C call (an event set only once the test ends), once it
    is."""
    held = threading.Event()
    _HELD.append(held)
    thread = trainer(held.wait)

    def waiting() -> bool:
        frame = sys._current_frames().get(thread.ident or 0)
        return frame is not None and frame.f_code.co_name == "wait"

    until(waiting, "the training thread never blocked", timeout=5)
    return thread


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    codes: list[int] = []

    def exit_(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(world_module.os, "_exit", exit_)
    monkeypatch.setattr(world_module, "STUCK_S", 0.0)  # the wait itself is not what is tested
    yield codes


def make_world(trainer: threading.Thread, op_created_ns: int | None) -> World:
    """A world of ranks 0 and 1, this worker rank 0, last connected at 1 ns; in flight in its
    recorder, an operation a failed attempt left unwaited before that, and one issued at
    ``op_created_ns`` (None: none)."""
    world = World.__new__(World)
    world.stable_rank = 0
    world.decision = world._newest = Decision(0, (0, 1))
    world._lock = threading.Lock()
    world._heard = threading.Condition(world._lock)
    world._lost = None
    world._connections = Connections({}, {}, set())
    world._trainer = trainer.ident or 0
    world._connected_ns = 1  # after an operation a failed attempt left unwaited
    world._broken = None
    group = SimpleNamespace(name="0", desc="default_pg")
    entry = SimpleNamespace(
        profiling_name="gloo:all_reduce",
        collective_seq_id=7,
        group=group,
        time_created_ns=op_created_ns,
    )
    older = SimpleNamespace(time_created_ns=0)
    world._in_flight = lambda: [older] if op_created_ns is None else [older, entry]  # type: ignore[assignment,list-item]
    return world


def rank_1_dies(world: World) -> None:
    world._hear(Decision(1, (0,), dead={1: "signal SIGKILL"}))


def broken(op_created_ns: int | None, *, connected_ns: int = 1) -> World:
    """A world whose training thread is blocked, once rank 1's death has been heard."""
    world = make_world(blocked(), op_created_ns)
    world._connected_ns = connected_ns
    rank_1_dies(world)
    return world


def looks(world: World, times: int = 5) -> None:
    """The heartbeat's looks, ``times`` of them (the first only notes where the thread is; the
    wait itself is 0 s here)."""
    for _ in range(times):
        world.give_up_if_stuck()


def test_a_training_thread_blocked_in_an_operation_issued_before_the_decision_leaves(
    exits: list[int],
) -> None:
    world = broken(time.time_ns())
    with pytest.raises(Exited):
        looks(world, times=2)
    assert exits == [HANG_EXIT_CODE]


def test_a_training_thread_blocked_when_the_store_is_lost_leaves(exits: list[int]) -> None:
    # The store's host gone, the training thread would raise at its next call into the world;
    # one blocked in an operation never makes it there.
    world = make_world(blocked(), time.time_ns())
    world._lose(ConnectionRefusedError("nothing answers at the job's store address"))
    with pytest.raises(Exited):
        looks(world, times=2)
    assert exits == [HANG_EXIT_CODE]
    assert world._broken is not None and world._broken.cause == "the job's store's loss"


def test_an_operation_issued_after_the_decision_is_not_the_decision_s_to_end(
    exits: list[int],
) -> None:
    world = broken(time.time_ns() + 10**12)
    looks(world)
    assert exits == []


def test_an_operation_from_before_the_last_regroup_never_counts(exits: list[int]) -> None:
    # One a failed attempt left unwaited (gloo's reduce_scatter in torch 2.13 never says it ended).
    world = broken(2, connected_ns=3)
    looks(world)
    assert exits == []


def test_nothing_in_flight_is_nothing_to_give_up_on(exits: list[int]) -> None:
    world = broken(None)
    looks(world)
    assert exits == []


def test_a_decision_that_breaks_nothing_here_starts_no_wait(exits: list[int]) -> None:
    world = make_world(blocked(), op_created_ns=time.time_ns())
    world._hear(Decision(1, (0, 1, 2), joined=(2,)))  # an admission: the group is whole
    looks(world)
    assert exits == []


def test_a_training_thread_waiting_in_the_world_s_own_calls_is_not_stuck(
    exits: list[int],
) -> None:
    # After a failed collective it waits for the decision, or regroups: the world's own waits.
    holder: list[World] = []
    go = threading.Event()

    def wait_for_a_decision() -> None:
        go.wait(5)
        holder[0].wait_newer(1, 20.0)  # blocks inside world.py until epoch 2

    thread = trainer(wait_for_a_decision)
    world = make_world(thread, op_created_ns=time.time_ns())
    holder.append(world)
    go.set()
    until(
        lambda: world_module._here(sys._current_frames().get(thread.ident or 0)),
        "the training thread never waited in the world",
        timeout=5,
    )
    rank_1_dies(world)
    try:
        looks(world)
        assert exits == []
    finally:
        world._hear(Decision(2, (0,)))  # releases the thread
        thread.join(5)


def test_a_thread_that_moved_since_the_last_look_starts_the_wait_again(
    exits: list[int],
) -> None:
    world = broken(time.time_ns())
    world.give_up_if_stuck()  # the first look only notes where the thread is
    assert world._broken is not None
    world._broken.where = None  # as if it had been elsewhere at that look
    world.give_up_if_stuck()
    assert exits == []
    with pytest.raises(Exited):
        world.give_up_if_stuck()  # the same place twice: blocked
