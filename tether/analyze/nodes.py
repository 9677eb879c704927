"""The node-fault verdicts: a whole node its job's launchers declared lost, unreachable or
frozen, every rank it ran, and what became of the others (their collectives failed on the
broken connections, or wait for ranks that will never come).

The launcher that watches the nodes raised the event's alarm; it names the node (``nodes``, with
when it was last heard) and each of its ranks dead as ``"<host> <state>"``. The ranks' records
are on that node, out of reach: what is known of them is what the survivors saw.
"""

from __future__ import annotations

import json
import re

from tether.analyze.diagnosis import NODE_VERDICTS, NodeFault, Verdict
from tether.analyze.event import Event, compress_ranks
from tether.analyze.findings import HangOp, Wait
from tether.analyze.verdict import Finding, Where
from tether.analyze.words import MAX_PER_RANK
from tether.analyze.words import first as _first
from tether.analyze.words import gname as _gname
from tether.analyze.words import last_progress as _last_progress
from tether.analyze.words import locate as _locate
from tether.analyze.words import what as _what
from tether.events.layout import clock, nodes_file

__all__ = ["node_fault"]

_PEER_ERROR = re.compile(
    r"(Connection (?:closed|reset) by peer|Connection refused|Read error|Write error|"
    r"Timed out|timed out)[^\[]*(\[[^\]]+\](?::\d+)?)?"
)
_STATE_WORDS = {
    "lost": "its launcher and all its ranks stopped answering",
    "unreachable": "nothing there answers: the host is down, or the link to it",
    "frozen": "its host answers, but its launcher and ranks make no progress",
}


def node_fault(ev: Event, waits: list[Wait], hop: HangOp | None) -> Finding | None:
    """A node fault when the event's alarm declares one, or when a node's part of the event
    could not be brought to it (its ranks' dumps are on its disk, out of reach: they are not
    dead); None otherwise."""
    alarm = ev.alarm
    faults = []
    evidence: list[str] = []
    # Rank -> host, with the hosts of the parts that could not be brought here.
    hosts = ev.hosts
    if alarm is not None and alarm.nodes:
        for node in alarm.nodes:
            ranks = sorted(r for r, h in ev.hosts.items() if h == node.host)
            heard = clock(node.heard_ns) if node.heard_ns else None
            faults.append(
                NodeFault(host=node.host, state=node.state, ranks=ranks, last_heard=heard)
            )
    elif not ev.dead_ranks and not ev.exceptions:
        # (A death or an exception recorded here is the fault; a late part is only a gap.)
        for host, (ranks, why, heard_ns) in _missing_parts(ev).items():
            heard = clock(heard_ns) if heard_ns else None
            faults.append(NodeFault(host=host, state="unreachable", ranks=ranks, last_heard=heard))
            evidence.append(
                f"{host}'s part of the event ({_span(ranks)}) could not be brought here: {why}; "
                f"their dumps are on {host}'s own disk"
            )
            hosts = {**hosts, **dict.fromkeys(ranks, host)}
    if not faults:
        return None
    first = faults[0]
    verdict: Verdict = NODE_VERDICTS.get(first.state, "node_lost")
    culprits = sorted({r for f in faults for r in f.ranks})
    for f in faults:
        at = f" at {f.last_heard}" if f.last_heard else ""
        words = _STATE_WORDS.get(f.state, f.state)
        evidence.append(
            f"{f.host} ({_span(f.ranks)}) {f.state}{at}: {words} (its launcher was last heard "
            "then, by the launcher that declared it)"
        )
    # The node declared unreachable was alive all along: its ranks' records came back with its
    # launcher once the link did. Each side lost the other: a partition, not a lost node.
    back = [r for r in first.ranks if r in ev.ranks]
    if first.state == "unreachable" and back:
        verdict = "partition"
        said = sorted(
            {t.alarm.detail for t in ev.ranks.values() if t.alarm and t.alarm.reason == "cut_off"}
        )
        evidence.append(
            f"{first.host}'s ranks were alive: {_span(back)}'s records came back with its "
            "launcher once the link did"
            + "".join(f"; {first.host}'s launcher said: {s}" for s in said[:2])
        )
    per_rank = {
        r: f"on {_host(hosts, r)}; last known progress: {_last_progress(ev, r)}"
        for r in culprits[:MAX_PER_RANK]
    }
    lost = set(culprits)
    # What the survivors went through: an operation the backend failed (the connection to the
    # node broke), or a wait for the node's ranks.
    broken = {r: tr.failed[-1] for r, tr in sorted(ev.ranks.items()) if tr.failed}
    blocked = [w for w in waits if set(w.blockers) & lost]
    where = ""
    located: Where | None = None
    if blocked:
        w = _first(hop, [x for x in blocked if set(x.blockers) <= lost] or blocked)
        located = _locate(ev, w.group, w.seq, w.sig, w.kind)
        where = f" in {_what(ev, w)} (group {_gname(ev, w.group)})"
    consequences = {
        r: f"on {_host(hosts, r)}: the backend failed its operation{where}: {_peer(error)}"
        for r, error in broken.items()
    }
    if broken:
        evidence.append(
            f"{_span(list(broken))} then failed{where} ({_peer(next(iter(broken.values())))}): "
            f"the connection to {first.host} broke"
        )
    waiting = sorted(w.rank for w in blocked if w.rank not in broken)
    for r in waiting:
        consequences.setdefault(r, f"on {_host(hosts, r)}: waited{where} for {first.host}'s ranks")
    if waiting:
        evidence.append(f"{_span(waiting)} waited{where} for {first.host}'s ranks")
    for r in sorted(set(ev.ranks) - lost - set(consequences)):
        # Between operations when its peers' node went: it had nothing in flight to fail.
        consequences[r] = (
            f"on {_host(hosts, r)}: nothing in flight when {first.host} went; "
            f"last known progress: {_last_progress(ev, r)}"
        )
    return Finding(
        verdict=verdict,
        culprits=tuple(culprits),
        where=located,
        evidence=tuple(evidence),
        per_rank=per_rank,
        consequences=consequences,
        nodes=tuple(faults),
    )


def _missing_parts(ev: Event) -> dict[str, tuple[list[int], str, int]]:
    """Host -> (ranks, why, last heard) of each node whose part of the event is missing (the
    event's ``nodes.json``), where none of those ranks' dumps is here."""
    try:
        data = json.loads(nodes_file(ev.path).read_text()[:1_000_000])
        entries = [e for e in data["nodes"] if isinstance(e, dict)][:4096]
    except (OSError, ValueError, KeyError, TypeError):
        return {}
    out = {}
    for e in entries:
        ranks = [r for r in e.get("ranks", []) if isinstance(r, int) and 0 <= r < ev.world_size]
        host = e.get("host")
        if e.get("part") != "missing" or not isinstance(host, str) or not ranks:
            continue
        if any(r in ev.ranks for r in ranks):
            continue  # brought after all (a later copy)
        heard = e.get("last_heard_ns")
        why = str(e.get("why") or "unreachable")[:300]
        out[host[:100]] = (sorted(ranks), why, heard if isinstance(heard, int) else 0)
    return out


def _peer(error: str) -> str:
    """The part of a backend's error that says which peer broke: ``Connection reset by peer
    [10.97.0.2]:41615``."""
    m = _PEER_ERROR.search(error)
    if m is None:
        return error.splitlines()[0][:200] if error else "no error recorded"
    return " ".join(x for x in m.groups() if x)


def _host(hosts: dict[int, str], rank: int) -> str:
    return hosts.get(rank, "an unknown host")


def _span(ranks: list[int]) -> str:
    return f"rank{'s' if len(ranks) > 1 else ''} {compress_ranks(ranks)}" if ranks else "no rank"
