"""What each rank publishes about itself (``GET /health``): written by the rank's report,
read by rank 0's cluster page and by anyone scraping a rank. A reader gets it over HTTP from
another process, so it reads every key with ``.get``: an older or foreign rank may lack one."""

from __future__ import annotations

from typing import TypedDict

__all__ = ["GroupHealth", "HealthReport", "InFlightOp"]


class InFlightOp(TypedDict):
    """An operation issued and not yet seen completed."""

    record_id: int
    op: str
    """Its profiling name (``gloo:all_reduce``)."""
    group: str
    group_desc: str
    collective_seq_id: int
    is_p2p: bool
    state: str
    age_s: float


class GroupHealth(TypedDict):
    desc: str
    ranks: list[int]
    last_enqueued_collective: int
    last_started_collective: int
    last_completed_collective: int


class HealthReport(TypedDict, total=False):
    rank: int
    world_size: int
    host: str
    pid: int
    healthy: bool
    """False once the watchdog saw an operation outlive the hang timeout."""
    hung: InFlightOp | None
    hang_timeout_s: float
    watchdog_heartbeat_age_s: float
    in_flight: list[InFlightOp]
    groups: dict[str, GroupHealth]
    alarm_source: str | None
    """Where the rank hears of the job's alarms: "agent" (``tether run``'s agent on its node
    relays them), "store" (it looks in the job's store itself), None (it has not joined them)."""
