"""How the recorder learns that operations finished: drained by the issuing thread and the
watchdog, a stuck head parked so the operations behind it still drain (no processes needed)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tether.config import Config
from tether.recorder.ops import OPS
from tether.recorder.recorder import PARK_AFTER, Recorder
from tether.recorder.ring import COMPLETED, STARTED, Entry

pytestmark = pytest.mark.timeout(30)


class FakeWork:
    """A Work whose completion the test decides."""

    def __init__(self, future: Any = None) -> None:
        self.done = False
        self.polls = 0
        self.future = future if future is not None else torch.futures.Future()  # never done

    def is_completed(self) -> bool:
        self.polls += 1
        return self.done

    def get_future(self) -> Any:
        return self.future


@pytest.fixture
def recorder(tmp_path: Any) -> Recorder:
    return Recorder(Config(dump_dir=tmp_path))


def _group(recorder: Recorder, name: str = "0") -> Any:
    return recorder.add_group(
        name=name,
        desc="default_pg",
        ranks=[0, 1],
        group_rank=0,
        backends={"cpu": "gloo"},
        timeout_ms=1000,
    )


def _issue(group: Any, method: str = "allreduce", *args: Any) -> tuple[Entry, FakeWork]:
    spec = OPS[method]
    entry = group.begin(spec, ([torch.ones(2)], *args))
    work = FakeWork()
    group.issued(entry, work)
    return entry, work


def test_the_next_operation_drains_the_finished_one_before_it(recorder: Recorder) -> None:
    group = _group(recorder)
    first, work = _issue(group)
    assert first.state == STARTED
    work.done = True
    second, _ = _issue(group)
    assert first.state == COMPLETED and first.work is None
    assert second.state == STARTED
    assert list(group.inflight) == [second]
    assert group.last_completed == first.collective_seq_id


def test_watchdog_pass_leaves_young_heads_to_the_issuing_thread(recorder: Recorder) -> None:
    group = _group(recorder)
    entry, work = _issue(group)
    work.done = True
    recorder.reap(min_age_ns=60 * 10**9)
    assert entry.state == STARTED and work.polls == 0, "a young head was polled"
    recorder.reap(min_age_ns=0)
    assert entry.state == COMPLETED and not group.inflight


def test_a_stuck_head_is_parked_and_stays_the_oldest(recorder: Recorder) -> None:
    group = _group(recorder)
    stuck, stuck_work = _issue(group, "recv", 1, 0)  # an irecv posted early that never matches
    behind = []
    for _ in range(PARK_AFTER + 5):
        entry, work = _issue(group)
        work.done = True
        behind.append(entry)
    running, _ = _issue(group)
    recorder.reap()
    assert all(e.state == COMPLETED for e in behind), "operations behind a stuck head"
    assert stuck.state == STARTED
    assert recorder.oldest_inflight() is stuck
    assert [e.record_id for e in recorder.inflight()] == [stuck.record_id, running.record_id]
    stuck_work.done = True
    recorder.reap()
    assert stuck.state == COMPLETED
    assert recorder.oldest_inflight() is running


def test_oldest_in_flight_is_the_oldest_head_across_groups(recorder: Recorder) -> None:
    world, sub = _group(recorder, "0"), _group(recorder, "1")
    old, _ = _issue(sub)
    new, _ = _issue(world)
    old.time_created_ns = new.time_created_ns - 1_000_000  # issued 1 ms earlier, whatever the clock
    assert recorder.oldest_inflight() is old


def test_a_failed_work_counts_as_finished(recorder: Recorder) -> None:
    group = _group(recorder)
    entry, work = _issue(group)

    def broken() -> bool:
        raise RuntimeError("connection closed by peer")

    work.is_completed = broken  # type: ignore[method-assign]
    recorder.reap()
    assert entry.state == COMPLETED


class FailedFuture:
    def done(self) -> bool:
        return True

    def value(self) -> None:
        raise RuntimeError("Connection closed by peer")


def test_a_dump_asks_each_groups_last_finished_work_whether_it_failed(
    recorder: Recorder,
) -> None:
    group = _group(recorder)
    ok, ok_work = _issue(group)
    ok_work.done = True
    broken, broken_work = _issue(group)
    broken_work.done = True
    broken_work.get_future = FailedFuture  # type: ignore[assignment,method-assign]
    recorder.reap()
    assert broken.state == COMPLETED  # finishing is cheap; failure is asked at dump time
    recorder.find_failures()
    assert broken.state == STARTED and broken.time_completed_ns == 0
    assert broken.error == "RuntimeError: Connection closed by peer"
    assert ok.state == COMPLETED and ok.error is None


def test_a_work_without_a_future_is_not_called_failed(recorder: Recorder) -> None:
    group = _group(recorder)
    entry, work = _issue(group)
    work.done = True

    def no_future() -> None:
        raise RuntimeError("Work::getFuture not implemented")

    work.get_future = no_future  # type: ignore[assignment,method-assign]
    recorder.reap()
    recorder.find_failures()
    assert entry.state == COMPLETED and entry.error is None


def _settled(value: Any = None, error: Exception | None = None) -> Any:
    future = torch.futures.Future()
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(value)
    return future


@pytest.mark.parametrize(
    ("future", "finished"),
    [
        (_settled([torch.ones(2)]), True),  # gloo: the future done before the work
        (_settled([[torch.ones(2)], [torch.ones(1)]]), True),
        (_settled(error=RuntimeError("peer died")), True),  # failed is finished
        (_settled([torch.ones(2, device="meta")]), False),  # a device future: done at launch
        (_settled([]), False),  # no tensor to tell the device by
        (torch.futures.Future(), False),  # still running
    ],
    ids=["cpu", "nested", "failed", "device", "empty", "running"],
)
def test_a_done_cpu_future_finishes_a_work_that_still_says_running(
    recorder: Recorder, future: Any, finished: bool
) -> None:
    """gloo completes a work's future before the work itself, and DDP's reducer waits on the
    future: after its step returns, a dump must not show its all_reduce running."""
    group = _group(recorder)
    entry = group.begin(OPS["allreduce"], ([torch.ones(2)],))
    work = FakeWork(future)
    group.issued(entry, work)
    recorder.reap()
    assert (entry.state == COMPLETED) is finished, entry.state
    assert work.polls >= 1, "the work was not asked first"
