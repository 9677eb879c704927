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
        who = ", ".join(f"rank {r} ({how})" for r, how in sorted(dead.items(), key=_rank))
        parts.append(f"{who} died{step}")
    if decision.get("stop"):
        parts.append(f"the job stopped: {decision['stop']}")
        return "; ".join(parts)
    joined = decision.get("joined") or []
    if joined:
        healed = ""
        if regrouped and regrouped.get("heal_bytes"):
            healed = f", healed from a survivor ({regrouped['heal_bytes']} bytes in "
            healed += f"{regrouped['heal_s']:.2f} s)"
        ranks = ", ".join(str(r) for r in joined)
        parts.append(f"replacement for rank {ranks} joined{step}{healed}")
    if not regrouped:
        parts.append(
            f"epoch {decision['epoch']}: {len(members)} rank(s) {members} (regroup not reported)"
        )
    elif dead:
        parts.append(f"survivors regrouped to {len(members)} rank(s){took}")
    return "; ".join(parts)


def _rank(item: tuple[str, Any]) -> int:
    return int(item[0])
