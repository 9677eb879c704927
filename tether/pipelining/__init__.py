"""torch 2.15's pipeline memory and communication controls, on torch 2.13 and 2.14.

``from tether.pipelining import PipelineStage, ScheduleInterleaved1F1B, ...`` gives torch's own
classes on torch 2.15 and later, and tether's on 2.13 and 2.14 with 2.15's names and signatures:

- receive buffers allocated just before each receive, not one per microbatch for the stage's
  life (``PipelineStage``; every schedule);
- explicit ``WAIT_SEND_F``/``WAIT_SEND_B`` actions: a send's work (and the tensor it holds) is
  released at its wait, not at the step's end; ``max_outstanding_sends=K`` bounds them;
- ``max_active_stages`` and ``unshard_lookahead`` (``"full"``, ``"auto"``, a tuple) for
  pipeline-by-FSDP; ``defer_reduce_grad_wait`` and the ``WAIT_REDUCE_GRAD`` action;
- forward outputs dropped (their autograd edges kept) once their send has been waited;
- FSDP stages reduced through manual finalization, overlapped with later compute on request;
  ``step(finalize_gradients=False)`` accumulates across steps;
- ``config.pipeline_per_edge_p2p`` (``TORCH_DISTRIBUTED_PIPELINE_PER_EDGE_P2P``): one P2P group per
  directed edge of the schedule;
- schedule CSVs with the new actions load and dump as in 2.15.

:func:`memory_stats` (tether's) reads what a rank held in its last step. docs/pipelining.md has
the torch-version matrix and what is not backported. On a torch before 2.15 other than 2.13 or
2.14, importing this raises :class:`tether.UnsupportedTorchError`.
"""

from __future__ import annotations

from tether._versions import TORCH_PIPELINE_CONTROLS

if TORCH_PIPELINE_CONTROLS:
    # 2.15: torch.distributed.config.pipeline_per_edge_p2p
    from torch.distributed import config
    from torch.distributed.pipelining import (
        PipelineStage,
        Schedule1F1B,
        ScheduleDualPipeV,
        ScheduleGPipe,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )
else:
    from tether.pipelining.p2p import config  # type: ignore[no-redef]
    from tether.pipelining.schedules import (
        ScheduleDualPipeV,
        ScheduleInterleaved1F1B,
        ScheduleInterleavedZeroBubble,
        ScheduleLoopedBFS,
        ScheduleZBVZeroBubble,
    )
    from tether.pipelining.single import Schedule1F1B, ScheduleGPipe
    from tether.pipelining.stage import PipelineStage

from tether.pipelining.stats import PipelineMemory, memory_stats

__all__ = [
    "PipelineMemory",
    "PipelineStage",
    "Schedule1F1B",
    "ScheduleDualPipeV",
    "ScheduleGPipe",
    "ScheduleInterleaved1F1B",
    "ScheduleInterleavedZeroBubble",
    "ScheduleLoopedBFS",
    "ScheduleZBVZeroBubble",
    "config",
    "memory_stats",
]
