"""The human-readable form of a :class:`Diagnosis`: the verdict and the culprit first, then the
collective, where the culprit was, and the evidence."""

from __future__ import annotations

from tether.analyze.diagnosis import Diagnosis
from tether.analyze.event import compress_ranks

__all__ = ["render"]

_HEADLINE = {
    "hang": "HANG",
    "desync": "DESYNC",
    "crash": "CRASH",
    "straggler": "STRAGGLER",
    "healthy": "HEALTHY",
    "inconclusive": "INCONCLUSIVE",
    "node_lost": "NODE LOST",
    "node_unreachable": "NODE UNREACHABLE",
    "node_frozen": "NODE FROZEN",
    "partition": "PARTITION",
}


def render(diagnosis: Diagnosis) -> str:
    d = diagnosis
    culprits = compress_ranks(d.culprit_ranks) if d.culprit_ranks else "none named"
    head = f"{_HEADLINE[d.verdict]}: culprit rank(s) {culprits}"
    if d.verdict == "healthy":
        head = "HEALTHY: nothing wrong found"
    elif d.verdict == "inconclusive" and not d.culprit_ranks:
        head = f"INCONCLUSIVE: no usable dump from rank(s) {compress_ranks(d.missing_dumps)}"
    elif d.verdict == "partition":
        n = d.nodes[0]
        when = f" at {n.last_heard}" if n.last_heard else ""
        head = (
            f"PARTITION: {n.host} (rank(s) {compress_ranks(n.ranks) or '?'}) and the rest of the "
            f"job lost each other{when}; both sides were alive"
        )
    elif d.nodes:
        head = f"{_HEADLINE[d.verdict]}: " + "; ".join(
            f"{n.host} (rank(s) {compress_ranks(n.ranks) or '?'})"
            + (f", last heard at {n.last_heard}" if n.last_heard else "")
            for n in d.nodes
        )
    lines = [f"event {d.event}  ({d.ranks_loaded} of {d.world_size} ranks' dumps read)", head]
    if d.process_group is not None:
        g = d.process_group
        desc = f" ({g.desc})" if g.desc else ""
        lines.append(f"  group      {g.name}{desc}, ranks {compress_ranks(g.ranks) or '?'}")
    if d.op is not None:
        seq = f" seq {d.collective_seq_id}" if d.collective_seq_id is not None else ""
        lines.append(f"  operation  {d.op}{seq}")
    if d.sizes is not None and d.dtypes is not None:
        lines.append(
            f"  sizes      in {d.sizes['input']} out {d.sizes['output']}  "
            f"dtypes {','.join(d.dtypes['input']) or '-'}"
        )
    for r in d.culprit_ranks[:8]:
        where = d.culprit_stacks.get(r)
        line = f"  rank {r:<5} {_on(d, r)}{d.per_rank.get(r, '')}".rstrip()
        lines.append(line)
        if r in d.exceptions:
            lines.append(f"             raised {d.exceptions[r]}")
        if where:
            lines.append(f"             at {where}")
    if len(d.culprit_ranks) > 8:
        lines.append(f"  … {len(d.culprit_ranks) - 8} more culprit ranks (see --json)")
    for r, what in list(d.consequences.items())[:8]:
        lines.append(f"  rank {r:<5} {_on(d, r)}(a consequence, not the cause) {what}")
    for s in d.stragglers[:5]:
        lines.append(
            f"  straggler rank {s.rank}: {s.mean_lag_ms:.1f} ms late on average "
            f"({s.late_fraction:.0%} of {s.collectives} collectives)"
        )
    for u in d.unmatched_p2p[:5]:
        lines.append(
            f"  unmatched p2p {u.src}->{u.dst} in group {u.group}: {u.sends} send(s) pending, "
            f"{u.recvs} matching recv(s) posted"
        )
    if d.regroups:
        lines.append("the job went on (--elastic):")
        lines.extend(f"  - {s}" for s in d.regroups)
    if d.evidence:
        lines.append("evidence:")
        lines.extend(f"  - {e}" for e in d.evidence)
    return "\n".join(lines)


def _on(d: Diagnosis, rank: int) -> str:
    """``(node1) `` where the event spans hosts and the line does not say it already."""
    host = d.hosts.get(rank)
    if host is None or d.nodes:
        return ""
    return f"({host}) "
