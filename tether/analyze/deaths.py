"""What an event says about the ranks that could not speak for themselves: how a dead rank died,
whether its stacks at death or its record survived it, and what a live rank that never answered
was doing (stopped, stuck in the kernel), from the ``stacks_<rank>.txt`` headers
(:mod:`tether.events.stacks`) and the alarm's ``dead_ranks``."""

from __future__ import annotations

import math

from tether.analyze.event import Event
from tether.analyze.model import SigInfo
from tether.events.stacks import StacksHeader

__all__ = [
    "ABORT_HINT",
    "death_notes",
    "died",
    "frozen_state",
    "nbytes",
    "stacks_dead",
    "unresponsive",
]

ABORT_HINT = (
    'gloo aborts a process that receives more bytes than it expects ("Received data size '
    "doesn't match expected size\" -> SIGABRT)"
)

# Bytes per element of the c10 scalar-type names the recorders write.
_ITEMSIZE = {
    "Float": 4,
    "Double": 8,
    "Half": 2,
    "BFloat16": 2,
    "Char": 1,
    "Byte": 1,
    "Short": 2,
    "Int": 4,
    "Long": 8,
    "Bool": 1,
    "ComplexFloat": 8,
    "ComplexDouble": 16,
    "ComplexHalf": 4,
    "Float8_e4m3fn": 1,
    "Float8_e5m2": 1,
}


def nbytes(s: SigInfo) -> int | None:
    """The bytes of an operation's input, None where a dtype is unknown."""
    total = 0
    if len(s.input_dtypes) != len(s.input_sizes):
        return None
    for shape, dt in zip(s.input_sizes, s.input_dtypes, strict=True):
        size = _ITEMSIZE.get(dt)
        if size is None or not isinstance(shape, list):
            return None
        total += size * math.prod(d for d in shape if isinstance(d, int))
    return total


def unresponsive(h: StacksHeader | None) -> bool:
    """The stacks were read from a live rank that did not answer the alarm."""
    return h is not None and h.get("when") == "unresponsive" and h.get("state") != "zombie"


def died(h: StacksHeader | None) -> bool:
    return h is not None and (h.get("when") == "death" or h.get("state") == "zombie")


def stacks_dead(ev: Event) -> dict[int, str]:
    """Ranks without a dump whose stacks file says they died, with how (for an event whose
    alarm does not record them dead)."""
    out = {}
    for r, h in sorted(ev.stacks.items()):
        if r not in ev.ranks and died(h):
            sig = h.get("signal")
            out[r] = f"signal {sig}" if sig else "exited (its stacks file says so)"
    return out


_STATES = {
    "stopped": "alive but stopped (SIGSTOP or a debugger)",
    "tracing-stop": "alive but stopped by a debugger or tracer",
    "disk-sleep": "alive but stuck in the kernel (uninterruptible sleep{in})",
    "sleeping": "alive but blocked{in} and did not answer the alarm",
    "running": "alive and running but did not answer the alarm (busy in code holding the GIL)",
}


def frozen_state(h: StacksHeader) -> str:
    """``alive but stopped (SIGSTOP or a debugger)``: what a live, unresponsive rank was doing."""
    state = h.get("state") or ""
    syscall = h.get("syscall")
    where = f" in {syscall}" if syscall else ""
    text = _STATES.get(state, "alive but did not answer the alarm{in}").format(**{"in": where})
    how = {
        "py-spy": "read by py-spy from outside, without disturbing it",
        "faulthandler": "written by faulthandler through a signal, which may have interrupted it",
    }.get(h.get("method") or "")
    return f"{text} (its stacks {how})" if how else text


def death_notes(ev: Event, dead: dict[int, str]) -> list[str]:
    """Per dead rank: its record recovered after its death, its stacks at its death, or what is
    lost with it and why."""
    notes = []
    for r, how in sorted(dead.items()):
        h = ev.stacks.get(r)
        if r in ev.recovered:
            notes.append(f"rank {r}'s record was recovered after its death ({ev.recovered[r]})")
        if h is not None and h.get("when") == "death":
            sig = h.get("signal") or how
            notes.append(f"rank {r}'s stacks at its death ({sig}) are in stacks_{r}.txt")
        elif h is None and "SIGKILL" in how:
            lost = "" if r in ev.ranks else " and its record"
            notes.append(
                f"rank {r} died of SIGKILL: no handler can run on SIGKILL, so its stacks at its "
                f"death{lost} are lost"
            )
        elif h is None and how.startswith("signal"):
            notes.append(
                f"rank {r} died ({how}) and left no stacks_{r}.txt: no fatal-signal handler "
                "wrote its stacks"
            )
    return notes
