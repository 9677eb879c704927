"""Rank 0's ``GET /metrics/job``: every rank's ``/metrics`` in one exposition, each sample
labelled with the rank it came from, and ``tether_rank_up`` saying which ranks answered. One
scrape target then covers the job, and Prometheus can sum it (``sum by (op)
(rate(tether_operations_recorded_total[1m]))``).

Each family appears once, with the samples of every rank under it, as the text format requires;
a rank's text that cannot be parsed counts as a rank that did not answer.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry

__all__ = ["job_exposition"]

Answer = tuple[str | None, str | None]
"""A rank's exposition, or None and why not."""


class _Job(Collector):
    def __init__(self, answers: Mapping[int, Answer]) -> None:
        self.answers = answers

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            "tether_rank_up", "1 if the rank's debug server answered this scrape.", labels=["rank"]
        )
        # By the name written out (a counter's with _total): two families of one name, or a
        # second tether_rank_up, would make the whole exposition invalid.
        merged: dict[str, Metric] = {_exposed(up): up}
        for rank, (text, _) in sorted(self.answers.items()):
            families = _parse(text) if text is not None else None
            up.add_metric([str(rank)], int(families is not None))
            for family in families or ():
                into = merged.setdefault(
                    _exposed(family), Metric(family.name, family.documentation, family.type)
                )
                if into is up or (into.name, into.type) != (family.name, family.type):
                    continue  # ranks of different tether versions disagree: keep the first
                # The rank a sample came from, whatever the rank itself said; _replace keeps
                # the other fields (timestamp, exemplar) as they were.
                into.samples += [
                    s._replace(labels={**s.labels, "rank": str(rank)}) for s in family.samples
                ]
        yield from merged.values()


def _exposed(family: Metric) -> str:
    return f"{family.name}_total" if family.type == "counter" else family.name


def _parse(text: str) -> list[Metric] | None:
    try:
        return list(text_string_to_metric_families(text))
    except (ValueError, TypeError, IndexError, KeyError):
        return None


def job_exposition(answers: Mapping[int, Answer]) -> bytes:
    """The text format (0.0.4) of every rank's metrics; ``answers`` maps each global rank to
    its ``/metrics`` text, or to None when it did not answer."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Job(answers))
    return generate_latest(registry)
