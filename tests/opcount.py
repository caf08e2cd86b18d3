"""The aten ops a piece of the engine dispatches, views aside: what the cost model's op counts
(cost_models/estimate.num_ops, context_parallel_ops, cost_models/moe.moe_extra_ops) are checked against."""

from __future__ import annotations

import contextlib

import torch
from torch.utils._python_dispatch import TorchDispatchMode

VIEWS = {"view", "permute", "_unsafe_view", "t", "transpose", "expand", "unsqueeze", "squeeze", "slice", "select",
         "alias", "detach", "split", "unbind", "as_strided", "reshape", "flatten", "view_as", "split_with_sizes"}
_paused: list[int] = []


class OpCount(TorchDispatchMode):
    """Counts every non-view op dispatched inside it, except inside `uncounted()`."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not _paused and func.overloadpacket.__name__ not in VIEWS:
            self.ops += 1
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def uncounted():
    """Ops inside are not counted (communication stand-ins, steps priced from their measured times)."""
    _paused.append(1)
    try:
        yield
    finally:
        _paused.pop()


def forward_backward_ops(module, x: torch.Tensor) -> tuple[int, int]:
    """(forward, backward) ops of `module` on `x`, the backward from a random output gradient."""
    with OpCount() as forward:
        y = module(x)
    grad = torch.randn_like(y)
    with OpCount() as backward:
        y.backward(grad)
    return forward.ops, backward.ops
