"""Rank 0's ``GET /metrics/job``: every rank's ``/metrics`` in one exposition, so that one scrape
target covers the job and Prometheus can sum it (``sum by (op)
(rate(tether_operations_recorded_total[1m]))``).

By rank, each sample is labelled with the rank it came from and ``tether_rank_up`` says which
ranks answered. By node (a large job), the samples of a node's ranks are folded into one per
node and ``group_desc`` (the group's own ``group`` name is left out: a job has as many groups as
it has ranks, a node only a few kinds of group): a counter is the sum over the node's ranks, as
Prometheus sums counters; a gauge the sum, the least or the most, as :data:`GAUGE_FOLD` says
and its help repeats. ``tether_node_ranks`` and ``tether_node_ranks_up`` then say how many
ranks each node has and how many answered. The size grows with the nodes, not the ranks.

Each family appears once, as the text format requires; a rank's text that cannot be parsed
counts as a rank that did not answer.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.exposition import generate_latest
from prometheus_client.metrics_core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector, CollectorRegistry
from prometheus_client.samples import Sample

__all__ = ["GAUGE_FOLD", "Families", "job_exposition", "parse_exposition"]

Families = list[Metric]
GAUGE_FOLD: Mapping[str, tuple[str, Callable[[Iterable[float]], float]]] = {
    "tether_operations_in_flight": ("sum", sum),
    "tether_healthy": ("min", min),
}
"""How a gauge of several ranks becomes one per node; any other gauge (an age, a time) takes
the most."""
UNKNOWN_NODE = "unknown"
"""The node of a rank that never said where it runs."""


class _Job(Collector):
    def __init__(
        self, parsed: Mapping[int, Families | None], nodes: Mapping[int, str | None] | None
    ) -> None:
        self.parsed = dict(sorted(parsed.items()))
        self.nodes = nodes

    def collect(self) -> Iterator[Metric]:
        if self.nodes is None:
            yield from _by_rank(self.parsed)
        else:
            nodes = {rank: self.nodes.get(rank) or UNKNOWN_NODE for rank in self.parsed}
            yield from _by_node(self.parsed, nodes)


def _by_rank(parsed: Mapping[int, Families | None]) -> Iterator[Metric]:
    up = GaugeMetricFamily(
        "tether_rank_up", "1 if the rank's debug server answered this scrape.", labels=["rank"]
    )
    # By the name written out (a counter's with _total): two families of one name, or a second
    # tether_rank_up, would make the whole exposition invalid.
    merged: dict[str, Metric] = {_exposed(up): up}
    for rank, families in parsed.items():
        up.add_metric([str(rank)], int(families is not None))
        for family in families or ():
            into = _into(merged, family)
            if into is None or into is up:
                continue
            # The rank a sample came from, whatever the rank itself said; _replace keeps the
            # other fields (timestamp, exemplar) as they were.
            into.samples += [
                s._replace(labels={**s.labels, "rank": str(rank)}) for s in family.samples
            ]
    yield from merged.values()


def _by_node(parsed: Mapping[int, Families | None], nodes: Mapping[int, str]) -> Iterator[Metric]:
    ranks = GaugeMetricFamily("tether_node_ranks", "Ranks on the node.", labels=["node"])
    up = GaugeMetricFamily(
        "tether_node_ranks_up",
        "Ranks on the node whose debug server answered this scrape.",
        labels=["node"],
    )
    counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    merged: dict[str, Metric] = {_exposed(ranks): ranks, _exposed(up): up}
    values: dict[str, dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]] = {}
    for rank, families in parsed.items():
        node = nodes[rank]
        counts[node][0] += 1
        counts[node][1] += families is not None
        for family in families or ():
            into = _into(merged, family)
            if into is None or into in (ranks, up):
                continue
            folded = values.setdefault(_exposed(into), defaultdict(list))
            for s in family.samples:
                labels = {k: v for k, v in s.labels.items() if k not in ("rank", "group")}
                folded[s.name, tuple(sorted({**labels, "node": node}.items()))].append(s.value)
    for node, (known, answered) in sorted(counts.items()):
        ranks.add_metric([node], known)
        up.add_metric([node], answered)
    for name, folded in values.items():
        family = merged[name]
        how, fold = (
            ("sum", sum) if family.type != "gauge" else GAUGE_FOLD.get(family.name, ("most", max))
        )
        family.documentation += f" Per node: the {how} over its ranks."
        family.samples = [
            Sample(sample, dict(labels), fold(vs)) for (sample, labels), vs in folded.items()
        ]
    yield from merged.values()


def _into(merged: dict[str, Metric], family: Metric) -> Metric | None:
    """The family of ``merged`` that takes ``family``'s samples; None if one of that name has
    another type (ranks of different tether versions disagree: the first is kept)."""
    into = merged.setdefault(
        _exposed(family), Metric(family.name, family.documentation, family.type)
    )
    return into if (into.name, into.type) == (family.name, family.type) else None


def _exposed(family: Metric) -> str:
    return f"{family.name}_total" if family.type == "counter" else family.name


def parse_exposition(text: str) -> tuple[Families | None, str | None]:
    """A rank's ``/metrics`` text as families, or None and why not."""
    try:
        return list(text_string_to_metric_families(text)), None
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        return None, f"not Prometheus' text format: {type(exc).__name__}: {exc}"


def job_exposition(
    parsed: Mapping[int, Families | None], *, nodes: Mapping[int, str | None] | None = None
) -> bytes:
    """The text format (0.0.4) of every rank's metrics; ``parsed`` maps each global rank to its
    ``/metrics`` (:func:`parse_exposition`), or to None when it did not answer. With ``nodes``
    (each rank's host, None if unknown), folded per node."""
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Job(parsed, nodes))
    return generate_latest(registry)
