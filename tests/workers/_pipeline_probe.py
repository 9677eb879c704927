"""What a pipeline rank holds during a step, measured the same way whichever implementation runs
it: torch 2.13/2.14's own schedules, tether's backport, or torch 2.15's (which ``tether.pipelining``
hands out there, and which count nothing themselves).

- receive buffers held: descriptors (``args_recv_info``, ``grad_recv_info``) holding a buffer for a
  peer on another rank, read each time a stage posts receives (the only moment the count grows);
- sends pending: ``torch.distributed.isend`` calls whose work has not been waited;
- forward outputs held: microbatches whose outputs a non-last stage still references for
  backward, read after each forward. Each implementation keeps them in its own record, read here:
  2.15's ``_forward_chunk_states`` (a released output is None there), else ``fwd_cache`` (tether
  puts a non-tuple in place of released outputs).

Install with :func:`watch` before the schedule's first step; :meth:`Probe.reset` at each step's
start; the ``*_peak`` attributes after it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d


class _Sent:
    """An ``isend``'s work, counted pending until its first ``wait``."""

    def __init__(self, work: Any, probe: Probe) -> None:
        self._work, self._probe, self._waited = work, probe, False

    def wait(self, *args: Any, **kwargs: Any) -> Any:
        if not self._waited:
            self._waited = True
            self._probe.sends_pending -= 1
        return self._work.wait(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._work, name)


class Probe:
    def __init__(self, stages: list[Any]) -> None:
        self.stages = stages
        self.local = {s.stage_index for s in stages}
        self.sends_pending = 0
        self.recv_peak = self.sends_peak = self.outputs_peak = 0

    def reset(self) -> None:
        self.recv_peak = self.held_buffers()
        self.sends_peak = self.sends_pending
        self.outputs_peak = self.held_outputs()

    def held_buffers(self) -> int:
        return sum(
            1
            for s in self.stages
            for infos in (*s.args_recv_info.values(), *getattr(s, "grad_recv_info", {}).values())
            for info in infos
            if not info.is_root_arg
            and info.buffer is not None
            and info.source not in self.local  # a same-rank stage's hand-off: no receive
        )

    def held_outputs(self) -> int:
        held = 0
        for s in self.stages:
            if s.is_last or not s.has_backward:
                continue
            states = getattr(s, "_forward_chunk_states", None)
            if states is not None:  # torch 2.15
                held += sum(any(o is not None for o in st.live_outputs) for st in states.values())
            else:
                held += sum(isinstance(entry[0], tuple) for entry in s.fwd_cache.values())
        return held

    def _after(self, method: Callable[..., Any], measure: Callable[[], None]) -> Callable[..., Any]:
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            result = method(*args, **kwargs)
            measure()
            return result

        return wrapped

    def _recv_posted(self) -> None:
        self.recv_peak = max(self.recv_peak, self.held_buffers())

    def _forwarded(self) -> None:
        self.outputs_peak = max(self.outputs_peak, self.held_outputs())

    def _isend(self, original: Callable[..., Any]) -> Callable[..., Any]:
        def isend(*args: Any, **kwargs: Any) -> Any:
            work = original(*args, **kwargs)
            if work is None:  # not a member of the group
                return work
            self.sends_pending += 1
            self.sends_peak = max(self.sends_peak, self.sends_pending)
            return _Sent(work, self)

        return isend


_originals: dict[str, Any] = {}


def watch(stages: list[Any]) -> Probe:
    """A probe over this rank's ``stages`` (every schedule of the process shares the ``isend``
    count: one schedule runs at a time)."""
    probe = Probe(stages)
    for stage in stages:
        # Instance attributes: the schedule (torch's or tether's) calls these by name.
        stage.get_fwd_recv_ops = probe._after(stage.get_fwd_recv_ops, probe._recv_posted)
        stage.get_bwd_recv_ops = probe._after(stage.get_bwd_recv_ops, probe._recv_posted)
        stage.forward_one_chunk = probe._after(stage.forward_one_chunk, probe._forwarded)
    original = _originals.setdefault("isend", c10d.isend)
    # torch checks a P2POp's op against the module's own isend, so both names change together.
    dist.isend = c10d.isend = probe._isend(original)
    return probe
