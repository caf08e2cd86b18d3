"""Compute cost of one transformer layer, the embedding and the head: FLOPs and seconds per micro-batch.

FLOP counts are exact matmul counts (2 FLOPs per multiply-add), per layer, forward:

    QKV     2 T h (h + 2 kv)            T = b s tokens, kv = num_kv_heads * head_dim (GQA)
    scores  2 b s^2 h                   (Q K^T, every head, the full s x s square as Megatron computes it)
    context 2 b s^2 h                   (softmax(...) V)
    out     2 T h^2
    MLP     2 T h f * 2 (GELU) or 3 (SwiGLU: gate, up, down)

For GPT (f = 4h, kv = h) this is 24 T h^2 + 4 T s h, the per-layer term of Narayanan et al., "Efficient
Large-Scale Language Model Training on GPU Clusters Using Megatron-LM" (SC21), whose step total with full
recomputation is 96 B s l h^2 (1 + s/(6h) + V/(16 l h)): forward once, backward twice (input and weight
gradients), recomputation once more, and the LM head 2 T h V forward plus twice that backward (never
recomputed). Selective recomputation (Korthikanti et al., "Reducing Activation Recomputation in Large
Transformer Models", 2022) recomputes only the attention core: the scores, softmax, dropout and context,
4 b s^2 h FLOPs plus the softmax's memory traffic.

The attention core runs the way each architecture is trained: "gpt2" as Megatron-LM (SC21) runs it,
scores materialised, a fused scale-mask-softmax and dropout over the full s x s square; "llama" as
fused attention (PyTorch's scaled_dot_product_attention, the FlashAttention algorithm, which our
engine calls): no s x s tensor in memory, the causal half of the square skipped, and a backward that
recomputes the scores (5 GEMMs of the forward's 2, so 2.5x the forward). FLOP counts (MFU, TFLOP/s)
count the full square either way, as the Megatron formula does, so figures stay comparable.

Time: a GEMM of m x k by k x n runs at peak_flops(dtype) * efficiency(m, n, k) with
efficiency = gemm_max_efficiency * prod_d d / (d + gemm_half_dim) (small dimensions starve the tensor
cores), and never faster than kernel_overhead_s. With measured `gemm_points` in the profile, the
efficiency is the measured one of the nearest point (in log-dimension space) scaled by the analytic
curve's ratio between the two shapes, so it is exact at the measured shapes and follows the analytic
shape in between. Elementwise and normalisation ops are priced by their bytes over the achieved memory
bandwidth (memory_bandwidth_bytes_per_s * MEMORY_BANDWIDTH_EFFICIENCY, or
hardware.calibration["memory_bandwidth_efficiency"]).

Tensor parallelism divides the GEMMs as Megatron does (QKV and MLP-up column-parallel: n / tp; out and
MLP-down row-parallel: k / tp; attention by heads), and the softmax by heads; hidden-sized elementwise
work (norms, residual adds, dropout) is replicated on every TP rank unless sequence parallelism splits it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

from specs.model import ModelSpec
from cost_models.engines import ENGINES, EngineModel, ring_blocks_written_out
from specs.hardware import FLASH_HALF_SEQ, Hardware

# Elementwise kernels reach about 80% of the HBM datasheet bandwidth (STREAM-like copies on A100/H100).
MEMORY_BANDWIDTH_EFFICIENCY = 0.8
# Vocabulary-parallel cross entropy on fp32 logits: casting, max, exp-sum and the gradient each pass
# over the logits; bytes per logit element, forward and backward (Megatron's fused implementation).
LOSS_BYTES_PER_LOGIT_FWD = 16
LOSS_BYTES_PER_LOGIT_BWD = 12


@dataclass(frozen=True)
class Gemm:
    """One (possibly batched) matmul: `batch` independent (m x k) @ (k x n) products."""

    m: int
    n: int
    k: int
    batch: int = 1

    @property
    def flops(self) -> int:
        return 2 * self.m * self.n * self.k * self.batch

    def backward(self) -> tuple["Gemm", "Gemm"]:
        """Input gradient (m x n)(n x k) and weight gradient (k x m)(m x n)."""
        return Gemm(self.m, self.k, self.n, self.batch), Gemm(self.k, self.n, self.m, self.batch)


def layer_gemms(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int = 1) -> dict[str, list[Gemm]]:
    """The forward GEMMs of one transformer layer on one TP rank, grouped as 'dense' and 'attention'."""
    b, s, h, f = micro_batch, seq_len, model.hidden_size, model.ffn_hidden_size
    tokens, kv, d = b * s, model.kv_dim, model.head_dim
    heads = b * model.num_heads // tp
    q = model.num_heads * d  # h, except where a config sets head_dim (Qwen3) or MLA's dims
    if model.uses_mla:
        dense = _mla_gemms(model, tokens=tokens, tp=tp) + [Gemm(tokens, f // tp, h), Gemm(tokens, f // tp, h),
                                                           Gemm(tokens, h, f // tp)]
    elif model.arch == "llama":
        # Our engine's llama layer: separate q, k, v, gate and up projections (runners/transformer.py).
        dense = [Gemm(tokens, q // tp, h), Gemm(tokens, kv // tp, h), Gemm(tokens, kv // tp, h),
                 Gemm(tokens, h, q // tp), Gemm(tokens, f // tp, h), Gemm(tokens, f // tp, h),
                 Gemm(tokens, h, f // tp)]
    else:
        # Megatron GPT: fused QKV projection, GELU MLP.
        dense = [Gemm(tokens, (h + 2 * kv) // tp, h), Gemm(tokens, h, h // tp), Gemm(tokens, f // tp, h),
                 Gemm(tokens, h, f // tp)]
    attention = [Gemm(s, s, d, heads), Gemm(s, d, s, heads)]
    return {"dense": dense, "attention": attention}


def _mla_gemms(model: ModelSpec, *, tokens: int, tp: int) -> list[Gemm]:
    """DeepSeek-V3's multi-head latent attention projections on one TP rank (Megatron-Core's MLA: the
    down-projections to the q and kv latents replicated over TP, the up-projections and output split by
    heads): q_a (h -> q_lora), q_b (-> heads x (nope + rope)), kv_a (h -> kv_lora + rope), kv_b (-> heads x
    (nope + v)), o (heads x v -> h)."""
    h, n = model.hidden_size, model.num_heads // tp
    nope, rope, v, ql, kl = (model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim, model.q_lora_rank,
                             model.kv_lora_rank)
    query = [Gemm(tokens, ql, h), Gemm(tokens, n * (nope + rope), ql)] if ql else [Gemm(tokens, n * (nope + rope), h)]
    return query + [Gemm(tokens, kl + rope, h), Gemm(tokens, n * (nope + v), kl), Gemm(tokens, h, n * v)]


def layer_forward_flops(model: ModelSpec, *, micro_batch: int, seq_len: int) -> int:
    """Exact matmul FLOPs of one layer's forward for one micro-batch (all TP ranks together); for an MoE
    model the mean over its layers, an MoE layer's MLP counted as the router, the k experts a token uses
    and the shared expert (the active parameters' FLOPs, as MoE MFU is reported)."""
    dense = sum(g.flops for group in layer_gemms(model, micro_batch=micro_batch, seq_len=seq_len).values()
                for g in group)
    if not model.is_moe:
        return dense
    tokens, h = micro_batch * seq_len, model.hidden_size
    widths = model.num_experts_per_token * model.expert_ffn_hidden_size + model.shared_expert_ffn_hidden_size
    moe = dense - 6 * tokens * h * model.ffn_hidden_size + 2 * tokens * h * (model.num_experts + 3 * widths)
    return round((model.num_dense_layers * dense + model.num_moe_layers * moe) / model.num_layers)


def attention_core_flops(model: ModelSpec, *, micro_batch: int, seq_len: int) -> int:
    """Forward FLOPs of scores and context (4 b s^2 h): what selective recomputation repeats."""
    return 4 * micro_batch * seq_len * seq_len * model.hidden_size


def head_forward_flops(model: ModelSpec, *, micro_batch: int, seq_len: int) -> int:
    """The LM head projection 2 T h V (the loss itself is elementwise and priced by bandwidth)."""
    return 2 * micro_batch * seq_len * model.hidden_size * model.vocab_size


def recompute_flops(model: ModelSpec, *, policy: str, micro_batch: int, seq_len: int) -> int:
    """Extra forward FLOPs one layer spends on recomputation under `policy`."""
    if policy == "full":
        return layer_forward_flops(model, micro_batch=micro_batch, seq_len=seq_len)
    if policy == "selective":
        return attention_core_flops(model, micro_batch=micro_batch, seq_len=seq_len)
    return 0


def model_flops_per_step(model: ModelSpec, *, global_batch: int, seq_len: int,
                         recompute_layers: tuple[str, ...] | None = None) -> int:
    """Matmul FLOPs of one step: 3x forward (forward + 2x backward) for layers and head, plus each
    layer's recomputation under `recompute_layers` (None: no recomputation, which is what MFU counts).

    With every layer on "full" this is Narayanan et al.'s 96 B s l h^2 (1 + s/(6h) + V/(16 l h)) for GPT.
    """
    per_layer = layer_forward_flops(model, micro_batch=global_batch, seq_len=seq_len)
    total = 3 * (model.num_layers * per_layer + head_forward_flops(model, micro_batch=global_batch, seq_len=seq_len))
    for policy in set(recompute_layers or ()):
        count = recompute_layers.count(policy)
        total += count * recompute_flops(model, policy=policy, micro_batch=global_batch, seq_len=seq_len)
    return total


# --- time ----------------------------------------------------------------------------------------
# Tiles a GPU GEMM library falls back to when its large tile would leave SMs idle in the last wave: the
# large tile's rows and columns divided by these, and the K dimension split across this many tiles
# (split-K: partial sums written and added), keeping this share of its rate (a smaller tile reuses each
# loaded operand less; a split pays the extra pass). A modelling assumption in the spirit of cuBLAS's
# heuristics, not a measurement.
TILE_CANDIDATES = ((1, 1, 1, 1.0), (2, 1, 1, 0.9), (2, 2, 1, 0.75), (1, 1, 2, 0.92), (1, 1, 4, 0.85))
# Split-K only where each part keeps a long K loop.
MIN_SPLIT_K = 1024


def _wave_efficiency(hw: Hardware, m: float, n: float, k: float, batch: float) -> float:
    """Share of the SMs' time a GEMM's output tiles keep busy: one tile per SM per wave, the last wave
    part-empty and the edge tiles padded (NVIDIA, "Matrix Multiplication Background User's Guide": tile
    and wave quantization), with the best of TILE_CANDIDATES for the whole device. Beside a collective
    (hw.sms_held) the library still launches that choice, which then runs in waves over the SMs left."""
    return _waves(hw.num_sms, hw.sms_held, hw.gemm_tile[0], hw.gemm_tile[1], m, n, k, batch)


@functools.lru_cache(maxsize=65536)
def _waves(num_sms: int, held: int, tile_rows: int, tile_cols: int, m: float, n: float, k: float,
           batch: float) -> float:
    best, best_run = 0.0, 0.0
    for rows, cols, split, rate in TILE_CANDIDATES:
        if split > 1 and k / split < MIN_SPLIT_K:
            continue
        tile_m, tile_n = tile_rows / rows, tile_cols / cols
        tiles = math.ceil(m / tile_m) * math.ceil(n / tile_n) * batch * split
        work = rate * m * n * batch * split / (num_sms * tile_m * tile_n)
        utilization = work / math.ceil(tiles / num_sms)
        if utilization > best:
            best, best_run = utilization, work / math.ceil(tiles / (num_sms - held))
    return best_run


def _analytic_efficiency(hw: Hardware, m: float, n: float, k: float, batch: float = 1) -> float:
    half = hw.gemm_half_dim
    if hw.num_sms > 0:
        return hw.gemm_max_efficiency * _wave_efficiency(hw, m, n, k, batch) * (k / (k + half))
    return hw.gemm_max_efficiency * (m / (m + half)) * (n / (n + half)) * (k / (k + half))


def gemm_efficiency(hw: Hardware, *, m: int, n: int, k: int, dtype: str, batch: int = 1) -> float:
    """Fraction of peak a GEMM of this shape reaches (see the module docstring); fp8 GEMMs scale the
    curve to the hardware's measured fp8 rate (kernel_efficiency["fp8_gemm"])."""
    analytic = _analytic_efficiency(hw, m, n, k, batch)
    if dtype == "fp8" and hw.has_kernel("fp8_gemm"):
        return analytic * hw.kernel_efficiency["fp8_gemm"] / hw.gemm_max_efficiency
    nearest = _nearest_point(hw.gemm_points, dtype=dtype, m=m, n=n, k=k)
    if nearest is None:
        return analytic
    measured = nearest.flops_per_s / hw.peak_flops(dtype)
    return min(1.0, measured * analytic / _analytic_efficiency(hw, nearest.m, nearest.n, nearest.k))


# (id of a profile's gemm_points, dtype, m, n, k) -> (those points, the nearest one): a calibration prices
# the same shapes thousands of times with only its parameters changed, and this search was half of a fit's
# time. Each entry holds its points, so the id cannot be reused while the entry lives.
_NEAREST_POINTS: dict[tuple, tuple] = {}


def _nearest_point(points: tuple, *, dtype: str, m: int, n: int, k: int):
    """The measured GEMM of `dtype` nearest (m, n, k) in log space, or None."""
    key = (id(points), dtype, m, n, k)
    hit = _NEAREST_POINTS.get(key)
    if hit is not None and hit[0] is points:
        return hit[1]
    mine = [p for p in points if p.dtype == dtype]
    nearest = None
    if mine:
        lm, ln, lk = math.log2(m), math.log2(n), math.log2(k)
        nearest = min(mine, key=lambda p: (math.log2(p.m) - lm) ** 2 + (math.log2(p.n) - ln) ** 2
                      + (math.log2(p.k) - lk) ** 2)
    if len(_NEAREST_POINTS) > 1 << 16:
        _NEAREST_POINTS.clear()
    _NEAREST_POINTS[key] = (points, nearest)
    return nearest


# Bytes an element of a GEMM operand takes in HBM, by the GEMM's dtype.
OPERAND_BYTES = {"fp8": 1, "bf16": 2, "fp16": 2, "fp32": 4}
# An output accumulated into an fp32 buffer (beta = 1) is read and written: 4 + 4 bytes an element.
FP32_ACCUMULATE_BYTES = 8


def gemm_time_s(hw: Hardware, gemm: Gemm, *, dtype: str, accumulate_fp32: bool = False) -> float:
    """Seconds for one (batched) GEMM: FLOPs at the shape's efficiency, floored at the kernel overhead.

    `accumulate_fp32`: the GEMM adds its result into an fp32 buffer, as Megatron's weight-gradient GEMMs
    add into the fp32 main gradients (--gradient-accumulation-fusion, on by default; Transformer Engine's
    fuse_wgrad_accumulation, its GroupedLinear's for the experts). Such a GEMM also waits for its bytes:
    its operands read once and the buffer read and written (`gemm_accumulate_bytes`) over the achieved
    HBM bandwidth, which binds when its K dimension (the tokens, or an expert's few rows) is short beside
    an output of the weight's size. Other GEMMs are priced by their FLOPs only."""
    eff = gemm_efficiency(hw, m=gemm.m, n=gemm.n, k=gemm.k, dtype=dtype, batch=gemm.batch)
    scale = hw.calibration.get("compute_time_scale", 1.0)
    compute_s = max(scale * gemm.flops / (hw.peak_flops(dtype) * eff), hw.kernel_overhead_s)
    if not accumulate_fp32:
        return compute_s
    return max(compute_s, memory_time_s(hw, gemm_accumulate_bytes(gemm, dtype=dtype)))


def gemm_accumulate_bytes(gemm: Gemm, *, dtype: str) -> float:
    """HBM bytes of a GEMM accumulating into fp32: both operands read once, the m x n fp32 output read and
    written (the compulsory traffic; tiles re-reading operands through L2 add to it)."""
    operands = (gemm.m * gemm.k + gemm.k * gemm.n) * OPERAND_BYTES.get(dtype, 2)
    return gemm.batch * (operands + gemm.m * gemm.n * FP32_ACCUMULATE_BYTES)


def backward_gemms_time_s(hw: Hardware, gemm: Gemm, *, dtype: str, accumulate_fp32: bool = False) -> float:
    """Seconds of a GEMM's input gradient and weight gradient (Gemm.backward), the weight gradient added
    into fp32 main gradients where `accumulate_fp32` (gemm_time_s)."""
    dgrad, wgrad = gemm.backward()
    return gemm_time_s(hw, dgrad, dtype=dtype) + gemm_time_s(hw, wgrad, dtype=dtype, accumulate_fp32=accumulate_fp32)


def memory_time_s(hw: Hardware, num_bytes: float, *, num_kernels: int = 1) -> float:
    """Seconds for bandwidth-bound kernels moving `num_bytes`, floored at one overhead per kernel."""
    eff = hw.calibration.get("memory_bandwidth_efficiency", MEMORY_BANDWIDTH_EFFICIENCY)
    scale = hw.calibration.get("compute_time_scale", 1.0)
    return max(scale * num_bytes / (hw.memory_bandwidth_bytes_per_s * eff), num_kernels * hw.kernel_overhead_s)


def activation_bytes_per_element(precision: str) -> int:
    return 4 if precision == "fp32" else 2


def attention_kernel(model: ModelSpec, engine: EngineModel, hw: Hardware | None = None) -> str:
    """The attention core's kernel: "flash2", "flash3" or "materialized" (cost_models/engines.py).
    FlashAttention-3 is a Hopper kernel: elsewhere an engine that would use it runs FlashAttention-2."""
    if engine.attention == "by-arch":
        # This project's engine calls SDPA: a flash kernel on GPUs; on a CPU profile (no flash kernel
        # efficiency) the llama layer's fused path and the GPT layer's materialised one, as calibrated.
        if hw is not None and hw.has_kernel("flash2_forward"):
            return "flash3" if hw.has_kernel("flash3_forward") else "flash2"
        return "flash2" if model.arch == "llama" else "materialized"
    if engine.attention == "flash3" and hw is not None and not hw.has_kernel("flash3_forward"):
        return "flash2"
    return engine.attention


def fused_attention(model: ModelSpec, engine: EngineModel | None = None, hw: Hardware | None = None) -> bool:
    """Whether the attention core is fused (flash-style): no s x s tensor in memory."""
    return attention_kernel(model, engine or ENGINES["ours"], hw) != "materialized"


# Fused causal attention skips the masked half of the score blocks; its backward recomputes the scores
# (5 GEMM-sized passes against the forward's 2: 2.5x its FLOPs, FlashAttention-2's own count).
FUSED_CAUSAL_FRACTION = 0.5
FUSED_BACKWARD_RATIO = 2.5
# A flash kernel's efficiency falls on short key sequences: efficiency x s / (s + FLASH_HALF_SEQ), declared
# in specs/hardware.py beside the kernel efficiencies measured at a given key length.


def flash_head_dim_scale(hw: Hardware, *, kernel: str, head_dim: int) -> float:
    """The flash kernel's rate at `head_dim` over its rate at 128 (what kernel_efficiency holds): the
    measured head-dim-64 ratio (`head_dim_64_<kernel>`, specs/hardware.py) at 64 and below, 1 at 128 and
    above, linear in between (MPT-3b's 80)."""
    ratio = hw.kernel_efficiency.get(f"head_dim_64_{kernel}", 1.0)
    weight = min(1.0, max(0.0, (128 - head_dim) / 64))
    return 1.0 + (ratio - 1.0) * weight


def flash_attention_times_s(hw: Hardware, *, kernel: str, micro_batch: int, seq_len: int, num_heads: int,
                            head_dim: int, key_block: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of causal flash attention over `num_heads` heads on one device, at the
    hardware's measured kernel efficiency (Hardware.kernel_efficiency; FlashAttention papers' FLOP
    count: 4 b s^2 d per head forward, causal half of it, backward 2.5x; at its head dimension,
    `flash_head_dim_scale`). `key_block`: the keys one kernel
    call sees when the work is cut into blocks (a context-parallel ring step), which sets its efficiency."""
    flops = 4 * micro_batch * seq_len * seq_len * head_dim * num_heads * FUSED_CAUSAL_FRACTION
    keys = key_block or seq_len
    shape = keys / (keys + FLASH_HALF_SEQ) * flash_head_dim_scale(hw, kernel=kernel, head_dim=head_dim)
    peak = hw.peak_flops("bf16")
    scale = hw.calibration.get("compute_time_scale", 1.0)
    forward = scale * flops / (peak * hw.kernel_efficiency[f"{kernel}_forward"] * shape)
    backward = scale * FUSED_BACKWARD_RATIO * flops / (peak * hw.kernel_efficiency[f"{kernel}_backward"] * shape)
    return max(forward, hw.kernel_overhead_s), max(backward, hw.kernel_overhead_s)


# flash_attn.bert_padding (flash-attn 2.4.2), as llm-foundry's flash_attn_fn calls it on every layer: unpad_input
# gathers each of q, k and v into packed rows (IndexFirstAxis: torch.gather, read + write) and pad_input scatters
# the output back into a zeroed padded tensor (IndexPutFirstAxis: zeros, then index_put: read + write); backward,
# pad_input's gradient is a gather (read + write) and each unpad's a scatter into zeros (write, read + write).
UNPAD_KERNELS_FWD = 5
UNPAD_KERNELS_BWD = 7


def unpadded_attention_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int,
                             precision: str) -> tuple[float, float]:
    """(forward, backward) HBM bytes one layer's unpad / pad passes move on one TP rank (comment above)."""
    p = activation_bytes_per_element(precision)
    tokens, q, kv = micro_batch * seq_len, model.hidden_size / tp, model.kv_dim / tp
    forward = tokens * (2 * p * (q + 2 * kv) + 3 * p * q)
    backward = tokens * (2 * p * q + 3 * p * (q + 2 * kv))
    return forward, backward


def contended(hw: Hardware) -> Hardware:
    """The device as the compute beside a running collective sees it: the collective's CTAs hold
    `nccl_ctas` SMs, so each GEMM's waves run over the rest (a GEMM of about one wave nearly doubles, a long
    one slows by the share held), fused kernels slow in proportion, and the collective's copies take the
    same share of HBM bandwidth. The device itself where no collective holds SMs (CPUs)."""
    if hw.num_sms <= 0 or hw.nccl_ctas <= 0:
        return hw
    left = (hw.num_sms - hw.nccl_ctas) / hw.num_sms
    fused = {k: v * left for k, v in hw.kernel_efficiency.items() if k.startswith("flash")}
    return dataclasses.replace(hw, sms_held=hw.nccl_ctas,
                               memory_bandwidth_bytes_per_s=hw.memory_bandwidth_bytes_per_s * left,
                               kernel_efficiency={**hw.kernel_efficiency, **fused})


@dataclass(frozen=True)
class LayerComputeTimes:
    """Seconds of one layer for one micro-batch on one device (compute only; TP comm is separate)."""

    forward_s: float
    backward_s: float
    attention_core_forward_s: float  # the part selective recomputation repeats


def _elementwise_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                       precision: str, engine: EngineModel, materialized: bool) -> tuple[float, float]:
    """Forward bytes moved by one layer's elementwise ops on one TP rank: (hidden/FFN ops, attention core).

    Per token, with p bytes an activation element:
    - two norms. Fused (Megatron's, GPT's F.layer_norm): read + write, 2p h each. Eager RMSNorm in fp32 (this
      engine's and torchtitan's, as the Llama reference code): x.float() (p + 4), the square (8), the mean (4),
      the scaling (8), the cast back (4 + p) and the weight (2p): (28 + 4p) h each (28 h in fp32: no casts);
    - two residual adds (read 2, write 1: 3p h; GPT's fused bias-dropout-add also writes a 1-byte mask);
    - the MLP activation: GELU read + write f; SwiGLU eager silu then the product, 5p f; fused 3p f;
    - RoPE on q and k (llama): fused one pass, 2p (q + kv); eager half-split (four products, two sums,
      the concatenation), 9p (q + kv), q the query width (heads x head_dim);
    - Qwen3's RMSNorm of every query and key head (qk_norm; Megatron's --qk-layernorm, one TE norm
      each): as the block's norms, over the q (heads x head_dim) and k (kv) widths;
    - in eager GQA, the repeat of k and v to every query head.
    Per attention score (materialised attention only): the fused scale-mask-softmax reads and writes it;
    GPT's dropout reads, writes and stores a mask. Hidden-sized ops are split by sequence parallelism,
    head-sized ones by TP.
    """
    p, h, f = activation_bytes_per_element(precision), model.hidden_size, model.ffn_hidden_size
    tokens = micro_batch * seq_len
    dropout = model.arch == "gpt2" and engine.gpt_dropout
    eager_rms = model.arch == "llama" and not engine.fused_elementwise
    casts = (p + 4) + (4 + p) if p != 4 else 0  # to fp32 and back; no copies when training in fp32
    norm = (20 + 2 * p + casts) if eager_rms else 2 * p
    hidden = h * (2 * norm + 2 * (3 * p + (1 if dropout else 0)))
    hidden_per_rank = hidden / tp if sequence_parallel else hidden
    if model.gated_mlp:
        sharded = (3 if engine.fused_elementwise else 5) * p * f
    else:
        sharded = 2 * p * f
    if model.arch == "llama":
        q = model.num_heads * model.head_dim  # the query width: h, except where head_dim is set (Qwen3)
        rope_bytes = 2 * p if engine.fused_elementwise else 9 * p
        repeat = 2 * p * (model.kv_dim + q) if model.kv_dim < q and not engine.fused_elementwise else 0
        sharded += rope_bytes * (q + model.kv_dim) + repeat
    if model.qk_norm:
        sharded += norm * (model.num_heads * model.head_dim + model.kv_dim)  # q: as RoPE's
    if not materialized:
        return tokens * (hidden_per_rank + sharded / tp), 0.0
    score_bytes = (4 * p + 1) if dropout else 2 * p
    scores = micro_batch * model.num_heads * seq_len * seq_len / tp
    return tokens * (hidden_per_rank + sharded / tp), scores * score_bytes


def _elementwise_kernels(model: ModelSpec, engine: EngineModel | None = None) -> int:
    """Elementwise kernels one layer's forward launches (what small models pay in launch overhead).

    Megatron's fused kernels: two norms, the activation, two bias-dropout-adds, RoPE: ~8. Eager PyTorch's
    llama layer (this engine's, torchtitan's): each fp32 RMSNorm ~7 (cast, square, mean, add, rsqrt,
    scale, weight), RoPE 7 per q and k, the GQA repeats 2, SiLU and the product 2, the attention output
    re-layout 1, two residual adds: ~35; an eager GPT layer (one LayerNorm kernel each, GELU, adds): ~8.
    """
    if (engine is not None and engine.fused_elementwise) or model.arch != "llama":
        return 8
    return 35


def layer_compute_times(model: ModelSpec, hw: Hardware, *, micro_batch: int, seq_len: int, tp: int,
                        sequence_parallel: bool, precision: str, engine: EngineModel | None = None,
                        cp: int = 1, ring_size: int = 1) -> LayerComputeTimes:
    """Forward, backward and attention-core seconds of one layer (backward = input + weight gradients,
    elementwise backward moving twice the forward bytes) as `engine` runs it (default: this project's).

    The attention core: materialised, its GEMMs priced like the others plus the softmax's bytes over the
    full square (as Megatron computed it); flash, at the hardware's measured flash kernel efficiency over
    the causal half (`flash_attention_times_s`), or, where the profile has none (CPUs), from the profile's
    timed kernel (`measured_attention_times_s`), else as its GEMMs over the causal half with a backward of
    2.5 forwards.

    Context parallelism over `cp` ranks (`seq_len` is the whole sequence): the token-wise GEMMs and
    elementwise ops see seq_len / cp tokens; the balanced causal split gives every rank 1/cp of the
    attention work, which is the whole sequence's attention over 1/cp of the heads (exactly so for
    all-to-all, and for a ring on a fused kernel per block). This engine's ring (`ring_size` > 1) is
    priced by its own steps (`own_ring_times_s`) where the profile timed them or they are written out."""
    engine = engine or ENGINES["ours"]
    kernel = attention_kernel(model, engine, hw)
    gemm_dtype = "fp8" if precision == "fp8" else precision
    local = seq_len // cp
    gemms = layer_gemms(model, micro_batch=micro_batch, seq_len=local, tp=tp)
    dense_fwd = sum(gemm_time_s(hw, g, dtype=gemm_dtype) for g in gemms["dense"])
    # Megatron-based engines add each weight gradient into its fp32 main gradient (gemm_time_s).
    dense_bwd = sum(backward_gemms_time_s(hw, g, dtype=gemm_dtype, accumulate_fp32=engine.main_grads_fp32)
                    for g in gemms["dense"])
    attn_dtype = "bf16" if precision == "fp8" else precision
    own_ring = None
    if cp > 1 and ring_size > 1 and not engine.fused_ring_blocks:
        own_ring = own_ring_times_s(model, hw, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp,
                                    ring_size=ring_size, engine=engine)
    if own_ring is not None:
        (attn_fwd, attn_bwd), kernel = own_ring, "blocks"
    else:
        # A fused ring runs each step's kernels on half-chunks of seq_len / (2 cp) keys (Transformer Engine).
        attn_fwd, attn_bwd = _core_times_s(model, hw, kernel=kernel, micro_batch=micro_batch, seq_len=seq_len,
                                           tp=tp, dtype=attn_dtype,
                                           key_block=seq_len // (2 * cp) if ring_size > 1 else None)
        attn_fwd, attn_bwd = attn_fwd / cp, attn_bwd / cp
        if engine.unpadded_attention and kernel == "flash2" and hw.device_type == "cuda":
            fwd_bytes, bwd_bytes = unpadded_attention_bytes(model, micro_batch=micro_batch, seq_len=local, tp=tp,
                                                            precision=attn_dtype)
            attn_fwd += memory_time_s(hw, fwd_bytes, num_kernels=UNPAD_KERNELS_FWD)
            attn_bwd += memory_time_s(hw, bwd_bytes, num_kernels=UNPAD_KERNELS_BWD)
    hidden_bytes, materialized_bytes = _elementwise_bytes(model, micro_batch=micro_batch, seq_len=local, tp=tp,
                                                          sequence_parallel=sequence_parallel, precision=precision,
                                                          engine=engine, materialized=kernel == "materialized")
    # The materialised square is the whole sequence's, over this rank's 1/cp of the heads.
    score_bytes = materialized_bytes * cp
    if precision == "fp8":
        # Each fp8 GEMM input is quantised first (read bf16, write fp8: 3 bytes an element) and its amax
        # taken; the GEMMs' activations and, per micro-batch, the layer's weights.
        hidden_bytes += 3 * sum(g.m * g.k for g in gemms["dense"]) + 3 * sum(g.n * g.k for g in gemms["dense"])
    elem_fwd = memory_time_s(hw, hidden_bytes, num_kernels=_elementwise_kernels(model, engine))
    softmax_fwd = memory_time_s(hw, score_bytes, num_kernels=2)
    return LayerComputeTimes(
        forward_s=dense_fwd + attn_fwd + elem_fwd + softmax_fwd,
        backward_s=dense_bwd + attn_bwd + 2 * elem_fwd + 2 * softmax_fwd,
        attention_core_forward_s=attn_fwd + softmax_fwd)


def _core_times_s(model: ModelSpec, hw: Hardware, *, kernel: str, micro_batch: int, seq_len: int,
                  tp: int, dtype: str, key_block: int | None = None) -> tuple[float, float]:
    """(forward, backward) seconds of the attention core over `seq_len` for one TP rank's heads."""
    if kernel != "materialized" and hw.has_kernel(f"{kernel}_forward"):
        return flash_attention_times_s(hw, kernel=kernel, micro_batch=micro_batch, seq_len=seq_len,
                                       num_heads=model.num_heads // tp, head_dim=model.head_dim, key_block=key_block)
    if kernel != "materialized" and hw.attention_points:
        return measured_attention_times_s(hw, micro_batch=micro_batch, seq_len=seq_len,
                                          num_heads=model.num_heads // tp, head_dim=model.head_dim, dtype=dtype)
    attention = layer_gemms(model, micro_batch=micro_batch, seq_len=seq_len, tp=tp)["attention"]
    attn_fwd = sum(gemm_time_s(hw, g, dtype=dtype) for g in attention)
    attn_bwd = sum(gemm_time_s(hw, g2, dtype=dtype) for g in attention for g2 in g.backward())
    if kernel != "materialized":
        attn_fwd *= FUSED_CAUSAL_FRACTION
        attn_bwd = FUSED_BACKWARD_RATIO * attn_fwd
    return attn_fwd, attn_bwd


def _per_score_s(points: list, seq_len: int, which: str) -> float:
    """Seconds per causal score of one head at `seq_len`, linear in log(seq_len) between the measured
    points of one head width (held at the first point's value below it).

    Beyond the longest point, a fixed cost per score plus one per query row (the output's rescaling and
    write, a row's set-up), a + b / s, through the last two points, the fixed part at least 0. Causal SDPA
    over 4 heads of 32 on this project's host, 4 ranks at once as the profile times it: per score, 1024 ->
    2048 -> 4096 tokens, forward 7.69 -> 6.23 -> 5.37 ns, backward 21.3 -> 17.4 -> 13.9. Held at 2048's
    cost, 4096 was priced 16% / 25% over; a + b / s from 1024 and 2048 prices it 2% / 11% over."""
    points = sorted(points, key=lambda p: p.seq_len)
    costs = [getattr(p, which) / (p.num_heads * p.seq_len ** 2 / 2) for p in points]
    if seq_len <= points[0].seq_len:
        return costs[0]
    for (a, ca), (b, cb) in zip(zip(points, costs), zip(points[1:], costs[1:])):
        if seq_len <= b.seq_len:
            f = math.log(seq_len / a.seq_len) / math.log(b.seq_len / a.seq_len)
            return ca + f * (cb - ca)
    if len(points) == 1:
        return costs[0]
    (s1, c1), (s2, c2) = (points[-2].seq_len, costs[-2]), (points[-1].seq_len, costs[-1])
    fixed = max(0.0, c2 - (c1 - c2) * s1 / (s2 - s1))
    return fixed + (c2 - fixed) * s2 / seq_len


def cores_shared(hw: Hardware) -> float:
    """How many times longer a kernel timed alone in one process runs when the profile's processes share
    the host's cores: measured_processes / measured_cores where that is above 1, else 1."""
    if hw.measured_processes and hw.measured_cores:
        return max(1.0, hw.measured_processes / hw.measured_cores)
    return 1.0


def measured_attention_times_s(hw: Hardware, *, micro_batch: int, seq_len: int, num_heads: int, head_dim: int,
                               dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of the causal fused attention kernel from the profile's measured points
    (Hardware.attention_points; profilers/compute.measure_attention): per score and head, interpolated over
    log(seq_len) at each measured head width, then linear in the head width through the two (its GEMMs'
    share grows with it, the softmax's does not; extrapolated beyond them), floored at the narrower width's
    cost scaled by the width; times the causal scores b h s^2 / 2.

    Not times compute_time_scale: that factor says how far the GEMM sweep's prediction is from the real
    layer, and this is a measurement of the kernel itself. What a measurement in one process does not see
    is the processes of a run sharing the host's cores: with P processes on C < P cores (the profile's
    measured_processes and measured_cores) each runs at C / P of a core, so the kernel takes P / C times
    as long; with P <= C the profile timed it at the run's own thread count (profilers/profile.py). Points
    timed on every rank at once (`concurrent`, profiler version 9) hold that sharing already."""
    points = [p for p in hw.attention_points if p.dtype == dtype] or list(hw.attention_points)
    widths = sorted({p.head_dim for p in points})
    scale = 1.0 if points[0].concurrent else cores_shared(hw)
    scores = micro_batch * num_heads * seq_len ** 2 / 2
    out = []
    for which in ("forward_s", "backward_s"):
        by_width = [_per_score_s([p for p in points if p.head_dim == w], seq_len, which) for w in widths]
        if len(widths) == 1:
            per_score = by_width[0] * head_dim / widths[0]
        else:
            (w1, c1), (w2, c2) = (widths[0], by_width[0]), (widths[-1], by_width[-1])
            per_score = c1 + (c2 - c1) * (head_dim - w1) / (w2 - w1)
            per_score = max(per_score, c1 * min(1.0, head_dim / w1))
        out.append(max(scale * per_score * scores, hw.kernel_overhead_s))
    return out[0], out[1]


# This engine's ring blocks (runners/context_parallel.py) in fp32, bytes read and written per score, pass
# by pass as _partial and _partial_backward issue them (4-byte reads and writes; the GEMMs' own traffic is
# in their time). Forward: the scale (8), torch.logsumexp's max, shift, exp and sum (4 + 8 + 8 + 4), the
# shift by the log-sum-exp (8) and the exp (8): 48. Backward: the scale (8), shift (8) and exp (8) that
# rebuild the probabilities, dP - delta (8) and P x (dP - delta) (12): 44. Step 0's causal mask on top
# over its square: the boolean mask built (1 + 2) and masked_fill (8): 11. The kernels each step launches:
# forward the six passes, the mask's three and the online-softmax merge's eight (log-add-exp, two
# rescaling exps, two products, the sum, the slice write back, the lse write back); backward the five,
# the mask's three and the gradient bookkeeping's six (two scalings, zeroed dK/dV, two slice writes).
RING_SCORE_BYTES_FWD = 48
RING_SCORE_BYTES_BWD = 44
RING_MASK_BYTES = 11
# Of those passes, the exps (forward logsumexp's and the probabilities', backward the probabilities'):
# a CPU computes each exp (a vectorised polynomial), so it runs at the rate of a transcendental kernel,
# not of a copy (ring_exp_time_s).
RING_EXPS_FWD = 2
RING_EXPS_BWD = 1
RING_KERNELS_FWD = 17
RING_KERNELS_BWD = 14


def own_ring_times_s(model: ModelSpec, hw: Hardware, *, micro_batch: int, seq_len: int, tp: int, cp: int,
                     ring_size: int, engine: EngineModel | None = None) -> tuple[float, float] | None:
    """(forward, backward) seconds of this engine's ring steps on one rank: as the profile timed them at this
    head width and query / K-V head ratio (CPU profiles: Hardware.ring_points, `measured_ring_times_s`);
    else written out in fp32 whatever the training precision, the log-sum-exp merge needs it
    (`ring_blocks_times_s`, GPUs); else None: on CPUs the steps run torch's flash kernel and are priced like a
    fused engine's (compute.layer_compute_times)."""
    s_r = seq_len // ring_size
    heads = micro_batch * model.num_heads // (tp * cp // ring_size)
    measured = measured_ring_times_s(hw, side=s_r, heads=heads, head_dim=model.head_dim,
                                     gqa=model.num_heads // model.num_kv_heads, ring_size=ring_size)
    if measured is not None or not ring_blocks_written_out(engine or ENGINES["ours"], hw.device_type):
        return measured
    return ring_blocks_times_s(model, hw, micro_batch=micro_batch, seq_len=seq_len, tp=tp, cp=cp,
                               ring_size=ring_size, dtype="fp32")


def ring_blocks_times_s(model: ModelSpec, hw: Hardware, *, micro_batch: int, seq_len: int, tp: int, cp: int,
                        ring_size: int, dtype: str) -> tuple[float, float]:
    """(forward, backward) seconds of this engine's written-out ring attention on one rank (GPUs).

    Each ring rank holds s_r = seq_len / ring_size tokens (after the all-to-all part) for
    num_heads / (tp x cp / ring_size) heads; step 0 computes its full s_r x s_r square under the causal
    mask, each of the ring_size - 1 other steps half of one, so a rank computes (ring_size + 1) / 2 squares:
    two GEMMs forward (Q K^T, P V), five backward (the scores again, dV, dP, dQ, dK), each at the square's
    shape. The fp32 scores pass through memory on top (RING_SCORE_BYTES_*, forward and backward, and
    step 0's mask over its square, RING_MASK_BYTES). When the CPU path wrote its blocks out too, this price
    times the layer-fitted compute scale came out 1.34x the steps' measured time at a 1024-token side on
    this project's 2-core host."""
    s_r = seq_len // ring_size
    heads = micro_batch * model.num_heads // (tp * cp // ring_size)
    squares = (ring_size + 1) / 2
    d = model.head_dim
    qk, pv = Gemm(s_r, s_r, d, heads), Gemm(s_r, d, s_r, heads)
    forward = squares * (gemm_time_s(hw, qk, dtype=dtype) + gemm_time_s(hw, pv, dtype=dtype))
    backward = squares * (2 * gemm_time_s(hw, qk, dtype=dtype) + 3 * gemm_time_s(hw, pv, dtype=dtype))
    scores, masked = squares * heads * s_r * s_r, heads * s_r * s_r
    exp_bytes = 8  # an fp32 exp reads and writes 4 bytes an element
    forward += memory_time_s(hw, scores * (RING_SCORE_BYTES_FWD - RING_EXPS_FWD * exp_bytes) + masked * RING_MASK_BYTES,
                             num_kernels=RING_KERNELS_FWD * ring_size)
    backward += memory_time_s(hw, scores * (RING_SCORE_BYTES_BWD - RING_EXPS_BWD * exp_bytes) + masked * RING_MASK_BYTES,
                              num_kernels=RING_KERNELS_BWD * ring_size)
    return forward + ring_exp_time_s(hw, RING_EXPS_FWD * scores), backward + ring_exp_time_s(hw, RING_EXPS_BWD * scores)


def measured_ring_times_s(hw: Hardware, *, side: int, heads: int, head_dim: int, gqa: int,
                          ring_size: int) -> tuple[float, float] | None:
    """(forward, backward) seconds of a ring rank's steps from the profile's timed ones (RingBlockPoint):
    step 0's causal square and ring_size - 1 half blocks. Each kind's measured times form one curve over
    its scores (heads x the block's scores: the engine batches heads and micro-batch into each op, so a
    step's launches do not grow with them), read in log-log between the measured points: a small step's
    time is its ~20 launches, a large one's its scores, and a power law between two points follows both.
    Below the smallest point the time holds (launch-bound), beyond the largest it grows with the scores.
    Points timed on every rank at once (RingBlockPoint.concurrent) hold the processes sharing the host's
    cores and are read as they are; older ones, timed in one process, are multiplied by the cores the
    profile's processes share, like the attention points. None where no point has this head width and query / K-V
    head ratio."""
    points = sorted((p for p in hw.ring_points if p.head_dim == head_dim
                     and p.num_heads // max(1, p.num_kv_heads) == gqa), key=lambda p: p.side)
    if not points or side < 1:
        return None
    square, half = (lambda n: n * n), (lambda n: n * (n // 2))

    def seconds(which: str, scores_of) -> float:
        curve = [(p.num_heads * scores_of(p.side), getattr(p, which)) for p in points]
        work = heads * scores_of(side)
        if work <= curve[0][0]:
            return curve[0][1]
        for (wa, ta), (wb, tb) in zip(curve, curve[1:]):
            if work <= wb:
                return ta * (work / wa) ** (math.log(tb / ta) / math.log(wb / wa))
        return curve[-1][1] * work / curve[-1][0]

    out = []
    for kind in ("forward_s", "backward_s"):
        step0 = seconds(f"square_{kind}", square)
        others = seconds(f"half_{kind}", half) * (ring_size - 1) if side >= 2 else 0.0
        out.append((1.0 if points[0].concurrent else cores_shared(hw)) * (step0 + others))
    return out[0], out[1]


def ring_exp_time_s(hw: Hardware, num_elements: float) -> float:
    """Seconds of fp32 exps over `num_elements`: at the profile's measured SiLU rate (one exp an element,
    4 bytes read and 4 written: the one exp-bound kernel `planner profile` times), where the profile has
    it, else as a bandwidth-bound pass. On this project's 2-core host SiLU moves 3.3x fewer bytes a second
    than an add: the exps, not the bytes, set the pace of the ring's softmax.

    A measured kernel, like the attention points (measured_attention_times_s): scaled by the cores the
    profile's processes share (the rate was timed in one process), not by the fitted compute_time_scale,
    which says how far the GEMM sweep is from the real layer. With it (3.4 on 4 processes over 2 cores,
    where the share is 2), a 4096-token cp4 ring step was priced 17% over its measured time."""
    rate = hw.elementwise_bytes_per_s.get("silu")
    if not rate:
        return memory_time_s(hw, 8 * num_elements)
    return cores_shared(hw) * 8 * num_elements / rate


@dataclass(frozen=True)
class EndComputeTimes:
    """Seconds of the embedding (first chunk) and of final norm + head + loss (last chunk)."""

    embed_forward_s: float
    embed_backward_s: float
    head_forward_s: float
    head_backward_s: float


def end_compute_times(model: ModelSpec, hw: Hardware, *, micro_batch: int, seq_len: int, tp: int,
                      sequence_parallel: bool, precision: str) -> EndComputeTimes:
    """The embedding is a gather (bandwidth); its backward a scatter-add into the (vocab-sharded) table.
    The head is one GEMM T x h x V/tp (backward: two), plus the fp32 cross-entropy over the logits."""
    p, h = activation_bytes_per_element(precision), model.hidden_size
    tokens = micro_batch * seq_len
    embed_bytes = tokens * h * p * (3 if model.learned_positions else 2)
    head = Gemm(tokens, -(-model.vocab_size // tp), h)
    head_dtype = "bf16" if precision == "fp8" else precision  # the output layer stays in bf16 under fp8
    logits = tokens * model.vocab_size / tp
    norm_bytes = tokens * h * 2 * p / (tp if sequence_parallel else 1)
    return EndComputeTimes(
        embed_forward_s=memory_time_s(hw, embed_bytes),
        embed_backward_s=memory_time_s(hw, 2 * embed_bytes),
        head_forward_s=gemm_time_s(hw, head, dtype=head_dtype)
        + memory_time_s(hw, logits * LOSS_BYTES_PER_LOGIT_FWD + norm_bytes, num_kernels=4),
        head_backward_s=sum(gemm_time_s(hw, g, dtype=head_dtype) for g in head.backward())
        + memory_time_s(hw, logits * LOSS_BYTES_PER_LOGIT_BWD + 2 * norm_bytes, num_kernels=3))
