"""Device memory of a plan: model states, activations per micro-batch in flight, and buffers.

Model states (Rajbhandari et al., "ZeRO", SC20): mixed-precision Adam keeps 2 bytes of parameter, 2 of
gradient and 12 of optimizer state (fp32 master, m, v) per parameter, 16P in all; ZeRO-1/2/3 shard the
last 12, 14 and 16 bytes over N data-parallel ranks (4P + 12P/N, 2P + 14P/N, 16P/N). Here the three
degrees are independent (param_shard, grad_shard, optim_shard over the DP group), applied to the
parameters each device holds after TP (Megatron's split) and PP (its chunks' layers). fp32 jobs keep
4 + 4 + 8 (m, v; the parameter is its own master).

Activations (Korthikanti et al., "Reducing Activation Recomputation in Large Transformer Models",
2022): a GPT layer saves s b h (34 + 5 a s / h) bytes in 16-bit, which is the sum of the tensors the
backward pass needs (`_saved_tensors` lists them); TP divides what lives between the column- and
row-parallel GEMMs (10 + 24/t), sequence parallelism the rest (34/t); selective recomputation drops the
attention core (the 5 a s / h term); full recomputation keeps only the layer input. A flash kernel keeps
no s x s tensor, only its log-sum-exp. For llama the same method is applied to the tensors the layer saves
as the engine runs it (`_saved_tensors_llama`: eager fp32 RMSNorm, repeated GQA key/value heads and SwiGLU's
gate/up/product in this engine and torchtitan; Transformer Engine's fused kernels in Megatron-LM).
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.compute import activation_bytes_per_element, fused_attention
from specs.model import ModelSpec

GIB = 1024**3
# What a GPU process holds beside its tensors (gpu_runtime_bytes), where the profile has no measured
# framework_reserve_bytes:
# - the CUDA context with cuBLAS/cuDNN handles and workspaces: ~0.6 GiB on CUDA 12 with lazy loading;
# - NCCL's buffers, per communicator: NCCL_BUFFSIZE (4 MiB) for the Simple and LL128 protocols (+ a small LL
#   one) per peer (ring: 2) per channel (16-32 on NVLink systems): 2 x 24 x ~8 MiB, ~0.4 GiB each;
# - the caching allocator's fragmentation: blocks reserved but not allocated, ~10% of the memory that
#   comes and goes every step (activations, gathered weights, buckets, logits).
CUDA_CONTEXT_BYTES = 0.6 * GIB
NCCL_BYTES_PER_COMMUNICATOR = 0.4 * GIB
ALLOCATOR_FRAGMENTATION = 0.10
# On CPU the device memory is the process's anonymous memory (the resident set less its mapped library
# files, runners/train.peak_memory_bytes), which starts with the Python + torch + gloo runtime: 146 MiB
# (RssAnon) for an idle torch 2.13 process that imported the runner and joined a 2-rank gloo group, in a
# fresh venv and an older one alike (their resident sets: 284 and 225 MiB, the difference file pages).
CPU_FRAMEWORK_RESERVE_BYTES = 146 * 1024**2


def gpu_runtime_bytes(*, num_communicators: int, transient_bytes: float) -> float:
    """CUDA context + NCCL buffers of `num_communicators` process groups + allocator fragmentation over
    `transient_bytes` (see the constants above)."""
    return CUDA_CONTEXT_BYTES + NCCL_BYTES_PER_COMMUNICATOR * num_communicators + ALLOCATOR_FRAGMENTATION * transient_bytes


def state_bytes_per_param(precision: str, *, reduce_fp32: bool = False,
                          fp8_params: bool = False) -> tuple[int, int, int]:
    """(parameter, gradient, optimizer) bytes per parameter for Adam; `reduce_fp32` (the plan's knob) keeps
    mixed-precision gradients in fp32 (4 bytes, as torch FSDP's reduce_dtype=float32); fp8 keeps bf16
    weights plus their fp8 copy, or, with `fp8_params` (Megatron's --fp8-param-gather: the weights live only
    as Transformer Engine Float8Tensors, a 1-byte parameter buffer in megatron/core/distributed/
    param_and_grad_buffer.py, group_params_for_buffers), the fp8 weight and its fp8 transpose, which Hopper's
    fp8 GEMMs need for the backward (megatron/core/fp8_utils.py, post_all_gather_processing): 2 bytes; the
    fp32 master stays in the optimizer's 12."""
    if precision == "fp32":
        return (4, 4, 8)
    weight = (2 if fp8_params else 3) if precision == "fp8" else 2
    return (weight, 4 if reduce_fp32 else 2, 12)


@dataclass(frozen=True)
class StateBytes:
    weights_bytes: float
    grads_bytes: float
    optimizer_bytes: float

    @property
    def total_bytes(self) -> float:
        return self.weights_bytes + self.grads_bytes + self.optimizer_bytes


def model_state_bytes(num_params: float, *, param_shard: int, grad_shard: int, optim_shard: int,
                      precision: str, reduce_fp32: bool = False, fp8_params: bool = False) -> StateBytes:
    """Bytes of weights, gradients and optimizer states of `num_params` parameters under the sharding."""
    p, g, o = state_bytes_per_param(precision, reduce_fp32=reduce_fp32, fp8_params=fp8_params)
    return StateBytes(num_params * p / param_shard, num_params * g / grad_shard, num_params * o / optim_shard)


def layer_params_per_device(model: ModelSpec, *, tp: int) -> float:
    """Parameters of one layer on one TP rank: column- and row-parallel weights and column biases are
    split; norms and row-parallel biases are replicated (Megatron)."""
    h, f, kv = model.hidden_size, model.ffn_hidden_size, model.kv_dim
    split = 2 * h * h + 2 * h * kv + (3 if model.gated_mlp else 2) * h * f
    replicated = 2 * model.norm_params()
    if model.has_bias:
        split += h + 2 * kv + f
        replicated += 2 * h
    return split / tp + replicated


def end_params_per_device(model: ModelSpec, *, tp: int, pp: int) -> tuple[float, float]:
    """Extra parameters of the first chunk (embedding) and the last chunk (final norm, head) per TP rank.

    Vocabulary-parallel embedding and head split V over TP; tied embeddings need a second copy on the last
    stage when the first and last chunk live on different ranks (pp > 1), as in Megatron.
    """
    h, vocab_rows = model.hidden_size, -(-model.vocab_size // tp)
    first = vocab_rows * h + (model.max_seq_len * h if model.learned_positions else 0)
    last = model.norm_params() + (vocab_rows * h if (not model.tied_embeddings or pp > 1) else 0)
    return float(first), float(last)


def _saved_tensors(model: ModelSpec, *, micro_batch: int, seq_len: int, precision: str,
                   fused: bool | None = None, fused_elementwise: bool = False,
                   dropout: bool = True) -> dict[str, tuple[float, str]]:
    """Bytes each saved tensor of one layer takes (all TP ranks together), with how it is split:
    'replicated' (lives outside the TP region: split only by sequence parallelism), 'tp' (split by TP),
    'core' (attention core, split by TP, dropped by selective recomputation). `fused`: a flash kernel
    (default: as this engine runs the arch); `fused_elementwise`: Megatron-style fused norm, activation and
    attention kernels (engines.EngineModel); `dropout`: GPT's dropouts run (and keep their masks)."""
    fused = fused if fused is not None else fused_attention(model)
    if fused and model.arch == "llama":
        return _saved_tensors_llama(model, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                                    fused_elementwise=fused_elementwise)
    p, h, f, kv = activation_bytes_per_element(precision), model.hidden_size, model.ffn_hidden_size, model.kv_dim
    sbh = seq_len * micro_batch * h
    tokens = seq_len * micro_batch
    scores = model.num_heads * seq_len * seq_len * micro_batch
    mask = 1 if dropout else 0
    # Megatron GPT (Korthikanti et al. Section 4.1): LayerNorm inputs, GEMM inputs, the softmax output,
    # the attention dropout's mask and output, GELU's input, and the two residual dropout masks. A flash
    # kernel keeps no s x s tensor: only its fp32 log-sum-exp per head and token (its output is the output
    # projection's input, already counted).
    core = ({"attention_lse": (4 * model.num_heads * tokens, "core")} if fused else {
        "softmax_output": (p * scores, "core"),
        "attention_dropout_mask": (mask * scores, "core"),
        "attention_dropout_output": (mask * p * scores, "core")})
    return {
        "norm1_input": (p * sbh, "replicated"),
        "qkv_input": (p * sbh, "replicated"),
        "query_key": (p * tokens * (h + kv), "tp"),
        "value": (p * tokens * kv, "tp"),
        **core,
        "out_proj_input": (p * sbh, "tp"),
        "attn_residual_dropout_mask": (mask * sbh, "replicated"),
        "norm2_input": (p * sbh, "replicated"),
        "mlp_input": (p * sbh, "replicated"),
        "mlp_intermediates": ((4 if model.gated_mlp else 2) * p * tokens * f, "tp"),
        "mlp_residual_dropout_mask": (mask * sbh, "replicated"),
    }


def _saved_tensors_llama(model: ModelSpec, *, micro_batch: int, seq_len: int, precision: str,
                         fused_elementwise: bool) -> dict[str, tuple[float, str]]:
    """The llama layer with a flash attention kernel, tensor by tensor.

    Eager (this engine, runners/transformer.py; torchtitan): RMSNorm computes in fp32 (keeps the fp32
    input and the normalised value before the weight); scaled_dot_product_attention keeps q, the
    key/value heads repeated to every query head (GQA), its output and the fp32 log-sum-exp per head and
    token, and no s x s tensor; the output projection keeps its (re-laid-out) input; SwiGLU keeps gate,
    silu(gate), up and their product. Fused (Megatron-LM with Transformer Engine): the norm keeps its
    16-bit input and an fp32 inverse RMS per token, the fused attention reads the KV heads as they are
    and its output is the projection's input (the log-sum-exp beside it), and the fused SwiGLU keeps its
    input (gate and up) and its product; in fp8 every linear keeps its input as the fp8 cast it multiplied. Selective recomputation checkpoints the attention core, keeping
    only its inputs q, k, v (k and v at the KV width). No dropout.
    """
    p, h, f, kv = activation_bytes_per_element(precision), model.hidden_size, model.ffn_hidden_size, model.kv_dim
    tokens = seq_len * micro_batch
    sbh = tokens * h
    lse = 4 * model.num_heads * tokens
    # Transformer Engine's fp8 linears keep their input for the weight gradient as the fp8 cast (1 byte);
    # the projection after attention then keeps that cast beside the kernel's 16-bit output.
    gemm_in = 1 if fused_elementwise and precision == "fp8" else p
    proj_in = p * sbh + (sbh if gemm_in < p else 0)
    if fused_elementwise:
        norm, core, mlp = p * sbh + 4 * tokens, lse, (2 * p + gemm_in) * tokens * f
    else:
        # Repeated key/value heads beyond the KV width, the attention output, the log-sum-exp.
        norm, core, mlp = (4 + p) * sbh, p * tokens * (2 * (h - kv) + h) + lse, 4 * p * tokens * f
    return {
        "norm1": (norm, "replicated"),
        "qkv_input": (gemm_in * sbh, "replicated"),
        "query_key_value": (p * tokens * (h + 2 * kv), "tp"),
        "out_proj_input": (proj_in, "tp"),
        "attention_core": (core, "core"),
        "norm2": (norm, "replicated"),
        "mlp_input": (gemm_in * sbh, "replicated"),
        "mlp_intermediates": (mlp, "tp"),
    }


def layer_activation_bytes(model: ModelSpec, *, policy: str, micro_batch: int, seq_len: int, tp: int,
                           sequence_parallel: bool, precision: str, fused: bool | None = None,
                           fused_elementwise: bool = False, dropout: bool = True) -> float:
    """Bytes one layer keeps per micro-batch in flight on one device under recomputation `policy`;
    `fused`, `fused_elementwise`, `dropout`: how the engine runs the layer (`_saved_tensors`)."""
    p = activation_bytes_per_element(precision)
    if policy == "full":
        # Only the layer input (the residual stream), itself sequence-sharded under SP.
        return p * seq_len * micro_batch * model.hidden_size / (tp if sequence_parallel else 1)
    total = 0.0
    for size, split in _saved_tensors(model, micro_batch=micro_batch, seq_len=seq_len, precision=precision,
                                      fused=fused, fused_elementwise=fused_elementwise, dropout=dropout).values():
        if split == "core" and policy == "selective":
            continue
        total += size / tp if (split != "replicated" or sequence_parallel) else size
    return total


def end_activation_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int, sequence_parallel: bool,
                         precision: str) -> tuple[float, float]:
    """Activations the first chunk (embedding dropout mask for GPT) and the last chunk (final-norm
    input, fp32 with the normalised value for llama's RMSNorm, and the gathered head input) keep per
    micro-batch."""
    p, sbh = activation_bytes_per_element(precision), seq_len * micro_batch * model.hidden_size
    sp = tp if sequence_parallel else 1
    if model.arch == "gpt2":
        return sbh / sp, p * sbh / sp + p * sbh
    return 0.0, (4 + p) * sbh / sp + p * sbh


def logits_bytes(model: ModelSpec, *, micro_batch: int, seq_len: int, tp: int) -> float:
    """fp32 logits of one micro-batch on one TP rank (vocabulary-parallel head), live during the loss."""
    return 4.0 * micro_batch * seq_len * -(-model.vocab_size // tp)


def in_flight_profiles(actions) -> tuple[tuple[tuple[int, int], ...], ...]:
    """The distinct (chunk, micro-batches in flight) combinations a rank passes through right after each
    forward (where its memory peaks), so that peaks for any per-chunk bytes are a max over a few sums."""
    in_flight: dict[int, int] = {}
    seen = set()
    for action in actions:
        c = action.chunk
        in_flight[c] = in_flight.get(c, 0) + (1 if action.kind == "F" else -1)
        if action.kind == "F":
            seen.add(tuple(sorted((k, n) for k, n in in_flight.items() if n > 0)))
    # Drop profiles another one dominates (no more of any chunk): they can never be the peak.
    profiles = sorted(seen, key=lambda p: -sum(n for _, n in p))
    kept: list[tuple[tuple[int, int], ...]] = []
    for p in profiles:
        counts = dict(p)
        if not any(all(dict(q).get(c, 0) >= n for c, n in counts.items()) for q in kept):
            kept.append(p)
    return tuple(kept)


def peak_from_profiles(profiles, *, chunk_bytes: dict[int, float], chunk_cache_bytes: dict[int, float]) -> float:
    """Largest activations in flight plus MAZ3 caches over the profiles of `in_flight_profiles`."""
    return max((sum(n * chunk_bytes[c] + chunk_cache_bytes[c] for c, n in p) for p in profiles), default=0.0)


def peak_live_bytes(actions, *, chunk_bytes: dict[int, float], chunk_cache_bytes: dict[int, float]) -> float:
    """Largest sum over a rank's timeline of activations in flight plus MAZ3 caches held.

    `chunk_bytes[c]` is what one micro-batch's forward of chunk c leaves until its backward;
    `chunk_cache_bytes[c]` is held while any micro-batch of chunk c is in flight (the cached gathered
    parameters serve every micro-batch in flight: one copy per chunk).
    """
    return peak_from_profiles(in_flight_profiles(actions), chunk_bytes=chunk_bytes,
                              chunk_cache_bytes=chunk_cache_bytes)
