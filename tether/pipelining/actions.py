"""The pipeline schedule IR of torch 2.15: torch 2.13's actions plus ``WAIT_SEND_F``,
``WAIT_SEND_B`` and ``WAIT_REDUCE_GRAD``, with 2.15's strings, so a schedule CSV written by either
loads in the other.

The computation type is a ``str`` enum like torch's: a member compares and hashes as its string,
so tether's actions run through torch's own runtime code (``comp_type == SEND_F``) and torch's
actions compare equal to tether's.
"""

from __future__ import annotations

import re
from enum import Enum
from typing import Any, NamedTuple

__all__ = ["_Action", "_ComputationType", "from_torch", "send_of", "wait_for"]


class _ComputationType(str, Enum):
    FORWARD = "F"
    BACKWARD_INPUT = "I"
    BACKWARD_WEIGHT = "W"
    UNSHARD = "UNSHARD"
    RESHARD = "RESHARD"
    SEND_F = "SEND_F"
    RECV_F = "RECV_F"
    SEND_B = "SEND_B"
    RECV_B = "RECV_B"
    FULL_BACKWARD = "B"
    OVERLAP_F_B = "OVERLAP_F_B"
    REDUCE_GRAD = "REDUCE_GRAD"
    WAIT_SEND_F = "WAIT_SEND_F"
    WAIT_SEND_B = "WAIT_SEND_B"
    WAIT_REDUCE_GRAD = "WAIT_REDUCE_GRAD"

    @staticmethod
    def from_str(action: str) -> _ComputationType:
        try:
            return _ComputationType(action)
        except ValueError as exc:
            raise RuntimeError(f"Invalid computation type {action}") from exc


F = _ComputationType.FORWARD
I = _ComputationType.BACKWARD_INPUT  # noqa: E741  (torch's shorthand)
W = _ComputationType.BACKWARD_WEIGHT
B = _ComputationType.FULL_BACKWARD
UNSHARD = _ComputationType.UNSHARD
RESHARD = _ComputationType.RESHARD
SEND_F = _ComputationType.SEND_F
RECV_F = _ComputationType.RECV_F
SEND_B = _ComputationType.SEND_B
RECV_B = _ComputationType.RECV_B
OVERLAP_F_B = _ComputationType.OVERLAP_F_B
REDUCE_GRAD = _ComputationType.REDUCE_GRAD
WAIT_SEND_F = _ComputationType.WAIT_SEND_F
WAIT_SEND_B = _ComputationType.WAIT_SEND_B
WAIT_REDUCE_GRAD = _ComputationType.WAIT_REDUCE_GRAD

SENDS = {SEND_F: WAIT_SEND_F, SEND_B: WAIT_SEND_B}
"""A send's type -> the type of the action that waits for it."""
SEND_WAITS = {wait: send for send, wait in SENDS.items()}
"""The type of a send's wait -> the send's type."""
COMPUTE = frozenset({F, I, W, B, OVERLAP_F_B})

# Longest names first: "1WAIT_SEND_F0" must not parse as "1W" (2.13's order would).
_NAMES = sorted((t.value for t in _ComputationType), key=len, reverse=True)
_ACTION = re.compile(rf"(\d+)({'|'.join(_NAMES)})(\d*)$")


class _Action(NamedTuple):
    stage_index: int
    computation_type: _ComputationType
    microbatch_index: int | None = None
    sub_actions: tuple[_Action, ...] | None = None

    def __repr__(self) -> str:
        if self.sub_actions is not None:
            inner = ";".join(repr(a) for a in self.sub_actions)
            return f"({inner}){self.computation_type.value}"
        mb = "" if self.microbatch_index is None else str(self.microbatch_index)
        return f"{self.stage_index}{self.computation_type.value}{mb}"

    def __str__(self) -> str:
        return self.__repr__()

    @property
    def is_compute_op(self) -> bool:
        return self.computation_type in COMPUTE

    @staticmethod
    def from_str(action_string: str) -> _Action | None:
        """Reverse of ``repr``: ``"2F0"``, ``"3WAIT_SEND_F1"``, ``"(0F1;1B0)OVERLAP_F_B"``."""
        text = action_string.strip()
        if not text:
            return None
        if text.startswith("(") and ")" in text:
            end = text.find(")")
            subs = tuple(
                a for part in text[1:end].split(";") if (a := _Action.from_str(part)) is not None
            )
            return _Action(-1, _ComputationType.from_str(text[end + 1 :]), None, subs or None)
        found = _ACTION.match(text)
        if found is None:
            raise RuntimeError(
                f"Invalid action string: {text}, should be formatted as "
                "[stage][action type][(microbatch)] e.g. 2F0"
            )
        stage, kind, mb = found.groups()
        return _Action(int(stage), _ComputationType.from_str(kind), int(mb) if mb else None)


def wait_for(send: _Action) -> _Action:
    """The action that waits for ``send`` (``2SEND_F1`` -> ``2WAIT_SEND_F1``)."""
    return _Action(send.stage_index, SENDS[send.computation_type], send.microbatch_index)


def send_of(wait: _Action) -> _Action:
    """The send that ``wait`` waits for (``2WAIT_SEND_F1`` -> ``2SEND_F1``)."""
    return _Action(wait.stage_index, SEND_WAITS[wait.computation_type], wait.microbatch_index)


def from_torch(action: Any) -> _Action | None:
    """torch's ``_Action`` (any release) as tether's."""
    if action is None:
        return None
    subs = action.sub_actions
    return _Action(
        action.stage_index,
        _ComputationType(action.computation_type.value),
        action.microbatch_index,
        None if subs is None else tuple(a for s in subs if (a := from_torch(s)) is not None),
    )
