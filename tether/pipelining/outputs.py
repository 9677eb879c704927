"""Forward outputs released once their send has completed, as in torch 2.15.

A stage keeps each microbatch's outputs until that microbatch's backward, only to hand them to
``torch.autograd.backward``. Once the send that carries them has been waited, the stage can keep
their autograd edges instead (``torch.autograd.graph.GradientEdge``: the node that produced each
output and which of its outputs it was), and drop the tensors: backward starts from the edges. The
memory comes back when nothing else holds the tensor (autograd keeps what it saved).

Fails closed, as 2.15 does, where the tensors themselves are needed later: the last stage (its
outputs go to the loss and the user), outputs that are not plain ``torch.Tensor`` (DTensor and
other subclasses), ``DistributedDataParallel`` submodules (its reducer finds the output tensors),
a custom ``dw_builder``; and, in tether, a backward split into input and weight parts
(``stage_backward_input`` walks the output tensors' ``grad_fn``).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge
from torch.nn.parallel import DistributedDataParallel

__all__ = ["ReleasedOutputs", "releasable"]


class ReleasedOutputs:
    """A microbatch's outputs as autograd edges; stands in for them in the stage's forward
    cache."""

    __slots__ = ("edges",)

    def __init__(self, outputs: tuple[torch.Tensor, ...]) -> None:
        self.edges: tuple[GradientEdge | None, ...] = tuple(
            get_gradient_edge(t) if t.requires_grad else None for t in outputs
        )

    def backward(
        self, output_grads: tuple[torch.Tensor | None, ...], input_values: list[Any]
    ) -> tuple[torch.Tensor | None, ...]:
        """torch's ``stage_backward`` from the edges: accumulate parameter gradients and return
        the gradients of the stage's inputs (taken off the inputs, as torch does)."""
        pairs = [
            (edge, grad)
            for edge, grad in zip(self.edges, output_grads, strict=True)
            if edge is not None and grad is not None
        ]
        if pairs:
            torch.autograd.backward(
                [edge for edge, _ in pairs], grad_tensors=[grad for _, grad in pairs]
            )
        grads: list[torch.Tensor | None] = []
        for value in input_values:
            if isinstance(value, torch.Tensor):
                grads.append(value.grad)
                value.grad = None
            else:
                grads.append(None)
        return tuple(grads)


def releasable(stage: Any, outputs: Any) -> bool:
    """Whether this stage may drop these outputs before their backward (module text)."""
    return (
        not stage.is_last
        and stage.has_backward
        and stage.dw_builder is None
        and not isinstance(stage.submod, DistributedDataParallel)
        and isinstance(outputs, tuple)
        and all(type(t) is torch.Tensor for t in outputs)
    )
