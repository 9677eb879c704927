"""This rank's Prometheus metrics (``GET /metrics``), following Prometheus' naming conventions:
counters end in ``_total``, durations are in seconds, every sample is labelled with the global
``rank``, and with ``group`` (torch's group name), ``group_desc`` and ``op`` where they apply.

Served through prometheus-client's exposition on a registry of its own (never the global default
registry, which would publish the training process's own metrics as well) and collected on the
scraping thread: no thread of the client's.

Operations by op are counted from the recorder's ring at each scrape, so recording costs nothing
more: an operation that enters and leaves the ring between two scrapes (more than ``ring_size``
operations in one scrape interval) is counted in ``tether_operations_unseen_total`` instead. The
per-group collective counters come from the groups' sequence numbers and are exact; a group
formed again under the same name (``destroy_process_group`` then ``init_process_group``) adds to
its predecessor's count, as a counter must (one that lives and ends between two scrapes is not
seen).

A scrape only reads: it must not change what the rank records or dumps. Whether a group's last
operation failed is read from its backend's future without taking it from the recorder (a
dump's ``Recorder.find_failures`` does that, and still finds it).
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from collections.abc import Iterator

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector, CollectorRegistry

from tether.recorder.group import RecordedGroup
from tether.recorder.recorder import Recorder
from tether.recorder.ring import Entry
from tether.watchdog.watchdog import Watchdog

__all__ = ["RankMetrics"]

_GROUP_LABELS = ["rank", "group", "group_desc"]
_OP_LABELS = [*_GROUP_LABELS, "op"]


class RankMetrics(Collector):
    """The collector of one rank; :meth:`exposition` is what ``/metrics`` serves.

    ``events`` counts what the rank's job link did, keyed by (kind, alarm reason), kind one of
    "answered", "dumped", "dump_failed"; the link updates it, this class only reads it.
    """

    def __init__(self, recorder: Recorder, watchdog: Watchdog, events: Counter[tuple[str, str]]):
        self.recorder = recorder
        self.watchdog = watchdog
        self.events = events
        self._lock = threading.Lock()
        self._next_id = 0
        """The first record id not yet counted."""
        self._recorded: Counter[tuple[str, str, str]] = Counter()
        self._failed: Counter[tuple[str, str, str]] = Counter()
        self._failed_ids: set[int] = set()
        self._unseen = 0
        self._groups: dict[str, RecordedGroup] = {}
        """Each group name's group at the last scrape: its final counts are added to
        ``_retired`` once the name names another group."""
        self._retired: Counter[tuple[str, str, str]] = Counter()
        """(group, desc, enqueued | completed) -> the count of groups that name no longer names."""
        self._registry = CollectorRegistry(auto_describe=False)
        self._registry.register(self)

    def exposition(self) -> str:
        """Prometheus' text format (version 0.0.4)."""
        return generate_latest(self._registry).decode()

    def _count(self) -> None:
        """Count what entered the ring since the last scrape (the caller holds ``_lock``)."""
        rec = self.recorder
        entries = rec.ring.snapshot()
        for e in entries:
            if e.record_id >= self._next_id:
                # A gap: entries evicted before any scrape saw them (or still being written).
                self._unseen += e.record_id - self._next_id
                self._next_id = e.record_id + 1
                self._recorded[_key(e)] += 1
        # Set by a dump, or still only in the backend's future: each failed operation once.
        failed = [e for e in entries if e.error is not None] + _last_failed(rec)
        for e in failed:
            if e.record_id not in self._failed_ids:
                self._failed_ids.add(e.record_id)
                self._failed[_key(e)] += 1
        # Bounded by the ring, keeping the failures a group still holds as its last operation.
        oldest = entries[0].record_id if entries else self._next_id
        keep = {e.record_id for e in failed}
        self._failed_ids = {i for i in self._failed_ids if i >= oldest or i in keep}

    def _collectives(self) -> Counter[tuple[str, str, str]]:
        """Each group's enqueued and completed collectives, its predecessors' under the same
        name included (the caller holds ``_lock``)."""
        groups = dict(self.recorder.groups)
        for name, old in self._groups.items():
            if groups.get(name) is not old:  # formed again: the old one's counts are final
                self._retired[name, old.desc, "enqueued"] += old.seq
                self._retired[name, old.desc, "completed"] += old.last_completed
        self._groups = groups
        counts = Counter(self._retired)
        for name, pg in groups.items():
            counts[name, pg.desc, "enqueued"] += pg.seq
            counts[name, pg.desc, "completed"] += pg.last_completed
        return counts

    def collect(self) -> Iterator[Metric]:
        rec, now_ns = self.recorder, time.time_ns()
        rank = str(rec.global_rank)
        with self._lock:
            self._count()
            recorded, failed, unseen = dict(self._recorded), dict(self._failed), self._unseen
            collectives = self._collectives()

        family = CounterMetricFamily(
            "tether_operations_recorded",
            "Operations recorded, by group and op (counted from the ring at each scrape).",
            labels=_OP_LABELS,
        )
        for (group, desc, op), n in sorted(recorded.items()):
            family.add_metric([rank, group, desc, op], n)
        yield family
        yield _one(
            CounterMetricFamily,
            "tether_operations_unseen",
            "Operations that left the ring before a scrape could count them by op: scrape more "
            "often or raise ring_size.",
            rank,
            unseen,
        )
        family = CounterMetricFamily(
            "tether_operations_failed",
            "Operations the backend reported failed, by group and op.",
            labels=_OP_LABELS,
        )
        for (group, desc, op), n in sorted(failed.items()):
            family.add_metric([rank, group, desc, op], n)
        yield family

        enqueued = CounterMetricFamily(
            "tether_collectives_enqueued",
            "Collectives issued on each group (its sequence number).",
            labels=_GROUP_LABELS,
        )
        completed = CounterMetricFamily(
            "tether_collectives_completed",
            "Collectives completed on each group (its last completed sequence number).",
            labels=_GROUP_LABELS,
        )
        for (name, desc, what), n in sorted(collectives.items()):
            family = enqueued if what == "enqueued" else completed
            family.add_metric([rank, name, desc], n)
        yield enqueued
        yield completed

        inflight = rec.inflight()
        oldest = max(((now_ns - e.time_created_ns) / 1e9 for e in inflight), default=0.0)
        heartbeat = (time.monotonic_ns() - self.watchdog.heartbeat_ns) / 1e9
        for name, doc, value in (
            ("tether_operations_in_flight", "Operations issued and not completed.", len(inflight)),
            ("tether_oldest_in_flight_seconds", "Age of the oldest operation in flight.", oldest),
            ("tether_healthy", "1 unless the watchdog found a hang.", int(self.watchdog.healthy)),
            (
                "tether_watchdog_heartbeat_age_seconds",
                "Time since the watchdog thread last ran: large when the process is stuck.",
                heartbeat,
            ),
        ):
            yield _one(GaugeMetricFamily, name, doc, rank, value)

        events = dict(self.events)
        for kind, name, doc in (
            ("answered", "tether_alarms_answered", "Job-wide dump alarms this rank answered."),
            ("dumped", "tether_dumps_written", "Dumps this rank wrote for an alarm."),
            ("dump_failed", "tether_dump_failures", "Dumps this rank could not write."),
        ):
            family = CounterMetricFamily(name, f"{doc} By reason.", labels=["rank", "reason"])
            for (what, reason), n in sorted(events.items()):
                if what == kind:
                    family.add_metric([rank, reason], n)
            yield family


def _key(e: Entry) -> tuple[str, str, str]:
    return e.group.name, e.group.desc, e.profiling_name.split(" ")[0]


def _last_failed(rec: Recorder) -> list[Entry]:
    """Each group's last finished operation whose backend says it failed. Reads the group's
    ``last_done`` without taking it, and changes neither the entry nor the work."""
    failed = []
    for group in list(rec.groups.values()):
        last = group.last_done
        if last is None or last[1] is None or last[0].error is not None:
            continue
        entry, work = last
        try:
            future = work.get_future()
            if not future.done():
                continue
        except Exception:  # a backend without futures cannot say
            continue
        try:
            future.value()
        except Exception:  # the operation's own error
            failed.append(entry)
    return failed


def _one(
    kind: type[CounterMetricFamily] | type[GaugeMetricFamily],
    name: str,
    doc: str,
    rank: str,
    value: float,
) -> Metric:
    """A family of one sample, labelled with the rank alone."""
    family = kind(name, doc, labels=["rank"])
    family.add_metric([rank], value)
    return family
