"""Memory model: ZeRO's byte counts exactly, Korthikanti's activation formula, and the llama variant by hand."""

from fractions import Fraction

import pytest

from cost_models.memory import (end_params_per_device, layer_activation_bytes, layer_params_per_device,
                                model_state_bytes, peak_live_bytes)
from specs.schedule import rank_actions
from specs.model import PRESETS


@pytest.mark.parametrize("num_params,n", [(7_000_000_000, 64), (1_558_000_000, 8), (123_456_789, 3)])
def test_zero_stages_match_the_paper_exactly(num_params, n):
    p = Fraction(num_params)

    def total(shards):
        s = model_state_bytes(p, param_shard=shards[0], grad_shard=shards[1], optim_shard=shards[2], precision="bf16")
        return s.weights_bytes + s.grads_bytes + s.optimizer_bytes

    assert total((1, 1, 1)) == 16 * p
    assert total((1, 1, n)) == 4 * p + 12 * p / n
    assert total((1, n, n)) == 2 * p + 14 * p / n
    assert total((n, n, n)) == 16 * p / n


@pytest.mark.parametrize("shards", [(1, 1, 1), (1, 1, 8), (1, 8, 8), (8, 8, 8)])
def test_fp32_gradient_reduction_holds_four_byte_gradients(shards):
    # The plan's reduce_fp32 knob: under bf16 the gradients (their buffers and their shards) are fp32;
    # weights and optimizer states are unchanged; fp32 jobs are unaffected.
    kwargs = dict(param_shard=shards[0], grad_shard=shards[1], optim_shard=shards[2])
    base = model_state_bytes(1000, precision="bf16", **kwargs)
    fp32_grads = model_state_bytes(1000, precision="bf16", reduce_fp32=True, **kwargs)
    assert fp32_grads.grads_bytes == 2 * base.grads_bytes == 4000 / shards[1]
    assert (fp32_grads.weights_bytes, fp32_grads.optimizer_bytes) == (base.weights_bytes, base.optimizer_bytes)
    assert model_state_bytes(1000, precision="fp32", reduce_fp32=True, **kwargs) == \
        model_state_bytes(1000, precision="fp32", **kwargs)


def test_fp32_keeps_no_separate_master_copy():
    s = model_state_bytes(1000, param_shard=1, grad_shard=1, optim_shard=1, precision="fp32")
    assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (4000, 4000, 8000)


@pytest.mark.parametrize("name,pp", [("gpt3-1.7b", 1), ("llama3-8b", 1), ("tiny", 1), ("llama3.2-1b", 1)])
def test_parameter_split_adds_up_to_the_model(name, pp):
    model = PRESETS[name]
    first, last = end_params_per_device(model, tp=1, pp=pp)
    assert first + last + model.num_layers * layer_params_per_device(model, tp=1) == model.num_params()


def test_tied_embeddings_need_a_second_copy_across_the_pipeline():
    model = PRESETS["gpt3-1.7b"]
    _, last_pp1 = end_params_per_device(model, tp=1, pp=1)
    _, last_pp2 = end_params_per_device(model, tp=1, pp=2)
    assert last_pp2 - last_pp1 == model.vocab_size * model.hidden_size


@pytest.mark.parametrize("tp", [1, 2, 8])
def test_gpt_activations_are_korthikanti(tp):
    model = PRESETS["gpt3-175b"]  # a = 96 heads, h = 12288
    s, b, h, a = 2048, 1, model.hidden_size, model.num_heads
    sbh = s * b * h
    kw = dict(micro_batch=b, seq_len=s, tp=tp, precision="bf16")
    core = Fraction(5 * a * s, h * tp)
    assert layer_activation_bytes(model, policy="none", sequence_parallel=False, **kw) == \
        sbh * (10 + Fraction(24, tp) + core)
    if tp > 1:
        assert layer_activation_bytes(model, policy="none", sequence_parallel=True, **kw) == \
            sbh * (Fraction(34, tp) + core)
        assert layer_activation_bytes(model, policy="selective", sequence_parallel=True, **kw) == sbh * Fraction(34, tp)
        assert layer_activation_bytes(model, policy="full", sequence_parallel=True, **kw) == 2 * sbh / tp
    assert layer_activation_bytes(model, policy="full", sequence_parallel=False, **kw) == 2 * sbh


def test_llama_activations_by_hand():
    # tiny (bf16, b=1, s=4 -> 4 tokens): h=64, kv width 32, f=176, 8 heads. Per norm: fp32 input
    # 4*4*64 + normalised 2*4*64; GEMM inputs (qkv, mlp) 2*4*64 each; q 2*4*64, k and v 2*4*32 each,
    # out-proj input 2*4*64; attention core: repeated k/v beyond the KV width 2*4*2*(64-32), output
    # 2*4*64, fp32 log-sum-exp 4*8*4; SwiGLU gate, silu, up, product 4 x 2*4*176.
    norms = 2 * (1024 + 512)
    gemm_inputs = 2 * 512
    qkv_out = 512 + 2 * 256 + 512
    core = 512 + 512 + 128
    mlp = 5632
    kw = dict(micro_batch=1, seq_len=4, tp=1, sequence_parallel=False, precision="bf16")
    assert layer_activation_bytes(PRESETS["tiny"], policy="none", **kw) == norms + gemm_inputs + qkv_out + core + mlp
    assert layer_activation_bytes(PRESETS["tiny"], policy="selective", **kw) == norms + gemm_inputs + qkv_out + mlp
    assert layer_activation_bytes(PRESETS["tiny"], policy="full", **kw) == 2 * 4 * 64


def test_llama_activations_under_fused_kernels_by_hand():
    # tiny as above, but as Transformer Engine runs it: each norm keeps its 16-bit input 2*4*64 and an
    # fp32 inverse RMS per token 4*4; the core keeps only the log-sum-exp 4*8*4 (the KV heads are read
    # as they are, the output is the projection's input); the fused SwiGLU keeps gate+up and the
    # product, 3 x 2*4*176.
    norms = 2 * (512 + 16)
    gemm_inputs = 2 * 512
    qkv_out = 512 + 2 * 256 + 512
    core = 128
    mlp = 3 * 2 * 4 * 176
    kw = dict(micro_batch=1, seq_len=4, tp=1, sequence_parallel=False, precision="bf16", fused=True,
              fused_elementwise=True)
    assert layer_activation_bytes(PRESETS["tiny"], policy="none", **kw) == norms + gemm_inputs + qkv_out + core + mlp
    assert layer_activation_bytes(PRESETS["tiny"], policy="selective", **kw) == norms + gemm_inputs + qkv_out + mlp


def test_transformer_engine_fp8_linears_keep_their_inputs_as_fp8():
    # tiny as above under fp8: the qkv, MLP-in and MLP-out GEMM inputs in 1 byte, the projection after
    # attention keeps its fp8 cast beside the kernel's 16-bit output.
    kw = dict(micro_batch=1, seq_len=4, tp=1, sequence_parallel=False, fused=True, fused_elementwise=True)
    bf16 = layer_activation_bytes(PRESETS["tiny"], policy="none", precision="bf16", **kw)
    fp8 = layer_activation_bytes(PRESETS["tiny"], policy="none", precision="fp8", **kw)
    tokens, h, f = 4, 64, 176
    assert bf16 - fp8 == 2 * tokens * h * (2 - 1) + tokens * f * (2 - 1) - tokens * h


def test_gpt_under_a_flash_kernel_keeps_no_square_and_no_masks_without_dropout():
    model = PRESETS["gpt3-175b"]
    s, b, h, a = 2048, 1, model.hidden_size, model.num_heads
    sbh = s * b * h
    kw = dict(micro_batch=b, seq_len=s, tp=1, precision="bf16", sequence_parallel=False, fused=True)
    # Korthikanti's 34 s b h less the three s x s tensors, plus the fp32 log-sum-exp 4 a s b.
    assert layer_activation_bytes(model, policy="none", **kw) == 34 * sbh + 4 * a * s * b
    # Without dropout its two residual masks (1 byte each) go too.
    assert layer_activation_bytes(model, policy="none", dropout=False, **kw) == 32 * sbh + 4 * a * s * b


def test_more_recomputation_keeps_less():
    model = PRESETS["llama3-70b"]
    kw = dict(micro_batch=1, seq_len=4096, tp=8, sequence_parallel=True, precision="bf16")
    none, sel, full = (layer_activation_bytes(model, policy=p, **kw) for p in ("none", "selective", "full"))
    assert none > sel > full > 0


@pytest.mark.parametrize("schedule,pp,v,m", [("1f1b", 4, 1, 3), ("1f1b", 4, 1, 16), ("gpipe", 3, 1, 5),
                                             ("interleaved-1f1b", 4, 2, 8), ("interleaved-1f1b", 2, 3, 6)])
def test_equal_chunks_peak_at_max_in_flight(schedule, pp, v, m):
    from specs.schedule import max_in_flight

    for actions in rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m):
        chunks = {a.chunk for a in actions}
        assert peak_live_bytes(actions, chunk_bytes=dict.fromkeys(chunks, 3.0),
                               chunk_cache_bytes=dict.fromkeys(chunks, 0.0)) == 3.0 * max_in_flight(actions)


def test_peak_live_bytes_counts_in_flight_micro_batches_and_one_cache_per_chunk():
    actions = rank_actions(schedule="1f1b", pp=4, virtual_stages=1, num_micro_batches=8)[0]
    assert peak_live_bytes(actions, chunk_bytes={0: 10.0}, chunk_cache_bytes={0: 0.0}) == 40.0
    assert peak_live_bytes(actions, chunk_bytes={0: 10.0}, chunk_cache_bytes={0: 5.0}) == 45.0
    inter = rank_actions(schedule="interleaved-1f1b", pp=2, virtual_stages=2, num_micro_batches=4)[0]
    # Rank 0 holds chunks 0 and 2: F0 F0 F2 F2 | F0 B2 F0 B2 F2 B0 F2 B0 | ... so at most 3 x chunk 0
    # + 2 x chunk 2 (after the fifth forward) or 4 x chunk 0 + 1 x chunk 2 (after the sixth).
    def peak(w0, w2):
        return peak_live_bytes(inter, chunk_bytes={0: w0, 2: w2}, chunk_cache_bytes={0: 0.0, 2: 0.0})
    assert peak(1.0, 100.0) == 203.0
    assert peak(100.0, 1.0) == 401.0
    assert peak(1.0, 1.0) == 5.0


@pytest.mark.parametrize("schedule,pp,v", [("1f1b", 4, 1), ("1f1b", 8, 1), ("interleaved-1f1b", 2, 2),
                                           ("interleaved-1f1b", 4, 3), ("interleaved-1f1b", 8, 2)])
def test_capped_action_lists_give_the_full_peak(schedule, pp, v):
    import random

    from cost_models.estimate import _memory_profiles
    from cost_models.memory import peak_from_profiles

    rng = random.Random(pp * 10 + v)
    for m in (4 * pp, 5 * pp, 12 * pp):
        full = rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m)
        capped = _memory_profiles(schedule, pp, v, m)
        for rank in range(pp):
            chunks = range(rank, pp * v, pp)
            for _ in range(5):
                weights = {c: rng.uniform(0, 10) for c in chunks}
                cache = {c: rng.choice([0.0, rng.uniform(0, 5)]) for c in chunks}
                assert peak_from_profiles(capped[rank], chunk_bytes=weights, chunk_cache_bytes=cache) == \
                    pytest.approx(peak_live_bytes(full[rank], chunk_bytes=weights, chunk_cache_bytes=cache))


def test_fp8_params_keep_the_fp8_weight_and_its_transpose_not_a_bf16_copy():
    """Megatron's --fp8-param-gather holds each weight as a Float8Tensor (1-byte buffer) plus the fp8
    transpose Hopper's GEMMs read in backward: 2 bytes, where bf16 weights with their fp8 cast take 3; the
    gradient and the 12 optimizer bytes are unchanged."""
    from cost_models.memory import state_bytes_per_param

    assert state_bytes_per_param("fp8") == (3, 2, 12)
    assert state_bytes_per_param("fp8", fp8_params=True) == (2, 2, 12)
    assert state_bytes_per_param("bf16", fp8_params=True) == (2, 2, 12)  # only fp8 weights change
    s = model_state_bytes(1000, param_shard=1, grad_shard=1, optim_shard=16, precision="fp8", fp8_params=True)
    assert (s.weights_bytes, s.grads_bytes, s.optimizer_bytes) == (2000, 2000, 750)


def test_interleaved_first_rank_holds_megatrons_in_flight_micro_batches():
    """Megatron-LM's report_theoretical_memory (megatron/training/theoretical_memory_usage.py) scales the
    pp micro-batches of the first stage by 1 + (pp - 1) / (pp v) under interleaving; its schedule warms up
    (pp - 1) x 2 + (v - 1) x pp chunk-forwards on rank 0 and runs one more before the first backward. For
    pp = v = 8 (Llama 3.1 405B's recipe): 14 + 56 + 1 = 71 chunks of 1/v of the rank's layers, which is
    pp x v x (1 + 7/64) = 71."""
    actions = rank_actions(schedule="interleaved-1f1b", pp=8, virtual_stages=8, num_micro_batches=64)[0]
    chunks = {a.chunk for a in actions}
    peak = peak_live_bytes(actions, chunk_bytes=dict.fromkeys(chunks, 1.0), chunk_cache_bytes=dict.fromkeys(chunks, 0.0))
    assert peak == 71 == 8 * 8 * (1 + Fraction(7, 64))
