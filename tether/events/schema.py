"""What a rank's dump holds (docs/dump-format.md): torch's flight-recorder schema, plus a
``tether`` section that torch's analyzer never reads. Shared by the writer (the recorder) and
the readers (``tether analyze``, ``tether show``)."""

from __future__ import annotations

from typing import Final, NotRequired, TypedDict

__all__ = [
    "ELIDED",
    "FORMING",
    "LEFT",
    "MAX_WORLD",
    "P2P_SEQ_BASE",
    "SCHEMA_VERSION",
    "TETHER_FORMAT",
    "DumpEntry",
    "Frame",
]


FORMING = "forming"
"""The key, in a dump's ``tether`` section, of the group creation the rank waits in past its hang
timeout: {op, group, group_desc, ranks, missing, rank, since_ns, waited_s}."""
LEFT = "left the job (exit code 0)"
"""How an alarm's ``dead_ranks`` names a rank that returned while still a member of the job's
groups (the others went on without it)."""

MAX_WORLD = 1 << 22
"""Largest world size believed: a dump (or file name) claiming more is hostile or corrupt, and
taking it would enumerate every rank of it (the missing ranks, the default group's members)."""

SCHEMA_VERSION = "2.10"
"""torch's flight-recorder schema version that the dumps follow."""
TETHER_FORMAT = 1
"""Version of the ``tether`` section."""
P2P_SEQ_BASE = 1 << 31
"""p2p ops are counted per group, as torch's NCCL recorder does, but from this base: torch's
analyzer fuses a collective and a following p2p op of the same group into one "coalesced" op
when their collective_seq_id and p2p_seq_id are equal, and then crashes. Disjoint ranges keep
every real pair apart; subtract the base to get the count."""


ELIDED: Final = "elided"
"""Key of a frame: how many frames were left out between it and the frame before (inner) one;
the recorder keeps the first frame outside torch and the standard library past its depth."""


class Frame(TypedDict):
    """One Python frame of an entry's stack, innermost first."""

    name: str
    filename: str
    line: int
    elided: NotRequired[int]
    """:data:`ELIDED`."""


class DumpEntry(TypedDict):
    """One operation of a dump's ``entries``, as torch's recorder writes it."""

    record_id: int
    pg_id: int
    process_group: tuple[str, str]
    """(name, desc)."""
    collective_seq_id: int
    p2p_seq_id: int
    op_id: int
    profiling_name: str
    time_created_ns: int
    duration_ms: float | None
    input_sizes: list[list[int]]
    input_dtypes: list[str]
    output_sizes: list[list[int]]
    output_dtypes: list[str]
    state: str
    """"scheduled", "started" or "completed"."""
    time_discovered_started_ns: int | None
    time_discovered_completed_ns: int | None
    retired: bool
    timeout_ms: int
    is_p2p: bool
    thread_id: str
    thread_name: str
    frames: list[Frame]
