"""torch 2.15's ``step()`` on every tether schedule: ``finalize_gradients`` and, on torch 2.13,
pre-split microbatches (``arg_mbs``, ``kwarg_mbs``, ``target_mbs``; torch 2.14 has them).

``step(..., finalize_gradients=False)`` leaves FSDP stages unsharded with their gradients
accumulated, unreduced and unscaled, until a later ``step(finalize_gradients=True)``, which
reduces and divides by the number of microbatches once. Stages without FSDP are unaffected.
"""

from __future__ import annotations

from typing import Any

from tether._versions import TORCH
from tether.pipelining._torch import Schedule

__all__ = ["Step"]

_TORCH_SPLITS = TORCH[:2] >= (2, 14)  # torch 2.14's step() takes pre-split microbatches


class Step(Schedule):
    """2.15's ``step()`` keywords over one of torch's schedules (module text)."""

    _tether_presplit: tuple[list[Any], list[Any], list[Any] | None] | None = None
    _tether_deferring = False
    """This step runs with ``finalize_gradients=False``: FSDP stages stay unsharded."""
    _tether_carried = False
    """The step before this one did: FSDP stages start this one unsharded."""

    def _tether_local_stages(self) -> list[Any]:
        return list(getattr(self, "_stages", None) or [self._stage])

    def step(
        self,
        *args: Any,
        target: Any = None,
        losses: list[Any] | None = None,
        return_outputs: bool = True,
        loss_kwargs: dict[str, Any] | None = None,
        arg_mbs: Any = None,
        kwarg_mbs: Any = None,
        target_mbs: Any = None,
        finalize_gradients: bool = True,
        **kwargs: Any,
    ) -> Any:
        """torch's ``step``; ``finalize_gradients=False`` defers FSDP stages' reduction to a
        later step (module text)."""
        for stage in self._tether_local_stages():
            if hasattr(stage, "_tether_finalize"):
                stage._tether_finalize = finalize_gradients
        self._tether_carried = self._tether_deferring
        self._tether_deferring = not finalize_gradients
        common: dict[str, Any] = dict(
            losses=losses, return_outputs=return_outputs, loss_kwargs=loss_kwargs
        )
        presplit = any(m is not None for m in (arg_mbs, kwarg_mbs, target_mbs))
        if _TORCH_SPLITS or not presplit:
            if presplit:
                common.update(arg_mbs=arg_mbs, kwarg_mbs=kwarg_mbs, target_mbs=target_mbs)
            return super().step(*args, target=target, **common, **kwargs)
        self._tether_presplit = self._check_presplit(
            args, kwargs, target, arg_mbs, kwarg_mbs, target_mbs
        )
        try:
            return super().step(**common)
        finally:
            self._tether_presplit = None

    def _check_presplit(
        self,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        target: Any,
        arg_mbs: Any,
        kwarg_mbs: Any,
        target_mbs: Any,
    ) -> tuple[list[Any], list[Any], list[Any] | None]:
        """torch 2.14's checks and texts for pre-split inputs."""
        if args:
            raise ValueError(
                "When using pre-split inputs, pass pre-split positional inputs "
                "through arg_mbs=... instead of positional args."
            )
        if kwargs:
            raise ValueError(
                f"Unexpected keyword arguments with pre-split inputs: {', '.join(sorted(kwargs))}. "
                "Pass pre-split keyword inputs through kwarg_mbs=..."
            )
        if target is not None:
            raise ValueError(
                "When using pre-split inputs, pass pre-split targets through "
                "target_mbs=... instead of target=..."
            )
        arg_mbs, kwarg_mbs = self._check_inputs(arg_mbs, kwarg_mbs, target_mbs)
        for i, (arg_mb, kwarg_mb) in enumerate(zip(arg_mbs, kwarg_mbs, strict=True)):
            if not isinstance(arg_mb, tuple):
                raise TypeError(
                    f"arg_mbs must be a list of tuples, but arg_mbs[{i}] is a {type(arg_mb)}"
                )
            if not isinstance(kwarg_mb, dict):
                raise TypeError(
                    f"kwarg_mbs must be a list of dicts, but kwarg_mbs[{i}] is a {type(kwarg_mb)}"
                )
        return arg_mbs, kwarg_mbs, target_mbs

    # torch 2.13's step() splits whole-batch inputs; pre-split ones go around it.
    def _split_inputs(self, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> Any:
        if self._tether_presplit is not None:
            return self._tether_presplit[0], self._tether_presplit[1]
        return super()._split_inputs(args, kwargs)

    def _step_microbatches(
        self,
        arg_mbs: list[Any] | None = None,
        kwarg_mbs: list[Any] | None = None,
        target_mbs: list[Any] | None = None,
        *rest: Any,
        **kwargs: Any,
    ) -> Any:
        if self._tether_presplit is not None:
            target_mbs = self._tether_presplit[2]
        return super()._step_microbatches(arg_mbs, kwarg_mbs, target_mbs, *rest, **kwargs)
