"""What a pipeline rank held in its last step: receive buffers, sends not yet waited, and
forward outputs kept for backward."""

from __future__ import annotations

import dataclasses
from typing import Any

__all__ = ["PipelineMemory", "Tally", "memory_stats"]


@dataclasses.dataclass
class Tally:
    """Things held now (receive buffers, or sends not yet waited) and their bytes, and the most
    at once since :meth:`reset` (a step's start)."""

    now: int = 0
    now_bytes: int = 0
    peak: int = 0
    peak_bytes: int = 0

    def add(self, nbytes: int) -> None:
        self.now += 1
        self.now_bytes += nbytes
        self.peak = max(self.peak, self.now)
        self.peak_bytes = max(self.peak_bytes, self.now_bytes)

    def remove(self, nbytes: int) -> None:
        self.now -= 1
        self.now_bytes -= nbytes

    def reset(self) -> None:
        self.peak, self.peak_bytes = self.now, self.now_bytes


@dataclasses.dataclass(frozen=True, slots=True)
class PipelineMemory:
    recv_buffers_peak: int
    """The most receive buffers this rank held at once (allocated, not yet consumed)."""
    recv_bytes_peak: int
    pending_sends_peak: int | None
    """The most sends issued and not yet waited at once; None where tether does not run the
    sends (torch's single-stage schedules, or torch 2.15's own classes)."""
    pending_send_bytes_peak: int | None
    fwd_outputs_peak: int
    """The most microbatches whose forward outputs this rank's stages held at once for backward
    (computed, not yet released after their send nor consumed by backward; not the last stage)."""
    fwd_output_bytes_peak: int


def memory_stats(schedule_or_stage: Any) -> PipelineMemory | None:
    """The last step's peaks for a tether schedule, or a tether stage run by any schedule; None
    for torch's own classes (which count nothing)."""
    owner = schedule_or_stage
    if not hasattr(owner, "_tether_recv"):
        stages = getattr(owner, "_stages", None) or [getattr(owner, "_stage", None)]
        owner = next((s for s in stages if hasattr(s, "_tether_recv")), None)
    if owner is None:
        return None
    recv, outputs = owner._tether_recv, owner._tether_outputs
    send = getattr(schedule_or_stage, "_tether_send", None)
    return PipelineMemory(
        recv_buffers_peak=recv.peak,
        recv_bytes_peak=recv.peak_bytes,
        pending_sends_peak=None if send is None else send.peak,
        pending_send_bytes_peak=None if send is None else send.peak_bytes,
        fwd_outputs_peak=outputs.peak,
        fwd_output_bytes_peak=outputs.peak_bytes,
    )
