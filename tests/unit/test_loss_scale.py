"""fp16 needs loss scaling (issue 11, bug 3), shown on the tiny model in fp16 on CPU, and the dynamic loss
scale's rule (torch.amp.GradScaler's): skip and halve on an overflow, double after a run of clean steps."""

from __future__ import annotations

import math

import pytest
import torch

from runners.sharding.loss_scale import DynamicLossScale
from runners.tensor_parallel import TPContext
from runners.transformer import LMHead, build_chunk
from specs.model import PRESETS

# A real job's tokens per step (global batch 512 x 2048): the loss is their mean, so each token's logit
# gradient is about 1 / (vocabulary x tokens), far below fp16's smallest subnormal (6e-8).
TOKENS_PER_STEP = 512 * 2048


def head_gradient(dtype: torch.dtype, *, scale: float) -> torch.Tensor:
    """The LM head's weight gradient of one micro-batch of the tiny model in `dtype`, unscaled in fp32."""
    chunk = build_chunk(PRESETS["tiny"], layers=range(2), first=True, last=True, seed=0, tp=TPContext.single(),
                        recompute="none", loss_scale=scale / TOKENS_PER_STEP).to(dtype)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, PRESETS["tiny"].vocab_size, (2, 33), generator=gen)
    chunk(tokens[:, :-1], tokens[:, 1:]).backward()
    head = next(u for u in chunk.units if isinstance(u, LMHead))
    return head.weight.grad.float() / scale


def test_fp16_gradients_underflow_without_a_loss_scale_and_survive_with_one():
    reference = head_gradient(torch.float32, scale=1.0)
    assert (reference == 0).float().mean() < 0.01
    unscaled = head_gradient(torch.float16, scale=1.0)
    # Every vocabulary row that no token of the micro-batch targets gets only softmax gradients, all
    # flushed to zero (64 targets: over 3/4 of the 256 rows are lost).
    assert (unscaled == 0).float().mean() > 0.7
    scaled = head_gradient(torch.float16, scale=2.0**16)
    assert (scaled == 0).float().mean() < 0.01
    assert ((scaled - reference).norm() / reference.norm()).item() < 1e-2


def test_an_overflow_halves_the_scale_and_clean_steps_double_it():
    scale = DynamicLossScale(init_scale=1024.0, growth_interval=3)
    scale.update(found_inf=True)
    assert scale.scale == 512.0 and scale.num_skipped == 1
    for _ in range(2):
        scale.update(found_inf=False)
    assert scale.scale == 512.0
    scale.update(found_inf=False)
    assert scale.scale == 1024.0 and scale.clean_steps == 0
    scale.update(found_inf=False)
    scale.update(found_inf=True)  # an overflow restarts the count of clean steps
    scale.update(found_inf=False)
    scale.update(found_inf=False)
    assert scale.scale == 512.0


def test_found_inf_sees_any_non_finite_gradient():
    scale = DynamicLossScale()
    finite = [torch.ones(4, dtype=torch.float16), torch.empty(0)]
    assert not scale.found_inf(finite, device=torch.device("cpu"))
    for bad in (math.inf, -math.inf, math.nan):
        grads = finite + [torch.tensor([1.0, bad], dtype=torch.float16)]
        assert scale.found_inf(grads, device=torch.device("cpu"))


@pytest.mark.parametrize("kwargs", [{"init_scale": 0}, {"growth_factor": 1.0}, {"backoff_factor": 1.0},
                                    {"growth_interval": 0}])
def test_bad_settings_are_refused(kwargs):
    with pytest.raises(ValueError):
        DynamicLossScale(**kwargs)


def test_two_engines_sharing_a_scale_skip_together_and_update_it_once():
    # An MoE model's dense and expert engines: an overflow in either skips both, and the scale halves once
    # for the step (each engine deciding alone halved it twice and could update one and skip the other).
    from types import SimpleNamespace

    from runners.sharding.engine import decide_overflow

    def engine(*grads):
        return SimpleNamespace(units=[SimpleNamespace(grad=g) for g in grads], device=torch.device("cpu"))

    scale = DynamicLossScale(init_scale=1024.0)
    dense, experts = engine(torch.ones(4)), engine(torch.tensor([1.0, math.inf]))
    assert decide_overflow([dense, experts], scale) == (True, 1 / 1024.0)
    assert scale.scale == 512.0 and scale.num_skipped == 1
    assert decide_overflow([dense, engine(torch.ones(3))], scale) == (False, 1 / 512.0)
    assert scale.scale == 512.0 and scale.clean_steps == 1
    assert decide_overflow([dense], None) == (False, 1.0)
