"""What an elastic job (``tether run --elastic``) went through after the deaths of an event, in
sentences: who died at which step, how fast the survivors regrouped, when a replacement joined.
Read from the event's timeline file, which the launcher keeps up to date while the job goes on."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tether.events.layout import elastic_timeline_file

__all__ = ["regroup_sentences"]


def regroup_sentences(event_dir: Path) -> list[str]:
    """One sentence per membership change; empty where the event has no timeline (not an
    elastic job) or an unreadable one (said in the sentence)."""
    path = elastic_timeline_file(event_dir)
    if not path.exists():
        return []
    try:
        data = json.loads(path.read_text())
        epochs = [e for e in data["epochs"] if isinstance(e, dict)]
        return [s for e in epochs if (s := _sentence(e["decision"], e.get("regrouped")))]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return [f"the elastic timeline {path} could not be read ({exc})"]


def _sentence(decision: dict[str, Any], regrouped: dict[str, Any] | None) -> str:
    members = decision["members"]
    step = f" at step {regrouped['step']}" if regrouped else ""
    took = f" in {regrouped['since_decision_s']:.2f} s" if regrouped else ""
    parts = []
    dead = decision.get("dead") or {}
    if dead:
        parts.append(_deaths(dead) + step)
    if decision.get("stop"):
        parts.append(f"the job stopped: {decision['stop']}")
        return "; ".join(parts)
    joined = decision.get("joined") or []
    if joined:
        healed = ""
        if regrouped and regrouped.get("heal_bytes"):
            over = f" over {regrouped['heal_over']}" if regrouped.get("heal_over") else ""
            healers = int(regrouped.get("healers") or 1)
            source = "a survivor" if healers == 1 else f"{healers} survivors, shard by shard"
            healed = f", healed from {source} ({_size(regrouped['heal_bytes'])} in "
            healed += f"{regrouped['heal_s']:.2f} s{over})"
        on = f" on {decision['joined_on']}" if decision.get("joined_on") else ""
        parts.append(f"replacement for {_ranks(joined)} joined{on}{step}{healed}")
    if not regrouped:
        parts.append(
            f"epoch {decision['epoch']}: {len(members)} rank(s) {members} (regroup not reported)"
        )
    elif dead or joined:
        parts.append(f"{'survivors ' if dead else ''}regrouped to {len(members)} rank(s){took}")
    return "; ".join(parts)


def _deaths(dead: dict[str, str]) -> str:
    """``node2 (ranks 4-5) lost`` for a node lost whole, ``rank 3 (signal SIGKILL) died``."""
    lost: dict[str, list[int]] = {}
    ranks = []
    for rank, how in sorted(dead.items(), key=_rank):
        if how.endswith(" lost"):
            lost.setdefault(how.removesuffix(" lost"), []).append(int(rank))
        else:
            ranks.append(f"rank {rank} ({how})")
    said = [f"{host} ({_ranks(r)}) lost" for host, r in lost.items()]
    if ranks:
        said.append(f"{', '.join(ranks)} died")
    return ", ".join(said)


def _ranks(ranks: list[int]) -> str:
    ranks = sorted(int(r) for r in ranks)
    if len(ranks) > 1 and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 1e5 else f"{nbytes} bytes"


def _rank(item: tuple[str, Any]) -> int:
    return int(item[0])
