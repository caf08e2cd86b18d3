"""Test hooks: bugs a test can inject into the engine to show that the exactness checks catch them.

    with mutations.injected(Mutation("scale_grad", params="lm_head.", factor=2.0)):
        trainer = Trainer(cfg, device=device)      # the bug is installed while the trainer is built

Nothing here runs unless a test sets a mutation: `runners.train.Trainer` reads `active()` once, at
construction, and installs the bug's hook only then; with none set (always, outside tests) the engine's
path has no extra hook, branch or collective. tests/distributed/test_gradients.py uses them to show that
its per-parameter gradient check fails on each bug while the loss / parameter comparison does not.

Kinds:
- "scale_grad": every gradient of the parameters whose one-process name starts with `params` is
  multiplied by `factor` before it accumulates (a wrong loss scale on one group of weights: lm_head,
  the embedding, one layer);
- "sp_double_reduce": under sequence parallelism the TP-replicated parameters (norm weights, biases,
  positions) take their gradient's TP all-reduce twice (the classic double-reduction bug: x tp);
- "skip_reduction": the DP gradient reduction (reduce-scatter and boundary all-reduce) of the bucket
  holding unit `unit` of the rank's first chunk is not issued, each rank keeping its local share; with
  `micro_batch`, only that micro-batch's reduce-scatter (s_g > 1) is skipped.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

KINDS = ("scale_grad", "sp_double_reduce", "skip_reduction")


@dataclass(frozen=True)
class Mutation:
    kind: str
    params: str = ""      # scale_grad: prefix of the one-process parameter names hit
    factor: float = 2.0   # scale_grad: the gradient multiplier
    unit: int = 0         # skip_reduction: the unit (position in the first local chunk) whose bucket is skipped
    micro_batch: int | None = None  # skip_reduction: only this micro-batch's reduce-scatter (None: every one)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"mutation kind must be one of {', '.join(KINDS)}, got {self.kind!r}")


_active: Mutation | None = None


def active() -> Mutation | None:
    """The mutation a test injected, or None (always, outside tests)."""
    return _active


@contextlib.contextmanager
def injected(mutation: Mutation | None):
    """Inject `mutation` into every trainer built inside the block."""
    global _active
    previous, _active = _active, mutation
    try:
        yield
    finally:
        _active = previous


def scale_gradients(chunks, mutation: Mutation) -> int:
    """Install a "scale_grad" mutation on the chunks' parameters (a tensor hook: it scales each
    micro-batch's gradient before it accumulates); returns how many parameters of this rank it hit (none
    where another pipeline stage holds them)."""
    hit = 0
    for chunk in chunks:
        for p in chunk.parameters():
            if p.canonical_name.startswith(mutation.params):
                p.register_hook(lambda grad, factor=mutation.factor: grad * factor)
                hit += 1
    return hit
