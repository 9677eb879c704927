"""The elastic launcher's poll against torch's own failure capture, with real worker processes and
a real TCPStore: which exits torch may see, decided deterministically (the integration tests in
test_elastic_integ.py meet these orders only by chance)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
import types
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.api import SubprocessContext

from tests._jobs import until
from tether._exceptions import ConfigError
from tether.config import Config
from tether.job.alarm import AlarmBoard
from tether.job.client import StoreAddress
from tether.job.elastic import Decision, Membership
from tether.job.relay import AlarmLook, MemberLink, RelayServer, relay_name
from tether.launcher.elastic import ElasticLauncher, rejoining
from tether.launcher.teardown import JobView
from tether.testing.stores import CountingStore

pytestmark = [pytest.mark.timeout(60), pytest.mark.every_torch]
WORLD = 4


class FakeContext:
    """The part of torch's SubprocessContext the launcher uses, with torch's own capture."""

    def __init__(self, procs: dict[int, subprocess.Popen[bytes]]) -> None:
        self.subprocess_handlers = {r: types.SimpleNamespace(proc=p) for r, p in procs.items()}
        self._running_local_ranks = set(procs)
        self._failures: dict[int, Any] = {}
        self.error_files = dict.fromkeys(procs, "")
        self._capture_process_failures = types.MethodType(
            SubprocessContext._capture_process_failures, self
        )


@pytest.fixture
def job(tmp_path: Path) -> Iterator[tuple[FakeContext, Any]]:
    store = dist.TCPStore(  # type: ignore[attr-defined]
        "127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=5)
    )
    procs = {
        r: subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True
        )
        for r in range(WORLD)
    }
    try:
        yield FakeContext(procs), store
    finally:
        for p in procs.values():
            p.kill()
            p.wait(timeout=10)


def launcher(
    pcontext: FakeContext,
    store: Any,
    tmp_path: Path,
    rejoining: dict[int, int] | None = None,
    **config: Any,
) -> ElasticLauncher:
    workers = [
        types.SimpleNamespace(local_rank=r, global_rank=r, world_size=WORLD) for r in range(WORLD)
    ]
    view = JobView(StoreAddress("127.0.0.1", int(store.port)), WORLD, {})
    return ElasticLauncher(
        pcontext,
        types.SimpleNamespace(workers=workers),
        lambda: view,
        config=Config(elastic=True, **config),
        dump_dir=tmp_path,
        rejoining=rejoining,
    )


def die(proc: subprocess.Popen[bytes]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)


def test_a_death_during_the_previous_ones_alarm_is_the_next_polls(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    pcontext, store = job
    elastic = launcher(pcontext, store, tmp_path, max_replacements=0)
    procs = {r: h.proc for r, h in pcontext.subprocess_handlers.items()}
    die(procs[3])
    # Rank 1 dies after the poll looked at it, while rank 3's alarm goes out (CI saw this order:
    # torch then counted rank 1 as a failure and tore the job down).
    elastic._dump = lambda dead, **_: die(procs[1])  # type: ignore[method-assign]
    done: set[int] = set()
    pcontext._capture_process_failures(done)
    assert pcontext._failures == {}
    assert done == set()
    membership = Membership(store)
    latest = membership.latest()
    assert latest is not None and latest.members == (0, 1, 2)
    assert elastic.retired == {3}

    pcontext._capture_process_failures(done)  # the next poll hears rank 1
    assert pcontext._failures == {}
    latest = membership.latest()
    assert latest is not None and (latest.epoch, latest.members) == (2, (0, 2))
    assert elastic.retired == {1, 3}
    assert pcontext._running_local_ranks == {0, 2}


def stopped(job: tuple[FakeContext, Any], tmp_path: Path) -> ElasticLauncher:
    """Rank 2 dies in a job that needs every rank: the job stops (a decision in the store), and
    torch sees no exit yet, not even rank 2's: it would end the survivors at once."""
    pcontext, store = job
    elastic = launcher(pcontext, store, tmp_path, min_world_size=WORLD)
    elastic._dump = lambda dead, **_: None  # type: ignore[method-assign]
    die(pcontext.subprocess_handlers[2].proc)
    done: set[int] = set()
    pcontext._capture_process_failures(done)
    latest = Membership(store).latest()
    assert elastic.stopped and latest is not None and latest.stop
    assert pcontext._failures == {} and done == set()
    return elastic


def test_once_the_job_stops_torch_sees_the_exits_when_the_survivors_have_left(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    pcontext, _ = job
    stopped(job, tmp_path)
    procs = {r: h.proc for r, h in pcontext.subprocess_handlers.items()}
    done: set[int] = set()
    # The survivors raise WorldTooSmallError and exit on their own: torch waits for them.
    die(procs[0])
    die(procs[1])
    pcontext._capture_process_failures(done)
    assert pcontext._failures == {} and done == set()
    die(procs[3])
    pcontext._capture_process_failures(done)
    assert set(pcontext._failures) == {0, 1, 2, 3} and done == {0, 1, 2, 3}


def test_once_the_job_stops_a_survivor_that_does_not_leave_is_torchs_after_a_grace(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    pcontext, _ = job
    elastic = stopped(job, tmp_path)
    done: set[int] = set()
    elastic._stop_by = time.monotonic() - 1  # the grace (STOP_GRACE_S) is over
    pcontext._capture_process_failures(done)
    assert set(pcontext._failures) == {2} and done == {2}


class Watched:
    """A launcher whose every worker has been seen beating, with the deaths it declares."""

    def __init__(
        self, pcontext: FakeContext, store: Any, tmp_path: Path, heartbeat_timeout: float
    ) -> None:
        self.pcontext = pcontext
        self.elastic = launcher(
            pcontext, store, tmp_path, heartbeat_timeout=heartbeat_timeout, max_replacements=0
        )
        self.declared: list[dict[int, str]] = []
        self.elastic._dump = lambda dead, **_: self.declared.append(dead)  # type: ignore[method-assign]
        self.workers = Membership(dist.TCPStore("127.0.0.1", store.port, is_master=False))  # type: ignore[attr-defined]
        for rank in range(WORLD):
            self.workers.beat(rank)
        self.done: set[int] = set()
        self.poll()  # every worker seen beating

    def poll(self) -> None:
        self.pcontext._capture_process_failures(self.done)

    def rank_2_alone_silent_is_declared(self) -> None:
        """Silence still counts: rank 2 alone stops beating, and is declared dead."""
        deadline = time.monotonic() + 10
        while not self.declared:
            assert time.monotonic() < deadline, "rank 2's silence was never declared"
            for rank in (0, 1, 3):
                self.workers.beat(rank)
            self.poll()
            time.sleep(0.1)  # the workers' beat period
        assert list(self.declared[0]) == [2] and "no heartbeat" in self.declared[0][2]


def test_a_store_that_answers_nobody_for_a_while_silences_no_worker(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    watched = Watched(*job, tmp_path, heartbeat_timeout=1.0)
    real = watched.elastic.membership.store

    class Stalls:
        """The job's store answers nobody for longer than the heartbeat timeout, once (an etcd
        election): the workers' beats wait as the launcher's reads do."""

        stalled = False

        def __getattr__(self, name: str) -> Any:
            return getattr(real, name)

        def add(self, name: str, value: int) -> int:
            if not self.stalled:
                self.stalled = True
                time.sleep(1.2)
            return int(real.add(name, value))

    watched.elastic.membership.store = Stalls()
    watched.poll()
    watched.poll()  # right after: nobody has beaten since the stall
    assert watched.declared == []
    watched.rank_2_alone_silent_is_declared()  # once the store is back


def test_a_launcher_stopped_with_its_workers_does_not_take_their_silence_for_death(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    # A frozen node thawed: the launcher's first poll comes long after its last, and its
    # workers, stopped with it, have not beaten meanwhile. Their silence is the launcher's own.
    watched = Watched(*job, tmp_path, heartbeat_timeout=0.5)
    time.sleep(1.5)  # the fault: launcher and workers stopped, no poll, no beat
    watched.poll()
    assert watched.declared == []
    watched.rank_2_alone_silent_is_declared()  # once it runs again


def test_a_launcher_on_a_node_the_job_dropped_starts_its_workers_as_replacements(
    job: tuple[FakeContext, Any],
) -> None:
    _, store = job
    membership = Membership(store)
    assert rejoining(store, [2, 3]) == {}, "the job's first start: no replacement"
    membership.propose(Decision(1, (0, 1), dead={2: "node1 lost", 3: "node1 lost"}))
    assert rejoining(store, [0, 1]) == {}, "a node still in the job starts as launched"
    assert rejoining(store, [2, 3]) == {2: 1, 3: 1}
    assert membership.next_incarnation(3) == 2, "the next replacement of rank 3, wherever"
    assert rejoining(store, [2, 3]) == {2: 2, 3: 3}, "a second replacement node"
    membership.propose(Decision(2, (0,), dead={1: "signal SIGKILL"}, stop="1 rank(s) left"))
    with pytest.raises(ConfigError, match="has stopped"):
        rejoining(store, [2, 3])


def test_a_replacement_nodes_workers_are_admitted_in_one_decision(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    pcontext, store = job
    membership = Membership(store)
    membership.propose(Decision(1, (0, 1), dead={2: "node1 lost", 3: "node1 lost"}))
    elastic = launcher(pcontext, store, tmp_path, rejoining={2: 1, 3: 1})
    assert elastic.pending == {2, 3} and elastic.rejoined
    membership.announce_join(3, 1)
    assert elastic.poll() is not None
    assert membership.latest_epoch() == 1, "admitted before its node's other rank joined"
    membership.announce_join(2, 1)
    elastic.poll()
    latest = membership.latest()
    assert latest is not None and (latest.epoch, latest.joined) == (2, (2, 3)), latest
    assert latest.members == (0, 1, 2, 3) and latest.fresh == (2, 3)
    assert elastic.pending == set()


def test_a_decision_over_another_nodes_fresh_ranks_reads_their_incarnation(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    # Ranks 4-5 of another node joined and are still fresh when a rank here dies: the decision
    # keeps them fresh until the store says that their incarnation was healed.
    pcontext, store = job
    membership = Membership(store)
    membership.propose(Decision(1, (0, 1, 2, 3), dead={4: "node1 lost", 5: "node1 lost"}))
    for rank in (4, 5):
        assert membership.next_incarnation(rank) == 1
    membership.propose(Decision(2, (0, 1, 2, 3, 4, 5), joined=(4, 5), fresh=(4, 5)))
    membership.mark_healed(4, 1, 2)
    elastic = launcher(pcontext, store, tmp_path, max_replacements=0)
    die(pcontext.subprocess_handlers[3].proc)
    elastic._dump = lambda dead, **_: None  # type: ignore[method-assign]
    elastic.poll()
    latest = membership.latest()
    assert latest is not None and latest.epoch == 3, latest
    assert latest.members == (0, 1, 2, 4, 5) and latest.fresh == (5,), latest


def test_through_the_relay_a_poll_asks_the_store_nothing_and_a_silent_worker_is_still_found(
    job: tuple[FakeContext, Any], tmp_path: Path
) -> None:
    pcontext, store = job
    relay = RelayServer(relay_name())
    look = AlarmLook(AlarmBoard(store.clone()), epoch=1, found=lambda alarm: None, every=0.05)
    look.start()
    links = {rank: MemberLink.join(relay.name, rank) for rank in range(WORLD)}
    try:
        workers = [
            types.SimpleNamespace(local_rank=r, global_rank=r, world_size=WORLD)
            for r in range(WORLD)
        ]
        view = JobView(StoreAddress("127.0.0.1", int(store.port)), WORLD, {})
        elastic = ElasticLauncher(
            pcontext,
            types.SimpleNamespace(workers=workers),
            lambda: view,
            config=Config(elastic=True, heartbeat_timeout=0.5, max_replacements=0),
            dump_dir=tmp_path,
            relay=relay,
            look=look,
        )
        declared: list[dict[int, str]] = []
        elastic._dump = lambda dead, **_: declared.append(dead)  # type: ignore[method-assign]
        counted = CountingStore(elastic.membership.store)
        elastic.membership.store = counted
        until(lambda: look.news >= 0, "the look never read the news", timeout=10.0)
        done: set[int] = set()
        pcontext._capture_process_failures(done)  # reads the decisions once: none
        assert counted.total() == 1
        counted.counts.clear()
        for _ in range(5):  # every worker beats, the launcher polls: steady state
            for link in links.values():
                assert link.beat() == []
            until(lambda: all(relay.beats(r) for r in range(WORLD)), "beats", timeout=10.0)
            pcontext._capture_process_failures(done)
        assert counted.total() == 0, f"no store request in steady state: {counted.counts}"
        heard: dict[int, list[Decision]] = {0: [], 1: [], 3: []}

        def rank_2_declared() -> bool:
            for rank, got in heard.items():
                got += links[rank].beat()
            pcontext._capture_process_failures(done)
            return bool(declared)

        until(rank_2_declared, "rank 2's silence was never declared", timeout=10.0)
        assert list(declared[0]) == [2] and "no heartbeat" in declared[0][2]
        until(
            lambda: all(got or (got.extend(links[r].beat()) or got) for r, got in heard.items()),
            "a survivor never heard the decision",
            timeout=10.0,
        )
        assert {r: [d.epoch for d in got] for r, got in heard.items()} == {0: [1], 1: [1], 3: [1]}
        assert heard[0][0].dead == {2: declared[0][2]}
    finally:
        for link in links.values():
            link.close()
        look.close()
        relay.close()
