"""Compute model: exact FLOP counts against hand counts and the Megatron formula; GEMM timing rules."""

import dataclasses
from fractions import Fraction

import pytest

from cost_models.compute import (Gemm, attention_core_flops, gemm_efficiency, gemm_time_s, layer_compute_times,
                                 layer_forward_flops, layer_gemms, memory_time_s, model_flops_per_step)
from specs.model import PRESETS
from specs.hardware import PRESETS as HW
from specs.hardware import GemmPoint


def test_tiny_llama_layer_flops_by_hand():
    # tiny: h=64, 8 heads of 8, 4 KV heads (kv width 32), SwiGLU f=176; b=1, s=4 -> T=4 tokens.
    tiny = PRESETS["tiny"]
    qkv = 2 * 4 * 64 * (64 + 2 * 32)
    out = 2 * 4 * 64 * 64
    mlp = 3 * 2 * 4 * 64 * 176
    scores = context = 2 * 1 * 4 * 4 * 64
    assert layer_forward_flops(tiny, micro_batch=1, seq_len=4) == qkv + out + mlp + scores + context == 372736
    assert attention_core_flops(tiny, micro_batch=1, seq_len=4) == scores + context


@pytest.mark.parametrize("name", ["gpt3-1.7b", "gpt3-175b", "gpt3-1t"])
def test_full_recompute_step_flops_are_the_megatron_formula(name):
    model = PRESETS[name]
    b, s, l, h, v = 512, 2048, model.num_layers, model.hidden_size, model.vocab_size
    formula = 96 * b * s * l * h * h * (1 + Fraction(s, 6 * h) + Fraction(v, 16 * l * h))
    counted = model_flops_per_step(model, global_batch=b, seq_len=s, recompute_layers=("full",) * l)
    assert counted == formula
    # Without recomputation: three forwards (forward + 2x backward) instead of four for the layers.
    plain = model_flops_per_step(model, global_batch=b, seq_len=s)
    assert counted - plain == l * layer_forward_flops(model, micro_batch=b, seq_len=s)


def test_tensor_parallel_splits_every_gemm():
    model = PRESETS["llama3-8b"]
    whole = sum(g.flops for group in layer_gemms(model, micro_batch=2, seq_len=512).values() for g in group)
    split = sum(g.flops for group in layer_gemms(model, micro_batch=2, seq_len=512, tp=4).values() for g in group)
    assert whole == 4 * split


def test_gemm_time_follows_the_efficiency_curve_and_the_overhead_floor():
    # A host without an SM count (CPU profiles): the smooth per-dimension curve.
    hw = dataclasses.replace(HW["a100"], num_sms=0)
    g = Gemm(1024, 2048, 4096)
    eff = hw.gemm_max_efficiency * (1024 / (1024 + hw.gemm_half_dim)) * (2048 / (2048 + hw.gemm_half_dim)) \
        * (4096 / (4096 + hw.gemm_half_dim))
    assert gemm_time_s(hw, g, dtype="bf16") == pytest.approx(g.flops / (312e12 * eff), rel=1e-12)
    assert gemm_time_s(hw, Gemm(8, 8, 8), dtype="bf16") == hw.kernel_overhead_s
    # Larger shapes run closer to peak.
    assert gemm_efficiency(hw, m=8192, n=8192, k=8192, dtype="bf16") > gemm_efficiency(hw, m=512, n=512, k=512,
                                                                                           dtype="bf16")


def test_gpu_gemms_lose_their_part_empty_last_wave():
    hw = HW["a100"]  # 108 SMs, 256 x 128 output tiles
    k = 8192
    full = gemm_efficiency(hw, m=256 * 12, n=128 * 9, k=k, dtype="bf16")  # 108 tiles: one full wave
    assert full == pytest.approx(hw.gemm_max_efficiency * k / (k + hw.gemm_half_dim))
    # Twelve more rows of tiles need a second wave the big tile would leave mostly empty; a smaller tile
    # or split-K fills it better, but not for free.
    ragged = gemm_efficiency(hw, m=256 * 13, n=128 * 9, k=k, dtype="bf16")
    assert 0.5 * full < ragged < full
    # Big training GEMMs run within a few percent of the sustained rate; a TP-8 slice of a small model
    # loses much more.
    assert gemm_efficiency(hw, m=16384, n=8192, k=8192, dtype="bf16") > 0.97 * hw.gemm_max_efficiency
    assert gemm_efficiency(hw, m=2048, n=2048 // 8, k=2048, dtype="bf16") < 0.8 * hw.gemm_max_efficiency


def test_measured_gemm_points_are_exact_where_measured_and_scaled_between():
    hw = dataclasses.replace(HW["a100"], gemm_points=(GemmPoint(4096, 4096, 4096, "bf16", 200e12),
                                                       GemmPoint(512, 512, 512, "bf16", 50e12)))
    assert gemm_efficiency(hw, m=4096, n=4096, k=4096, dtype="bf16") == pytest.approx(200 / 312)
    assert gemm_efficiency(hw, m=512, n=512, k=512, dtype="bf16") == pytest.approx(50 / 312)
    between = gemm_efficiency(hw, m=3000, n=4096, k=4096, dtype="bf16")
    assert 50 / 312 < between < 200 / 312
    # Other dtypes keep the analytic curve.
    assert gemm_efficiency(hw, m=4096, n=4096, k=4096, dtype="fp32") == gemm_efficiency(
        HW["a100"], m=4096, n=4096, k=4096, dtype="fp32")


def test_a_weight_gradient_added_into_fp32_main_grads_waits_for_its_bytes():
    """An expert's weight gradient over 512 rows (K) into a 4096 x 1536 fp32 main gradient: 6.4 GFLOP, but
    the buffer read and written (8 bytes x 6.29M) and the operands read once ((4096 + 1536) x 512 x 2)
    are 56.1 MB, 20.9 us at the H100's 3.35 TB/s x 0.8, against 11.2 us of tensor-core time: the GEMM
    waits for HBM.
    Over 16384 rows the same output is compute bound and the flag changes nothing."""
    h100 = HW["h100"]
    short = Gemm(4096, 1536, 512)
    num_bytes = 4096 * 1536 * 8 + (4096 * 512 + 512 * 1536) * 2
    assert gemm_time_s(h100, short, dtype="bf16", accumulate_fp32=True) == pytest.approx(num_bytes / (3.35e12 * 0.8))
    assert gemm_time_s(h100, short, dtype="bf16", accumulate_fp32=True) > 1.8 * gemm_time_s(h100, short, dtype="bf16")
    long = Gemm(4096, 1536, 16384)
    assert gemm_time_s(h100, long, dtype="bf16", accumulate_fp32=True) == gemm_time_s(h100, long, dtype="bf16")


def test_qwen3_query_and_key_norms_move_their_widths():
    """Qwen3's qk norm (Megatron's --qk-layernorm) reads and writes every query and key head once more:
    4096 tokens x (32 x 128 + 4 x 128) wide, 2 + 2 bytes, at the H100's 3.35 TB/s x 0.8 forward, twice
    that backward."""
    from cost_models.engines import ENGINES
    from cost_models.moe import dense_view

    qwen = dense_view(PRESETS["qwen3-30b-a3b"])
    assert qwen.qk_norm
    kw = dict(micro_batch=1, seq_len=4096, tp=1, sequence_parallel=False, precision="bf16", engine=ENGINES["megatron"])
    normed = layer_compute_times(qwen, HW["h100"], **kw)
    plain = layer_compute_times(dataclasses.replace(qwen, qk_norm=False), HW["h100"], **kw)
    extra_s = 2 * 2 * 4096 * (32 * 128 + 4 * 128) / (3.35e12 * 0.8)
    assert normed.forward_s - plain.forward_s == pytest.approx(extra_s)
    assert normed.backward_s - plain.backward_s == pytest.approx(2 * extra_s)


def test_fused_rope_runs_over_the_query_width_not_the_hidden_size():
    """Qwen3-30B-A3B's 32 query heads of 128 are 4096 wide on a hidden size of 2048: Megatron's fused RoPE
    reads and writes q (4096) and k (512), 2 x 2 bytes each, beside the two norms (2 x 2 x 2 h), the two
    residual adds (2 x 3 x 2 h) and the fused SwiGLU (3 x 2 f) of every token."""
    from cost_models.compute import _elementwise_bytes
    from cost_models.engines import ENGINES
    from cost_models.moe import dense_view

    qwen = dataclasses.replace(dense_view(PRESETS["qwen3-30b-a3b"]), qk_norm=False)
    h, f = qwen.hidden_size, qwen.ffn_hidden_size
    hidden, _ = _elementwise_bytes(qwen, micro_batch=1, seq_len=4096, tp=1, sequence_parallel=False,
                                   precision="bf16", engine=ENGINES["megatron"], materialized=False)
    assert hidden == 4096 * (2 * 4 * h + 2 * 6 * h + 6 * f + 4 * (32 * 128 + 4 * 128))


def test_memory_bound_ops_use_bandwidth():
    hw = HW["h100"]
    assert memory_time_s(hw, 3.35e12 * 0.8) == pytest.approx(1.0)
    assert memory_time_s(hw, 1) == hw.kernel_overhead_s


def test_backward_costs_about_twice_forward_and_sequence_parallel_saves_elementwise_time():
    model, hw = PRESETS["gpt3-18b"], HW["a100"]
    base = dict(micro_batch=1, seq_len=2048, tp=8, precision="bf16")
    plain = layer_compute_times(model, hw, sequence_parallel=False, **base)
    sp = layer_compute_times(model, hw, sequence_parallel=True, **base)
    assert 1.9 < plain.backward_s / plain.forward_s < 2.2
    assert sp.forward_s < plain.forward_s
    assert 0 < plain.attention_core_forward_s < plain.forward_s


def _attention_points(forward_ns_per_score: dict[tuple[int, int], float]) -> tuple:
    from specs.hardware import AttentionPoint

    return tuple(AttentionPoint(seq_len=s, num_heads=2, head_dim=d, dtype="fp32",
                                forward_s=ns * 1e-9 * 2 * s * s / 2, backward_s=3 * ns * 1e-9 * 2 * s * s / 2)
                 for (s, d), ns in forward_ns_per_score.items())


def test_measured_attention_is_exact_at_its_points_and_interpolated_by_log_sequence_and_width():
    from cost_models.compute import measured_attention_times_s

    # Per-score forward cost (ns) at (seq, head width); backward 3x.
    points = _attention_points({(256, 8): 1.0, (1024, 8): 2.0, (256, 64): 4.0, (1024, 64): 8.0})
    hw = dataclasses.replace(HW["cpu"], attention_points=points, kernel_overhead_s=0.0)
    scores = lambda b, h, s: b * h * s * s / 2  # noqa: E731

    fwd, bwd = measured_attention_times_s(hw, micro_batch=3, seq_len=1024, num_heads=5, head_dim=64, dtype="fp32")
    assert fwd == pytest.approx(8e-9 * scores(3, 5, 1024)) and bwd == pytest.approx(3 * fwd)
    # Halfway in log(seq) between 256 and 1024 (512), at width 8: 1.5 ns a score.
    fwd, _ = measured_attention_times_s(hw, micro_batch=1, seq_len=512, num_heads=1, head_dim=8, dtype="fp32")
    assert fwd == pytest.approx(1.5e-9 * scores(1, 1, 512))
    # Width 36 is halfway between 8 and 64: at seq 256, (1 + 4) / 2.
    fwd, _ = measured_attention_times_s(hw, micro_batch=1, seq_len=256, num_heads=1, head_dim=36, dtype="fp32")
    assert fwd == pytest.approx(2.5e-9 * scores(1, 1, 256))
    # Beyond the longest point, a + b / s per score through the last two: 1 ns at 256 and 2 at 1024 give
    # a = 7 / 3 and b = -1 / 3 x 1024, so at 4096 2.25 ns. A measurement is not rescaled by
    # compute_time_scale, but 4 processes on 2 cores run it at half a core each.
    scaled = dataclasses.replace(hw, calibration={"compute_time_scale": 3.0}, measured_processes=4, measured_cores=2)
    fwd, _ = measured_attention_times_s(scaled, micro_batch=1, seq_len=4096, num_heads=1, head_dim=8, dtype="fp32")
    assert fwd == pytest.approx(2 * 2.25e-9 * scores(1, 1, 4096))
    alone = dataclasses.replace(scaled, measured_processes=2, measured_cores=8)
    assert measured_attention_times_s(alone, micro_batch=1, seq_len=4096, num_heads=1, head_dim=8, dtype="fp32")[0] == \
        pytest.approx(2.25e-9 * scores(1, 1, 4096))
    # Points timed on every rank at once (profiler version 9) hold the sharing already: priced as they are.
    together = dataclasses.replace(scaled, attention_points=tuple(dataclasses.replace(p, concurrent=True)
                                                                  for p in points))
    assert measured_attention_times_s(together, micro_batch=1, seq_len=4096, num_heads=1, head_dim=8,
                                      dtype="fp32")[0] == pytest.approx(2.25e-9 * scores(1, 1, 4096))
    # Falling per-score costs fall towards their fixed part: 4 ns at 1024, 3 at 2048: a = 2, so 2.5 at 4096;
    # never below zero (8 and 3: a = 0, time then grows as s: 1.5 ns a score at 4096).
    falling = dataclasses.replace(hw, attention_points=_attention_points({(1024, 8): 4.0, (2048, 8): 3.0}))
    fwd, _ = measured_attention_times_s(falling, micro_batch=1, seq_len=4096, num_heads=1, head_dim=8, dtype="fp32")
    assert fwd == pytest.approx(2.5e-9 * scores(1, 1, 4096))
    steep_fall = dataclasses.replace(hw, attention_points=_attention_points({(1024, 8): 8.0, (2048, 8): 3.0}))
    fwd, _ = measured_attention_times_s(steep_fall, micro_batch=1, seq_len=4096, num_heads=1, head_dim=8,
                                        dtype="fp32")
    assert fwd == pytest.approx(1.5e-9 * scores(1, 1, 4096))
    # A narrower head than any measured: the line through the two widths, extrapolated (1 + 3 x (4 - 8) / 56)...
    fwd, _ = measured_attention_times_s(hw, micro_batch=1, seq_len=256, num_heads=1, head_dim=4, dtype="fp32")
    assert fwd == pytest.approx((1 - 12 / 56) * 1e-9 * scores(1, 1, 256))
    # ...but never below the narrow width's cost scaled by the width (a steep line would reach zero).
    steep = dataclasses.replace(hw, attention_points=_attention_points({(256, 8): 1.0, (256, 64): 20.0}))
    fwd, _ = measured_attention_times_s(steep, micro_batch=1, seq_len=256, num_heads=1, head_dim=4, dtype="fp32")
    assert fwd == pytest.approx(0.5e-9 * scores(1, 1, 256))


def test_a_cpu_profile_with_attention_points_prices_the_core_from_them():
    from cost_models.compute import _core_times_s

    model = dataclasses.replace(PRESETS["tiny"], hidden_size=128, num_heads=4, num_kv_heads=4)
    plain = HW["cpu"]
    measured = dataclasses.replace(plain, attention_points=_attention_points(
        {(64, 32): 50.0, (2048, 32): 50.0, (64, 64): 60.0, (2048, 64): 60.0}))
    fwd_plain, _ = _core_times_s(model, plain, kernel="flash2", micro_batch=1, seq_len=2048, tp=1, dtype="fp32")
    fwd, bwd = _core_times_s(model, measured, kernel="flash2", micro_batch=1, seq_len=2048, tp=1, dtype="fp32")
    assert fwd == pytest.approx(50e-9 * 4 * 2048 * 2048 / 2) and bwd == pytest.approx(3 * fwd)
    assert fwd != pytest.approx(fwd_plain)
    # The materialised kernel stays priced as its GEMMs and softmax.
    assert _core_times_s(model, measured, kernel="materialized", micro_batch=1, seq_len=2048, tp=1, dtype="fp32") == \
        _core_times_s(model, plain, kernel="materialized", micro_batch=1, seq_len=2048, tp=1, dtype="fp32")


def _ring_points(ns_per_score: dict[int, float], *, head_dim: int = 32, heads: int = 4, kv_heads: int = 4) -> tuple:
    """RingBlockPoints with these per-score, per-head forward costs (ns) by side: the square step 2x the
    half step's per-score cost, backward 3x forward."""
    from specs.hardware import RingBlockPoint

    def at(side: int, ns: float) -> RingBlockPoint:
        sq, hf = 2 * ns * 1e-9 * heads * side * side, ns * 1e-9 * heads * side * (side // 2)
        return RingBlockPoint(side=side, num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                              square_forward_s=sq, square_backward_s=3 * sq, half_forward_s=hf, half_backward_s=3 * hf)

    return tuple(at(side, ns) for side, ns in ns_per_score.items())


def test_measured_ring_steps_price_the_ring_by_their_scores_in_log_log():
    from cost_models.compute import measured_ring_times_s, own_ring_times_s, ring_blocks_times_s

    points = _ring_points({64: 2.0, 1024: 1.0})  # 4 heads each
    hw = dataclasses.replace(HW["cpu"], ring_points=points, kernel_overhead_s=0.0)
    kw = dict(head_dim=32, gqa=1)
    sq64, sq1024 = points[0].square_forward_s, points[1].square_forward_s
    hf64, hf1024 = points[0].half_forward_s, points[1].half_forward_s
    # At a measured point: step 0's square and ring_size - 1 halves; backward 3x.
    fwd, bwd = measured_ring_times_s(hw, side=1024, heads=4, ring_size=4, **kw)
    assert fwd == pytest.approx(sq1024 + 3 * hf1024) and bwd == pytest.approx(3 * fwd)
    # Halfway between two points in log scores: the geometric mean of their times (a power law).
    fwd, _ = measured_ring_times_s(hw, side=256, heads=4, ring_size=2, **kw)
    assert fwd == pytest.approx((sq64 * sq1024) ** 0.5 + (hf64 * hf1024) ** 0.5)
    # Heads and side share one curve: 16 heads of 128 tokens are the scores of 4 heads of 256.
    assert measured_ring_times_s(hw, side=128, heads=16, ring_size=2, **kw)[0] == pytest.approx(fwd, rel=0.02)
    # Below the smallest point a step costs its launches (held); beyond the largest it grows with its scores.
    assert measured_ring_times_s(hw, side=16, heads=1, ring_size=2, **kw)[0] == pytest.approx(sq64 + hf64)
    base, _ = measured_ring_times_s(hw, side=1024, heads=8, ring_size=4, **kw)
    assert base == pytest.approx(2 * (sq1024 + 3 * hf1024))
    # Timed in one process: 4 processes on 2 cores run it at half a core; the fitted compute scale stays out.
    shared = dataclasses.replace(hw, calibration={"compute_time_scale": 3.0}, measured_processes=4, measured_cores=2)
    assert measured_ring_times_s(shared, side=1024, heads=8, ring_size=4, **kw)[0] == pytest.approx(2 * base)
    # Timed on every rank at once (profiler version 8): the sharing is in the times already.
    together = dataclasses.replace(shared, ring_points=tuple(dataclasses.replace(p, concurrent=True) for p in points))
    assert measured_ring_times_s(together, side=1024, heads=8, ring_size=4, **kw)[0] == pytest.approx(base)
    # Another head width or GQA ratio than measured: no price from the points.
    assert measured_ring_times_s(hw, side=1024, heads=8, ring_size=4, head_dim=64, gqa=1) is None
    assert measured_ring_times_s(hw, side=1024, heads=8, ring_size=4, head_dim=32, gqa=2) is None
    # The engine's steps: as timed where timed; else written out on GPUs, and on CPUs (flash kernel per
    # step) priced like a fused engine's (None here).
    model = dataclasses.replace(PRESETS["tiny"], hidden_size=128, num_heads=4, num_kv_heads=4)
    shape = dict(seq_len=4096, tp=1, cp=4, ring_size=4)
    priced = own_ring_times_s(model, hw, micro_batch=2, **shape)
    assert priced == pytest.approx(measured_ring_times_s(hw, side=1024, heads=8, ring_size=4, **kw))
    assert own_ring_times_s(model, HW["cpu"], micro_batch=2, **shape) is None
    assert own_ring_times_s(model, HW["h100"], micro_batch=2, **shape) == pytest.approx(
        ring_blocks_times_s(model, HW["h100"], micro_batch=2, dtype="fp32", **shape))


def test_flash_rate_follows_the_measured_head_dim_ratio():
    # A100 causal fwd + bwd at 16k keys (flash-attention's assets/flash2_a100_fwd_bwd_benchmark.png):
    # FlashAttention 97 TFLOP/s at head dim 64 against 83 at 128, FlashAttention-2 171 against 189.
    from cost_models.compute import flash_attention_times_s, flash_head_dim_scale

    hw = HW["a100"]
    assert flash_head_dim_scale(hw, kernel="flash1", head_dim=64) == pytest.approx(97 / 83)
    assert flash_head_dim_scale(hw, kernel="flash2", head_dim=32) == pytest.approx(171 / 189)
    assert flash_head_dim_scale(hw, kernel="flash1", head_dim=96) == pytest.approx(1 + (97 / 83 - 1) / 2)
    assert flash_head_dim_scale(hw, kernel="flash1", head_dim=256) == 1.0
    # The same FLOPs (heads x head dim fixed) in heads of 64 run 97/83 as fast as in heads of 128.
    kwargs = dict(kernel="flash1", micro_batch=4, seq_len=8192)
    narrow = flash_attention_times_s(hw, num_heads=32, head_dim=64, **kwargs)
    wide = flash_attention_times_s(hw, num_heads=16, head_dim=128, **kwargs)
    assert wide[0] / narrow[0] == pytest.approx(97 / 83) and wide[1] / narrow[1] == pytest.approx(97 / 83)


def test_hopper_fused_attention_runs_head_dim_64_at_cudnns_measured_ratio():
    """FlashAttention-3 paper (arXiv 2407.08608) Fig. 5, forward, causal, 16k keys on H100: cuDNN 388 TFLOP/s at
    head dim 64 against 539 at 128. GPT-OSS's 64 heads of 64 on one H100, 4096 keys, micro-batch 1: causal FLOPs
    4 x 4096^2 x 64 x 64 / 2 = 137.4 GFLOP, at 989 TFLOP/s x 0.62 x 4096 / (4096 + 384) x 388 / 539:
    137.44e9 / (989e12 x 0.62 x 0.91429 x 0.71985) = 0.3406 ms forward; backward 2.5 x at 0.47: 1.1231 ms."""
    from cost_models.compute import flash_attention_times_s, flash_head_dim_scale

    hw = HW["h100"]
    assert flash_head_dim_scale(hw, kernel="flash3", head_dim=64) == pytest.approx(388 / 539)
    assert flash_head_dim_scale(hw, kernel="flash3", head_dim=128) == 1.0
    forward, backward = flash_attention_times_s(hw, kernel="flash3", micro_batch=1, seq_len=4096, num_heads=64,
                                                head_dim=64)
    assert forward == pytest.approx(0.34056e-3, rel=1e-4)
    assert backward == pytest.approx(1.12313e-3, rel=1e-4)


@pytest.mark.parametrize("name, measured_tflops", [("a100", 81.5), ("h100", 137.0)])
def test_flash1_runs_its_published_rate_at_16k_keys_with_the_triton_kernels_forward_backward_split(
        name, measured_tflops):
    """The FlashAttention-1-class preset reproduces the flash-attention figures' forward + backward rate (causal,
    head dim 128) at the 16k keys they were measured at, and splits it as FlashAttention-2's paper measures
    the Triton kernel: FA2 1.4x faster in the forward, 2x in the backward (specs/hardware.py)."""
    from cost_models.compute import flash_attention_times_s

    hw = HW[name]
    fwd_s, bwd_s = flash_attention_times_s(hw, kernel="flash1", micro_batch=1, seq_len=16384, num_heads=16,
                                           head_dim=128)
    forward_flops = 4 * 16384 ** 2 * 128 * 16 / 2
    assert 3.5 * forward_flops / (fwd_s + bwd_s) / 1e12 == pytest.approx(measured_tflops, rel=0.02)
    eff = hw.kernel_efficiency
    fa2_gap = (eff["flash2_forward"] / eff["flash1_forward"], eff["flash2_backward"] / eff["flash1_backward"])
    assert fa2_gap[1] / fa2_gap[0] == pytest.approx(2.0 / 1.4)
    # Full recomputation re-runs the forward, the kernel's faster half: a quarter more at most (1 + 2.5 passes of equal rate would make it 4.5 / 3.5).
    assert (2 * fwd_s + bwd_s) / (fwd_s + bwd_s) < 1.25
