"""The hang policy: what a rank does once its watchdog sees an operation outlive the hang timeout.

It raises one job-wide hang alarm, so that every rank dumps into one event (and aborts, with
``on_hang=abort``); an alarm another rank raised for the same incident is joined, not raised
again, and so is a crash alarm answered while the operation was in flight or shortly before (it
waits on the dead rank, whose crash event holds this rank's dump already). Where the job's store
does not take the alarm, this rank dumps alone, and still aborts: a failed dump must not leave a
hung rank behind.
"""

from __future__ import annotations

import dataclasses
import math
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any

from tether._log import get_logger, say
from tether.events.layout import new_event_id
from tether.job.alarm import (
    DUMPED,
    HANG_EXIT_CODE,
    Alarm,
    AlarmBoard,
    BadAlarmError,
    HangSite,
    first_line,
)
from tether.job.stacks import agent_key
from tether.recorder.formation import Late
from tether.recorder.recorder import Recorder
from tether.recorder.ring import Entry
from tether.recorder.writer import write_event
from tether.watchdog.responder import ABORT_GRACE_S, Responder

__all__ = ["RAISE_TIMEOUT_S", "HangPolicy", "describe"]

logger = get_logger(__name__)

RAISE_TIMEOUT_S = 5.0
"""How long the watchdog waits for the job's store to take a hang alarm before this rank dumps
alone (and aborts, with on_hang=abort): a store call may block for the store's whole timeout."""


def describe(entry: Entry, age: float, rank: int) -> str:
    """The alarm's detail. Older dumps carry the operation only here, so the analyzer parses it
    (``analyze/model.py``): keep the wording."""
    group = entry.group
    return (
        f"{entry.profiling_name} #{entry.collective_seq_id} on group {group.name} "
        f"({group.desc}) in flight {age:.1f}s on rank {rank}"
    )


def _answered(responder: Responder, began_ns: int, hang_timeout: float) -> Alarm | None:
    """The alarm this rank answered already that the hang of an operation that began at
    ``began_ns`` belongs to: a hang alarm raised since (another rank saw the incident first), or
    a crash alarm raised since, or up to a hang timeout before (a rank slow to reach the
    collective issues it after the crash's dumps: it waits on the dead all the same)."""
    since = {
        "hang": began_ns,
        "crash": began_ns - int(hang_timeout * 1e9),
    }
    return next((a for a in responder.handled if a.time_ns >= since.get(a.reason, math.inf)), None)


class HangPolicy:
    """The watchdog's ``on_hang``. ``responder``: this rank's responder to the job's alarms,
    None before the default group formed (or without a store): then the rank dumps alone."""

    def __init__(
        self,
        recorder: Recorder,
        *,
        responder: Callable[[], Responder | None],
        extra: Callable[[], dict[str, Any]] = dict,
    ) -> None:
        self.recorder = recorder
        self.config = recorder.config
        self._responder = responder
        self._extra = extra
        """What this rank's dumps add to their ``tether`` section (the job link's)."""
        self.unhealthy_backends: set[str] = set()
        """The backends of every group that hung here: sticky, as torch's health check is (a
        hang that drains later still happened)."""

    def __call__(self, entry: Entry, age: float) -> None:
        rank = self.recorder.global_rank
        detail = describe(entry, age, rank)
        logger.error("hang: %s", detail)
        self.unhealthy_backends.update(entry.group.backends.values())
        if self._dumps_off(detail):
            return
        responder = self._responder()
        if responder is None:
            self._alone(detail)
            return
        site = HangSite(
            group=entry.group.name,
            group_desc=entry.group.desc,
            seq=entry.collective_seq_id if not entry.is_p2p else 0,
            op=entry.profiling_name,
            seen_by=rank,
            age_s=float(age),
            timeout_s=float(self.config.hang_timeout),
        )
        self._join_or_raise(responder, entry.time_created_ns, detail, site)

    def creation(self, late: Late, store: Any) -> None:
        """A group's creation outlived the hang timeout on this rank (``late``): a hang whose
        site is the creation. Before the default group exists there is no responder: the alarm
        goes through the group's ``store``, and this rank dumps itself into its event."""
        detail = late.describe()
        logger.error("hang: %s", detail)
        if self._dumps_off(detail):
            return
        site = HangSite(
            group=late.group,
            group_desc=late.group_desc,
            seq=0,
            op=late.op,
            seen_by=late.rank,
            age_s=float(late.waited_s),
            timeout_s=float(self.config.hang_timeout),
        )
        responder = self._responder()
        if responder is not None:  # it dumps, and aborts with on_hang=abort
            self._join_or_raise(responder, late.since_ns, detail, site)
            return
        # A connection of its own: the creating thread waits on the group store's.
        board = AlarmBoard(store).clone()
        alarm = self._raise(board, detail, 1, site)
        where = self._dump_alone(detail, alarm)
        if alarm is not None:
            self._answer_alone(board, alarm, late)
        self._abort_if_asked(detail, where)

    def _join_or_raise(
        self, responder: Responder, began_ns: int, detail: str, site: HangSite
    ) -> None:
        """Raise the hang alarm of an operation (a collective, a group's creation) that began at
        ``began_ns``, unless this rank's responder answered one the hang belongs to already:
        ranks waiting in one operation time out within milliseconds of each other, and another
        may have raised it first. Where the store takes no alarm, this rank dumps alone."""
        # Read before looking at what was answered: an alarm for this incident that the
        # responder answers from now on is then joined, not raised again as a second event.
        epoch = responder.epoch
        answered = _answered(responder, began_ns, self.config.hang_timeout)
        if answered is not None:
            if answered.reason == "crash":
                # The crash's event holds this rank's dump already. Nor does it abort: the
                # launcher ends the job as the dead rank exits, and an abort's exit status would
                # call a crash a hang (which a wrapper retries).
                logger.error("this operation waits on the crash of event %s", answered.event_id)
            else:
                logger.error(
                    "this hang is event %s, raised by %s", answered.event_id, answered.origin
                )
            return
        if self._raise(responder.board, detail, epoch, site, responder.pass_over) is None:
            self._alone(detail)

    def _answer_alone(self, board: AlarmBoard, alarm: Alarm, late: Late) -> None:
        """Say this rank's part of ``alarm`` is in (a launcher reading silent ranks' stacks
        passes it over). Where tether run's agent reads the stacks of the ranks that never came
        and this rank will abort, leave only once every member's part is in: they are read
        alive."""
        try:
            board.mark_done(alarm.epoch, late.rank, DUMPED)
            if self.config.on_hang == "abort" and board.store.check(
                [agent_key(self.recorder.host)]
            ):
                others = [r for r in late.ranks if r != late.rank]
                board.wait_done(alarm.epoch, others, ABORT_GRACE_S)
        except Exception as exc:  # the store is gone: abort all the same
            logger.warning("could not mark alarm %s answered: %s", alarm.event_id, exc)

    def _dumps_off(self, detail: str) -> bool:
        """torch's TORCH_FR_DUMP_ON_TIMEOUT=0 (``dump_on_hang`` off): the rank only reports
        itself unhealthy, and a debug server (tether's, or torch's frontend through
        c10d_health_check) asks for the dumps. It still aborts, where told to."""
        if self.config.dump_on_hang:
            return False
        logger.error("not dumping for this hang: dump_on_hang is off")
        self._abort_if_asked(detail, "no dump (dump_on_hang is off)")
        return True

    def _raise(
        self,
        board: AlarmBoard,
        detail: str,
        epoch: int,
        site: HangSite,
        on_bad_key: Callable[[int, BadAlarmError], None] | None = None,
    ) -> Alarm | None:
        """Raise the hang alarm job-wide; None if the store did not take it within
        :data:`RAISE_TIMEOUT_S`. The raise runs on a thread and connection of its own: a store
        that is gone or stuck may block it for the store's timeout, or for ever."""
        raised: Future[Alarm] = Future()

        def run() -> None:
            try:
                alarm = board.clone().raise_alarm(
                    "hang",
                    origin=f"rank {self.recorder.global_rank}",
                    start=epoch,
                    detail=detail,
                    site=site,
                    join=True,
                    on_bad_key=on_bad_key,
                )
                raised.set_result(alarm)
            except BaseException as exc:  # handed to the watchdog thread
                raised.set_exception(exc)

        threading.Thread(target=run, name="tether-raise", daemon=True).start()
        try:
            return raised.result(timeout=RAISE_TIMEOUT_S)
        except TimeoutError:
            why = f"no answer within {RAISE_TIMEOUT_S:.0f}s"
        except Exception as exc:
            why = first_line(exc)
        logger.error("could not raise the hang alarm through the job's store (%s)", why)
        return None

    def _alone(self, detail: str) -> None:
        """No store to reach the other ranks: this rank's evidence is all we can leave. Then
        abort all the same: a failed dump must not leave the rank hung."""
        self._abort_if_asked(detail, self._dump_alone(detail, None))

    def _dump_alone(self, detail: str, alarm: Alarm | None) -> str:
        """This rank's dump, into ``alarm``'s event (else one of its own); where it went."""
        extra = self._extra() | {"detail": detail}
        if alarm is not None:
            extra["alarm"] = dataclasses.asdict(alarm)
        event_id = alarm.event_id if alarm is not None else new_event_id("hang")
        try:
            path = write_event(self.recorder, "hang", event_id=event_id, extra=extra)
        except Exception as exc:
            logger.error("could not dump this rank after a hang: %s", exc)
            return f"no dump ({exc})"
        return f"dump in {path.parent}"

    def _abort_if_asked(self, detail: str, where: str) -> None:
        if self.config.on_hang == "abort":
            say(f"tether: hang ({detail}); {where}; aborting")  # one write: ranks share stderr
            os._exit(HANG_EXIT_CODE)
