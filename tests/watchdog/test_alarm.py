"""The alarm protocol on a real TCPStore: one event per incident, whoever raises it."""

from __future__ import annotations

import dataclasses
import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from tether._exceptions import BadAlarmError, StoreUnreachableError
from tether.config import Config
from tether.events.layout import new_event_id
from tether.job.alarm import Alarm, AlarmBoard, HangSite
from tether.recorder.formation import Late
from tether.recorder.recorder import Recorder
from tether.watchdog.hang import HangPolicy
from tether.watchdog.responder import MAX_STORE_FAILURES, Responder


def board(store: dist.TCPStore) -> AlarmBoard:
    return AlarmBoard(dist.PrefixStore("default_pg/0/", store))


def raise_hang(
    responder: Responder, event_id: str, *, start: int | None = None, site: HangSite | None = None
) -> Alarm:
    """What watchdog/hang.py raises for a rank whose responder is ``responder``."""
    return responder.board.raise_alarm(
        "hang",
        origin=f"rank {responder.rank}",
        start=responder.epoch if start is None else start,
        site=site,
        event_id=event_id,
        join=True,
        on_bad_key=responder.pass_over,
    )


def answering(
    b: AlarmBoard, tmp_path: Path, *, rank: int, world_size: int
) -> tuple[Responder, threading.Event]:
    """A rank's responder whose dumps only set the event it returns (not started)."""
    answered = threading.Event()
    responder = Responder(
        b,
        rank=rank,
        world_size=world_size,
        host="h",
        dump=lambda alarm: (answered.set(), tmp_path)[1],
        event_dir=lambda event_id: tmp_path / event_id,
        abort_on=lambda alarm: False,
    )
    return responder, answered


def test_prefix_stores_are_unwrapped_so_outsiders_share_the_keys(store: dist.TCPStore) -> None:
    inside = board(store)
    outside = AlarmBoard(store)  # what the launcher and `tether dump` hold
    raised = inside.raise_alarm("hang", origin="rank 0", event_id="ev-a")
    assert outside.get(1) == raised


def test_concurrent_raisers_of_one_epoch_share_the_first_event(store: dist.TCPStore) -> None:
    b = board(store)
    first = b.put(Alarm(1, "ev-a", "hang", "rank 0"))
    second = b.put(Alarm(1, "ev-b", "hang", "rank 2"))
    assert second == first and first.event_id == "ev-a"


def test_an_alarm_takes_the_first_free_epoch(store: dist.TCPStore) -> None:
    b = board(store)
    b.put(Alarm(1, "ev-a", "hang", "rank 0"))
    got = b.raise_alarm("manual", origin="cli", event_id="ev-m")
    assert (got.epoch, got.event_id, got.origin) == (2, "ev-m", "cli")
    assert b.get(3) is None


def test_an_alarm_gets_a_new_event_id_and_the_time_it_was_raised(store: dist.TCPStore) -> None:
    b = board(store)
    before = time.time_ns()
    got = b.raise_alarm("crash", origin="launcher", dead_ranks={"1": "signal SIGKILL"})
    assert got.event_id.endswith("-crash") and before <= got.time_ns <= time.time_ns()
    assert got.dead_ranks == {"1": "signal SIGKILL"} and b.get(got.epoch) == got


def test_a_lost_store_is_named_as_such(tmp_path: Path) -> None:
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
    del server  # the store's server ends with its owner
    with pytest.raises(StoreUnreachableError, match="lost the job's store"):
        AlarmBoard(client).raise_alarm("manual", origin="cli")


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
    manual = b.raise_alarm("manual", origin="cli", event_id="ev-manual")
    assert responder.epoch == manual.epoch, "not answered yet"
    hang = raise_hang(responder, "ev-hang")
    assert (hang.epoch, hang.event_id) == (manual.epoch + 1, "ev-hang")
    # A second rank seeing the same hang joins it rather than opening another event.
    joined = raise_hang(responder, "ev-other")
    assert joined == hang
    assert b.get(hang.epoch) == hang


def test_a_hang_seen_before_its_alarm_was_answered_joins_it(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    """Rank B's watchdog sees the hang, then its responder answers rank A's alarm for it
    (moving on to the next epoch) before B raises: B must join A's alarm, not raise a second
    event for the same incident."""
    b = board(store)
    responder, answered = answering(b, tmp_path, rank=1, world_size=2)
    seen_at = responder.epoch  # what the watchdog read when it saw the hang
    responder.start()
    first = b.raise_alarm("hang", origin="rank 0", event_id="ev-from-a")
    assert answered.wait(10) and responder.wait_answered(0, 10)
    assert responder.epoch == first.epoch + 1
    joined = raise_hang(responder, "ev-from-b", start=seen_at)
    assert joined == first and b.get(first.epoch + 1) is None
    responder.close()


def test_a_creation_hang_another_member_raised_first_is_not_raised_again(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    """Two ranks waiting in one group's creation time out milliseconds apart: the second's
    responder may answer the first's alarm before its own watchdog fires. The watchdog must
    then leave it at that event, not raise a second one at the next epoch."""
    b = board(store)
    responder, answered = answering(b, tmp_path, rank=2, world_size=3)
    arrived = time.time_ns()  # this rank entered new_group
    responder.start()
    try:
        first = b.raise_alarm("hang", origin="rank 0", event_id="ev-from-0")
        assert answered.wait(10) and responder.wait_answered(0, 10)
        recorder = Recorder(Config(dump_dir=tmp_path, on_hang="dump"))
        policy = HangPolicy(recorder, responder=lambda: responder)
        late = Late("new_group", "1", "dp", [0, 1, 2], [1], 2, arrived, 3.0)
        policy.creation(late, store)
        assert b.get(first.epoch + 1) is None, "the same hang was raised as a second event"
        # A creation that began after the alarm is another incident: it is raised.
        policy.creation(dataclasses.replace(late, since_ns=time.time_ns()), store)
        second = b.get(first.epoch + 1)
        assert second is not None and second.reason == "hang" and second.event_id != first.event_id
    finally:
        responder.close()


# -- keys that hold no alarm ---------------------------------------------------------------------
BAD_PAYLOADS = [
    '{"epoch": 1}',  # fields missing
    "not json",
    '["a list"]',
    '{"epoch": "1", "event_id": "ev", "reason": "hang", "origin": "x"}',  # epoch not an int
    '{"epoch": 1, "event_id": "../../../etc", "reason": "hang", "origin": "x"}',
    '{"epoch": 1, "event_id": "/abs/path", "reason": "hang", "origin": "x"}',
    '{"epoch": 1, "event_id": ".stacks", "reason": "hang", "origin": "x"}',
    '{"epoch": 1, "event_id": "a/b", "reason": "hang", "origin": "x"}',
    '{"epoch": 1, "event_id": "' + "x" * 300 + '", "reason": "hang", "origin": "x"}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "dead_ranks": [1]}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "seq": "4"}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "age_s": "long"}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "timeout_s": true}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "group": 0}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "age_s": 1e999}',
    '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "timeout_s": 1'
    + "0" * 400
    + "}",
    "[" * 100_000,  # json's RecursionError
]


@pytest.mark.parametrize("payload", BAD_PAYLOADS)
def test_a_payload_that_is_no_alarm_is_refused(payload: str) -> None:
    with pytest.raises(BadAlarmError):
        Alarm.from_json(payload)


def test_real_event_ids_pass() -> None:
    alarm = Alarm(1, new_event_id("hang"), "hang", "rank 0", dead_ranks={"1": "exit code 1"})
    assert Alarm.from_json(alarm.to_json()) == alarm


def test_an_alarm_under_another_epochs_key_is_refused(store: dist.TCPStore) -> None:
    b = board(store)
    store.set(b.key(3), Alarm(1, "ev", "hang", "cli").to_json())
    with pytest.raises(BadAlarmError, match="epoch 1"):
        b.get(3)


def responder_on(
    b: AlarmBoard,
    tmp_path: Path,
    dumped: list[Alarm],
    *,
    world_size: int = 1,
    relay: str = "",
    stop_if_orphaned: bool = False,
) -> Responder:
    """The responder of the last rank of ``world_size``, whose dumps go to ``dumped``."""

    def dump(alarm: Alarm) -> Path:
        dumped.append(alarm)
        return tmp_path / alarm.event_id

    return Responder(
        b,
        rank=world_size - 1,
        world_size=world_size,
        host="h",
        dump=dump,
        event_dir=lambda event_id: tmp_path / event_id,
        abort_on=lambda alarm: False,
        relay=relay,
        stop_if_orphaned=stop_if_orphaned,
    )


@pytest.mark.timeout(30)
def test_a_malformed_key_does_not_stop_start_up(store: dist.TCPStore, tmp_path: Path) -> None:
    b = board(store)
    store.set(b.key(1), '{"epoch": 1}')
    assert responder_on(b, tmp_path, []).epoch == 2


@pytest.mark.timeout(30)
def test_malformed_keys_are_passed_over_and_the_next_alarm_answered(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    b = board(store)
    dumped: list[Alarm] = []
    responder = responder_on(b, tmp_path, dumped)
    responder.start()
    try:
        # More bad keys than the store failures the responder tolerates: none may count as one.
        for epoch, payload in enumerate(BAD_PAYLOADS, start=1):
            store.set(b.key(epoch), payload.replace('"epoch": 1', f'"epoch": {epoch}'))
        assert len(BAD_PAYLOADS) > MAX_STORE_FAILURES
        good = b.raise_alarm("manual", origin="cli", event_id="ev-good")
        assert good.epoch == len(BAD_PAYLOADS) + 1
        assert responder.wait_answered(0, timeout=10.0), "the real alarm was not answered"
        assert [a.event_id for a in dumped] == ["ev-good"]
        assert list(tmp_path.iterdir()) == [], "nothing was written outside the event"
    finally:
        responder.close()


def test_an_alarm_is_raised_past_a_malformed_key(store: dist.TCPStore) -> None:
    b = board(store)
    store.set(b.key(1), "garbage")
    passed: list[int] = []
    got = b.raise_alarm("manual", origin="cli", on_bad_key=lambda epoch, exc: passed.append(epoch))
    assert (got.epoch, passed) == (2, [1])


def test_a_hang_is_raised_past_a_malformed_key(store: dist.TCPStore, tmp_path: Path) -> None:
    b = board(store)
    responder = responder_on(b, tmp_path, [])
    store.set(b.key(responder.epoch), "garbage")  # written after the responder started
    hang = raise_hang(responder, "ev-hang")
    assert (hang.epoch, hang.event_id) == (2, "ev-hang")


# -- a hang alarm names its operation ------------------------------------------------------------
SITE = HangSite(
    group="1", group_desc="dp", seq=7, op="gloo:all_reduce", seen_by=2, age_s=16.5, timeout_s=15.0
)


def test_a_hang_alarm_carries_its_operation_through_the_store(
    store: dist.TCPStore, tmp_path: Path
) -> None:
    b = board(store)
    responder = responder_on(b, tmp_path, [])
    raised = raise_hang(responder, "ev-hang", site=SITE)
    got = AlarmBoard(store).get(raised.epoch)
    assert got == raised
    assert got is not None
    assert (got.group, got.group_desc, got.seq, got.op) == ("1", "dp", 7, "gloo:all_reduce")
    assert (got.seen_by, got.age_s, got.timeout_s) == (2, 16.5, 15.0)


def test_an_alarm_of_an_older_raiser_parses_without_the_operation() -> None:
    old = '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "rank 0", "time_ns": 5}'
    alarm = Alarm.from_json(old)
    assert (alarm.group, alarm.seq, alarm.op, alarm.seen_by, alarm.age_s) == ("", 0, "", -1, 0.0)


def test_whole_seconds_are_read_as_floats() -> None:
    raw = '{"epoch": 1, "event_id": "ev", "reason": "hang", "origin": "x", "age_s": 16}'
    alarm = Alarm.from_json(raw)
    assert alarm.age_s == 16.0 and isinstance(alarm.age_s, float)
