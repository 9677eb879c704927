"""The one module that names torch's private pipelining internals (2.13 and 2.14). Importing it
checks them: a torch whose internals moved is refused with :class:`tether.UnsupportedTorchError`
before any of them is used."""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

from tether._exceptions import UnsupportedTorchError
from tether._versions import PIPELINING_BACKPORT_TESTED, TORCH

__all__ = [
    "FSDPModule",
    "PipeliningMetadataError",
    "RecvInfo",
    "Schedule",
    "TorchPipelineStage",
    "add_send_recv",
    "batch_p2p",
    "defer_recv_ops",
    "extend_schedule",
    "make_tensor_from_meta",
    "schedules",
    "storage_use_count",
    "tensor_use_count",
    "wait_batch_p2p",
]

_VERSION = ".".join(map(str, TORCH))
if TORCH[:2] not in PIPELINING_BACKPORT_TESTED:
    raise UnsupportedTorchError(
        "tether.pipelining backports torch 2.15's pipeline controls to torch 2.13 and 2.14; "
        f"torch {_VERSION} is neither (torch 2.15+ has its own)"
    )

import torch  # noqa: E402
import torch.distributed.pipelining.schedules as schedules  # noqa: E402
import torch.distributed.pipelining.stage as stage  # noqa: E402
from torch.distributed.pipelining import _utils  # noqa: E402

_runtime: Any = getattr(schedules, "_PipelineScheduleRuntime", None)
_missing = [
    name
    for name, ok in (
        ("stage._RecvInfo", hasattr(stage, "_RecvInfo")),
        ("_utils._make_tensor_from_meta", hasattr(_utils, "_make_tensor_from_meta")),
        ("_utils.PipeliningMetadataError", hasattr(_utils, "PipeliningMetadataError")),
        ("schedules._PipelineScheduleRuntime", _runtime is not None),
        (
            "_PipelineScheduleRuntime._comp_type_to_function_map",
            _runtime is not None
            and "_comp_type_to_function_map" in inspect.getsource(_runtime.__init__),
        ),
        ("PipelineStage._get_recv_ops", hasattr(stage.PipelineStage, "_get_recv_ops")),
        ("schedules._batch_p2p", hasattr(schedules, "_batch_p2p")),
        ("schedules._wait_batch_p2p", hasattr(schedules, "_wait_batch_p2p")),
        ("schedules._add_send_recv", hasattr(schedules, "_add_send_recv")),
        ("schedules._defer_recv_ops", hasattr(schedules, "_defer_recv_ops")),
        ("torch._C._storage_Use_Count", hasattr(torch._C, "_storage_Use_Count")),
        ("Tensor._use_count", hasattr(torch.Tensor, "_use_count")),
    )
    if not ok
]
if _missing:
    raise UnsupportedTorchError(
        f"tether.pipelining does not know this torch {_VERSION}: {', '.join(_missing)} changed"
    )

RecvInfo: Any = stage._RecvInfo
PipeliningMetadataError: Any = _utils.PipeliningMetadataError
make_tensor_from_meta: Any = _utils._make_tensor_from_meta
batch_p2p: Any = schedules._batch_p2p
wait_batch_p2p: Any = schedules._wait_batch_p2p
add_send_recv: Any = schedules._add_send_recv  # torch's lowering pass: sends and receives
defer_recv_ops: Any = schedules._defer_recv_ops
TorchPipelineStage: Any = stage.PipelineStage
storage_use_count: Any = torch._C._storage_Use_Count  # references to a storage (inductor's use)
tensor_use_count: Any = getattr(torch.Tensor, "_use_count")  # noqa: B009  (untyped) tensor refs
FSDPModule: Any = getattr(stage, "FSDPModule")  # noqa: B009  (what torch's stage tests for)


if TYPE_CHECKING:

    class Schedule:
        """torch's schedules (``PipelineScheduleSingle``, ``_PipelineScheduleRuntime``) as
        tether's mixins use them: the members they read, set and call, torch's private ones
        among them, declared once. For the type checker only: at run time a mixin's base is
        ``object``, and these members are those of torch's class, which
        :func:`extend_schedule` puts behind the mixins."""

        __signature__: ClassVar[inspect.Signature]
        rank: int
        scale_grads: bool
        stage_index_to_group_rank: dict[int, int]
        pipeline_order_with_comms: dict[int, list[Any]]
        unshard_ops: dict[int, list[Any]]
        """Per stage index, the works of its FSDP modules' unshards under way."""
        unsharded_stages: set[int]
        _stage: Any
        """A single-stage schedule's stage."""
        _stages: list[Any]
        """A multi-stage schedule's stages on this rank."""
        _n_microbatches: int
        _num_stages: int
        _defer_pp_recv: bool
        _comp_type_to_function_map: dict[Any, Callable[[Any, Any], None]]
        """The runtime's function per action type (where ``register_custom_function`` puts
        user functions)."""

        def step(self, *args: Any, **kwargs: Any) -> Any: ...
        def _step_microbatches(self, *args: Any, **kwargs: Any) -> Any: ...
        def _split_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None) -> Any: ...
        def _check_inputs(
            self,
            arg_mbs: list[Any] | None,
            kwarg_mbs: list[Any] | None,
            target_mbs: list[Any] | None,
            losses: list[Any] | None = None,
        ) -> tuple[list[Any], list[Any]]: ...
        def _initialize_stage(self, *args: Any) -> None: ...
        def _maybe_compute_loss(self, *args: Any) -> None: ...
        def _maybe_get_loss(self, stage: Any, mb: int) -> Any: ...
        def _update_losses(self, stages: Any, losses: list[Any] | None) -> None: ...
        def _validate_and_set_stage_mapping(self, actions: dict[int, list[Any]]) -> None: ...
        def _load_csv(self, filename: str, format: str = "compute_only") -> None: ...

else:
    Schedule = object


def extend_schedule(torch_name: str, mixins: tuple[type, ...], module: str, what: str) -> Any:
    """torch's schedule ``torch_name`` with tether's ``mixins`` in front, named as torch names it
    (``isinstance`` with torch's class holds)."""
    return type(
        torch_name,
        (*mixins, getattr(schedules, torch_name)),
        {
            "__doc__": f"torch's ``{torch_name}`` with {what} (:mod:`{module}`).",
            "__module__": module,
            "__qualname__": torch_name,
        },
    )
