"""The alarm protocol on a real TCPStore: one event per incident, whoever raises it."""

from __future__ import annotations

from pathlib import Path

import torch.distributed as dist

from tether.watchdog.alarm import Alarm, AlarmBoard
from tether.watchdog.responder import Responder


def board(store: dist.TCPStore) -> AlarmBoard:
    return AlarmBoard(dist.PrefixStore("default_pg/0/", store))


def test_prefix_stores_are_unwrapped_so_outsiders_share_the_keys(store: dist.TCPStore) -> None:
    inside = board(store)
    outside = AlarmBoard(store)  # what the launcher and `tether dump` hold
    raised = inside.raise_alarm(Alarm(1, "ev-a", "hang", "rank 0"))
    assert outside.get(1) == raised


def test_concurrent_raisers_of_one_epoch_share_the_first_event(store: dist.TCPStore) -> None:
    b = board(store)
    first = b.raise_alarm(Alarm(1, "ev-a", "hang", "rank 0"))
    second = b.raise_alarm(Alarm(1, "ev-b", "hang", "rank 2"))
    assert second == first and first.event_id == "ev-a"


def test_raise_next_takes_the_first_free_epoch(store: dist.TCPStore) -> None:
    b = board(store)
    b.raise_alarm(Alarm(1, "ev-a", "hang", "rank 0"))
    got = b.raise_next(Alarm(0, "ev-m", "manual", "cli"))
    assert (got.epoch, got.event_id) == (2, "ev-m")
    assert b.get(3) is None


def test_wait_done_reports_who_finished_each_phase(store: dist.TCPStore) -> None:
    b = board(store)
    b.mark_done(1, 0, "dump")
    b.mark_done(1, 2, "stacks collected by rank 0")
    b.mark_done(1, 0, "leaving", phase="leaving")
    assert b.wait_done(1, [0, 1, 2], timeout=0.2) == {0: "dump", 2: "stacks collected by rank 0"}
    assert b.wait_done(1, [0, 2], timeout=0.2, phase="leaving") == {0: "leaving"}
    assert b.done(1, 3) == {0: "dump", 2: "stacks collected by rank 0"}


def test_a_hang_passes_over_a_manual_alarm_it_has_not_answered(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    b = board(store)
    responder = Responder(
        b,
        rank=1,
        world_size=2,
        host="h",
        dump=lambda alarm: tmp_path,
        event_dir=lambda event_id: tmp_path / event_id,
        abort_on=lambda alarm: False,
    )
    manual = b.raise_next(Alarm(0, "ev-manual", "manual", "cli"))
    assert responder.epoch == manual.epoch, "not answered yet"
    hang = responder.raise_alarm("hang", "all_reduce #3", "ev-hang")
    assert (hang.epoch, hang.event_id) == (manual.epoch + 1, "ev-hang")
    # A second rank seeing the same hang joins it rather than opening another event.
    joined = responder.raise_alarm("hang", "all_reduce #3 elsewhere", "ev-other")
    assert joined == hang
    assert b.get(hang.epoch) == hang
