"""Dynamic loss scaling for fp16 (Micikevicius et al., "Mixed Precision Training", ICLR 2018; the policy of
torch.amp.GradScaler): the loss is multiplied by `scale` before backward, so fp16 gradients that would
underflow to zero (a mean over a whole global batch of tokens puts most logit gradients below fp16's
6e-8) stay representable; the optimizer divides it out in fp32. A step whose reduced gradients hold an
inf or NaN anywhere (any rank: shards, pipeline stages and tensor-parallel slices all vote) is skipped,
parameters and Adam state untouched, and the scale halves; after `growth_interval` clean steps it doubles.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

# torch.amp.GradScaler's defaults.
INIT_SCALE = 2.0**16
GROWTH_FACTOR = 2.0
BACKOFF_FACTOR = 0.5
GROWTH_INTERVAL = 2000


class DynamicLossScale:
    """The scale and its update rule; `found_inf` is the one collective (over the whole world, so every
    rank skips the same steps)."""

    def __init__(self, *, init_scale: float = INIT_SCALE, growth_factor: float = GROWTH_FACTOR,
                 backoff_factor: float = BACKOFF_FACTOR, growth_interval: int = GROWTH_INTERVAL) -> None:
        if not (init_scale > 0 and growth_factor > 1 and 0 < backoff_factor < 1 and growth_interval >= 1):
            raise ValueError(f"bad loss-scale settings: init {init_scale}, growth {growth_factor}, "
                             f"backoff {backoff_factor}, interval {growth_interval}")
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor, self.growth_interval = growth_factor, backoff_factor, growth_interval
        self.clean_steps = 0
        self.num_skipped = 0

    def found_inf(self, grads: list[torch.Tensor], *, device: torch.device, group=None) -> bool:
        """Whether any rank's gradients in `grads` hold a non-finite value (a MAX all-reduce of one flag on
        `device`, the run's device: an NCCL group has no CPU backend)."""
        flag = torch.zeros(1, dtype=torch.float32, device=device)
        for g in grads:
            if g.numel():
                flag = torch.maximum(flag, (~torch.isfinite(g)).any().to(flag.dtype).reshape(1))
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item() > 0)

    def update(self, *, found_inf: bool) -> None:
        """Back off after an overflow (the step was skipped); grow after growth_interval clean steps."""
        if found_inf:
            self.scale *= self.backoff_factor
            self.clean_steps = 0
            self.num_skipped += 1
            return
        self.clean_steps += 1
        if self.clean_steps == self.growth_interval:
            grown = self.scale * self.growth_factor
            self.scale = grown if math.isfinite(grown) else self.scale
            self.clean_steps = 0
