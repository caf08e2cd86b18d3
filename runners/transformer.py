"""The trained transformer, built as pipeline chunks of units for the engine.

A rank's model is a list of chunks (one per local pipeline stage); a chunk runs its `units` in order:
the embedding (chunk 0), transformer blocks, and the head with the loss (last chunk). A unit is the
granularity of data-parallel flat-parameter sharding. Units hold only this rank's tensor-parallel shard
of each weight, but every weight is drawn in full from a generator seeded by (seed, parameter name) and
then sliced, so every plan starts from exactly the same model as one process.

Activations are [seq, batch, hidden] (sequence-sharded under sequence parallelism; this CP rank's two
chunks under context parallelism, runners/context_parallel.py). The head returns the micro-batch's summed
cross entropy times `loss_scale` (1 / tokens in the global batch), so gradients summed over micro-batches
and data-parallel (and context-parallel) ranks are those of the global mean loss.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from specs.model import ModelSpec
from runners.context_parallel import CPContext, context_attention
from runners.expert_parallel import EPContext
from runners.moe import MoE
from runners.param_init import INIT_STD, ParamInit, _param, deferred_init  # noqa: F401 (re-exported)
from runners.tensor_parallel import (TPContext, cross_entropy_sum, enter_tp_region, exit_tp_region,
                                     sequence_parallel_param, tp_shared_param)


def canonical_names(chunks: list[nn.Module], chunk_ids: list[int]) -> dict[str, tuple[str, int | None]]:
    """'{global chunk index}.{module parameter name}' -> (canonical name, TP split dim), taken before
    any engine wraps the modules."""
    return {f"{c}.{name}": (p.canonical_name, p.tp_split_dim)
            for c, chunk in zip(chunk_ids, chunks) for name, p in chunk.named_parameters()}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim, computed in fp32 and cast back before the weight (as HF Llama / Qwen)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


class Norm(nn.Module):
    """RMSNorm (llama) or LayerNorm (gpt2); replicated over TP, gradients summed under sequence parallel."""

    def __init__(self, spec: ModelSpec, *, name: str, tp: TPContext) -> None:
        super().__init__()
        self.tp, self.rms, self.eps = tp, spec.arch == "llama", spec.norm_eps
        self.weight = _param((spec.hidden_size,), name=f"{name}.weight", seed=0, std=0, tp=tp, fill=1.0)
        self.bias = None if self.rms else _param((spec.hidden_size,), name=f"{name}.bias", seed=0, std=0, tp=tp, fill=0.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = sequence_parallel_param(self.weight, self.tp)
        if self.rms:
            return rms_norm(x, w, self.eps)
        return F.layer_norm(x, (x.shape[-1],), w, sequence_parallel_param(self.bias, self.tp), self.eps)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding on x [s, b, heads, d] (half-split convention, as HF Llama)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """The rotary frequencies of `spec`'s head_dim: base^(-2i/d), with Llama 3.1's scaling where the model
    has it (rope_scaling "llama3", as transformers' _compute_llama3_parameters: wavelengths above
    original / low_freq_factor slowed by the factor, below original / high_freq_factor kept, a linear mix
    in the smooth factor between)."""
    d = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    if spec.rope_scaling != "llama3":
        return inv_freq
    factor, low, high = spec.rope_scaling_factor, spec.rope_low_freq_factor, spec.rope_high_freq_factor
    original = spec.rope_original_max_positions
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > original / low, inv_freq / factor, inv_freq)
    smooth = (original / wavelen - low) / (high - low)
    mixed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= original / high) & (wavelen <= original / low)
    return torch.where(medium, mixed, scaled)


class Rope(nn.Module):
    """RoPE tables for the positions a rank holds (0..s-1, or its CP chunks), computed on use and kept for
    the last shape: a table for the model's whole context (131072 positions) would cost more than the
    layer's activations."""

    def __init__(self, spec: ModelSpec, *, cp: CPContext) -> None:
        super().__init__()
        self.cp = cp
        self.register_buffer("inv_freq", rope_inv_freq(spec), persistent=False)
        self._cached: tuple | None = None

    def tables(self, num_local: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin) [s, 1, 1, d/2] of this rank's `num_local` tokens."""
        key = (num_local, dtype, self.inv_freq.device)
        if self._cached is None or self._cached[0] != key:
            device = self.inv_freq.device
            positions = (self.cp.positions(num_local, device) if self.cp.size > 1
                         else torch.arange(num_local, device=device))
            angles = torch.outer(positions.to(torch.float32), self.inv_freq)[:, None, None, :]
            self._cached = (key, (angles.cos().to(dtype), angles.sin().to(dtype)))
        return self._cached[1]


class HeadNorm(nn.Module):
    """Qwen3's RMSNorm of every query (or key) head over its head_dim, one weight shared by the heads. Each
    TP rank holds other heads, so the weight's gradient is summed over TP whether or not sequence
    parallelism is on (`tp_shared_param`)."""

    def __init__(self, spec: ModelSpec, *, name: str, tp: TPContext) -> None:
        super().__init__()
        self.tp, self.eps = tp, spec.norm_eps
        self.weight = _param((spec.head_dim,), name=f"{name}.weight", seed=0, std=0, tp=tp, fill=1.0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, tp_shared_param(self.weight, self.tp), self.eps)


class Attention(nn.Module):
    def __init__(self, spec: ModelSpec, *, name: str, seed: int, tp: TPContext, selective: bool,
                 cp: CPContext | None = None) -> None:
        super().__init__()
        # q: the query width, heads x head_dim (h but where a config sets head_dim, as Qwen3 does).
        h, kv, q = spec.hidden_size, spec.kv_dim, spec.num_heads * spec.head_dim
        out_std = INIT_STD / math.sqrt(2 * spec.num_layers)
        self.tp, self.spec, self.selective = tp, spec, selective
        self.cp = cp or CPContext()
        self.local_heads, self.local_kv_heads = spec.num_heads // tp.size, spec.num_kv_heads // tp.size
        self.wq = _param((q, h), name=f"{name}.wq", seed=seed, std=INIT_STD, tp=tp, split_dim=0)
        self.wk = _param((kv, h), name=f"{name}.wk", seed=seed, std=INIT_STD, tp=tp, split_dim=0)
        self.wv = _param((kv, h), name=f"{name}.wv", seed=seed, std=INIT_STD, tp=tp, split_dim=0)
        self.wo = _param((h, q), name=f"{name}.wo", seed=seed, std=out_std, tp=tp, split_dim=1)
        self.bq = self.bk = self.bv = self.bo = None
        if spec.has_bias or spec.qkv_bias:  # gpt2's biases, or Qwen2's on q, k and v only
            self.bq = _param((q,), name=f"{name}.bq", seed=seed, std=0, tp=tp, split_dim=0, fill=0.0)
            self.bk = _param((kv,), name=f"{name}.bk", seed=seed, std=0, tp=tp, split_dim=0, fill=0.0)
            self.bv = _param((kv,), name=f"{name}.bv", seed=seed, std=0, tp=tp, split_dim=0, fill=0.0)
        if spec.has_bias:
            self.bo = _param((h,), name=f"{name}.bo", seed=seed, std=0, tp=tp, fill=0.0)
        self.q_norm = HeadNorm(spec, name=f"{name}.q_norm", tp=tp) if spec.qk_norm else None
        self.k_norm = HeadNorm(spec, name=f"{name}.k_norm", tp=tp) if spec.qk_norm else None

    def _core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        if self.cp.size > 1:
            return context_attention(q, k, v, self.cp).flatten(2)
        # [s, b, heads, d] -> [b, heads, s, d]; GQA repeats each KV head over its query heads.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        rep = self.local_heads // self.local_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).flatten(2)

    def forward(self, x: torch.Tensor, rope: Rope | None) -> torch.Tensor:
        x = enter_tp_region(x, self.tp)
        s, b, d = x.shape[0], x.shape[1], self.spec.head_dim
        q = F.linear(x, self.wq, self.bq).view(s, b, self.local_heads, d)
        k = F.linear(x, self.wk, self.bk).view(s, b, self.local_kv_heads, d)
        v = F.linear(x, self.wv, self.bv).view(s, b, self.local_kv_heads, d)
        if self.q_norm is not None:  # Qwen3: each head normalised before RoPE
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope.tables(s, x.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        # Selective recomputation (Korthikanti et al. 2022): drop the attention core's activations
        # (scores, softmax) and recompute them in backward; keep the GEMM inputs.
        ctx = checkpoint(self._core, q, k, v, use_reentrant=False) if self.selective else self._core(q, k, v)
        out = exit_tp_region(F.linear(ctx, self.wo), self.tp)
        return out + sequence_parallel_param(self.bo, self.tp) if self.bo is not None else out


class MLP(nn.Module):
    """The dense MLP (width `ffn`, default the model's ffn_hidden_size; an MoE layer's shared expert too)."""

    def __init__(self, spec: ModelSpec, *, name: str, seed: int, tp: TPContext, ffn: int | None = None) -> None:
        super().__init__()
        h, f = spec.hidden_size, ffn or spec.ffn_hidden_size
        out_std = INIT_STD / math.sqrt(2 * spec.num_layers)
        self.tp, self.gated, self.gelu = tp, spec.gated_mlp, spec.gelu_approximation
        self.w_in = _param((f, h), name=f"{name}.w_in", seed=seed, std=INIT_STD, tp=tp, split_dim=0)
        self.w_gate = _param((f, h), name=f"{name}.w_gate", seed=seed, std=INIT_STD, tp=tp, split_dim=0) if self.gated else None
        self.w_out = _param((h, f), name=f"{name}.w_out", seed=seed, std=out_std, tp=tp, split_dim=1)
        if spec.has_bias:
            self.b_in = _param((f,), name=f"{name}.b_in", seed=seed, std=0, tp=tp, split_dim=0, fill=0.0)
            self.b_out = _param((h,), name=f"{name}.b_out", seed=seed, std=0, tp=tp, fill=0.0)
        else:
            self.b_in = self.b_out = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = enter_tp_region(x, self.tp)
        if self.gated:
            hidden = F.silu(F.linear(x, self.w_gate)) * F.linear(x, self.w_in)
        else:
            hidden = F.gelu(F.linear(x, self.w_in, self.b_in), approximate=self.gelu)
        out = exit_tp_region(F.linear(hidden, self.w_out), self.tp)
        return out + sequence_parallel_param(self.b_out, self.tp) if self.b_out is not None else out


class Block(nn.Module):
    """One transformer layer (pre-norm), with its recomputation policy: none, selective or full."""

    def __init__(self, spec: ModelSpec, *, index: int, seed: int, tp: TPContext, recompute: str,
                 cp: CPContext | None = None, ep: EPContext | None = None, aux_scale: float = 0.0) -> None:
        super().__init__()
        name = f"layers.{index}"
        cp = cp or CPContext()
        self.layer_index, self.recompute = index, recompute  # layer_index: the plan's per-layer knobs (MAZ3 tier)
        self.norm1 = Norm(spec, name=f"{name}.norm1", tp=tp)
        self.attn = Attention(spec, name=f"{name}.attn", seed=seed, tp=tp, selective=recompute == "selective", cp=cp)
        self.norm2 = Norm(spec, name=f"{name}.norm2", tp=tp)
        if spec.is_moe_layer(index):
            shared = (MLP(spec, name=f"{name}.mlp.shared", seed=seed, tp=tp, ffn=spec.shared_expert_ffn_hidden_size)
                      if spec.shared_expert_ffn_hidden_size else None)
            self.mlp = MoE(spec, name=f"{name}.mlp", seed=seed, tp=tp, ep=ep or EPContext.single(), cp=cp,
                           aux_scale=aux_scale, shared=shared)
        else:
            self.mlp = MLP(spec, name=f"{name}.mlp", seed=seed, tp=tp)
        self.rope = Rope(spec, cp=cp) if spec.arch == "llama" else None

    def _forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), self.rope)
        return x + self.mlp(self.norm2(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.recompute == "full" and torch.is_grad_enabled():
            # Full recomputation keeps only the layer's input; the unit's parameters are gathered by the
            # engine's backward pre-hook before this recompute runs.
            return checkpoint(self._forward, x, use_reentrant=False)
        return self._forward(x)


class Embedding(nn.Module):
    """Vocab-parallel token embedding: tokens [b, s] -> [s, b, h], sequence-sharded under SP.

    It holds only the token weight, so that a tied output projection (LMHead) has the same flat layout
    and the two copies' gradient shards line up element for element."""

    def __init__(self, spec: ModelSpec, *, seed: int, tp: TPContext) -> None:
        super().__init__()
        self.tp = tp
        self.weight = _param((spec.vocab_size, spec.hidden_size), name="embed.weight", seed=seed, std=INIT_STD,
                             tp=tp, split_dim=0)
        self.vocab_start = tp.rank * (spec.vocab_size // tp.size)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        ids = tokens.t()  # [s, b]
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.vocab_start
        outside = (local < 0) | (local >= self.weight.shape[0])
        x = F.embedding(local.clamp(0, self.weight.shape[0] - 1), self.weight) * (~outside).unsqueeze(-1)
        return exit_tp_region(x, self.tp)


class Positions(nn.Module):
    """Learned position embedding (gpt2), replicated over TP; this rank's sequence slice under SP."""

    def __init__(self, spec: ModelSpec, *, seed: int, tp: TPContext, cp: CPContext | None = None) -> None:
        super().__init__()
        self.tp, self.cp = tp, cp or CPContext()
        self.weight = _param((spec.max_seq_len, spec.hidden_size), name="embed.pos", seed=seed, std=INIT_STD, tp=tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s_local = x.shape[0]
        start = self.tp.rank * s_local if self.tp.sequence_parallel else 0
        weight = sequence_parallel_param(self.weight, self.tp)
        if self.cp.size > 1:  # this CP rank's chunks, then this TP rank's slice of them under SP
            tp_size = self.tp.size if self.tp.sequence_parallel else 1
            rows = self.cp.positions(s_local * tp_size, x.device)[start:start + s_local]
            return x + weight[rows].unsqueeze(1)
        return x + weight[start:start + s_local].unsqueeze(1)


class LMHead(nn.Module):
    """Vocab-parallel output projection and the summed cross entropy times loss_scale.

    For tied models it starts from the embedding's draw (same canonical name); the trainer keeps the
    two copies' gradients summed, so they stay equal, as Megatron does across pipeline stages."""

    def __init__(self, spec: ModelSpec, *, seed: int, tp: TPContext, loss_scale: float) -> None:
        super().__init__()
        self.tp, self.loss_scale = tp, loss_scale
        name = "embed.weight" if spec.tied_embeddings else "lm_head.weight"
        self.weight = _param((spec.vocab_size, spec.hidden_size), name=name, seed=seed, std=INIT_STD, tp=tp, split_dim=0)
        self.vocab_start = tp.rank * (spec.vocab_size // tp.size)

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = F.linear(enter_tp_region(x, self.tp), self.weight)  # [s, b, V / tp]
        return cross_entropy_sum(logits, targets.t(), vocab_start=self.vocab_start, tp=self.tp) * self.loss_scale


class Chunk(nn.Module):
    """A contiguous run of units: forward(x, targets) returns the hidden state, or the loss for the last chunk."""

    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for unit in self.units:
            x = unit(x, targets) if isinstance(unit, LMHead) else unit(x)
        return x


def build_chunk(spec: ModelSpec, *, layers: range, first: bool, last: bool, seed: int, tp: TPContext,
                recompute: list[str] | str, loss_scale: float, share_tied: bool = False,
                cp: CPContext | None = None, ep: EPContext | None = None, aux_scale: float = 0.0) -> Chunk:
    """One pipeline chunk: the embedding if `first`, blocks `layers`, the final norm and head if `last`.

    `recompute` is one policy or a list indexed by global layer number. `share_tied` makes a tied
    head use the embedding's very Parameter (the one-process reference); engines keep two copies. `cp`:
    this rank's context-parallel group (default: none). `ep`: its expert-parallel group (MoE layers);
    `aux_scale`: the load-balancing loss's weight per sequence, 1 / sequences in the global batch."""
    units: list[nn.Module] = []
    if first:
        units.append(Embedding(spec, seed=seed, tp=tp))
        if spec.learned_positions:
            units.append(Positions(spec, seed=seed, tp=tp, cp=cp))
    for i in layers:
        policy = recompute if isinstance(recompute, str) else recompute[i]
        units.append(Block(spec, index=i, seed=seed, tp=tp, recompute=policy, cp=cp, ep=ep, aux_scale=aux_scale))
    if last:
        units.append(Norm(spec, name="final_norm", tp=tp))
        head = LMHead(spec, seed=seed, tp=tp, loss_scale=loss_scale)
        if share_tied and first and spec.tied_embeddings:
            head.weight = units[0].weight
        units.append(head)
    return Chunk(units)


def check_tp_shapes(spec: ModelSpec, tp_size: int) -> None:
    """Raise ValueError if this model cannot be split over `tp_size` ranks by the runner."""
    for name, value in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads),
                        ("ffn_hidden_size", spec.ffn_hidden_size), ("vocab_size", spec.vocab_size)):
        if value % tp_size:
            raise ValueError(f"tp {tp_size} does not divide the model's {name} {value}")


def check_cp_heads(spec: ModelSpec, *, tp_size: int, a2a_size: int) -> None:
    """Raise ValueError if the CP all-to-all cannot split this rank's heads and K/V heads (whole GQA groups)."""
    for name, value in (("num_heads", spec.num_heads), ("num_kv_heads", spec.num_kv_heads)):
        if (value // tp_size) % a2a_size:
            raise ValueError(f"context-parallel all-to-all over {a2a_size} ranks does not divide the model's "
                             f"{value // tp_size} {name} per TP rank; use cp_kind ring")


def check_model_runnable(spec: ModelSpec, plan) -> None:
    """Raise ValueError for the models (MoE ones, RoPE variants) and plans this engine does not run (the cost
    model prices them)."""
    if spec.rope_scaling not in ("none", "llama3"):
        raise ValueError(f"the engine does not run {spec.rope_scaling} rope scaling of model {spec.name} (the cost "
                         f"model prices it; llama3 scaling or none run)")
    if spec.is_moe:
        # TP without SP: every TP rank would route and run the same tokens, each expert's gradient summed
        # tp times over expert-DP (Megatron-Core refuses MoE with TP and no sequence parallelism too).
        unsupported = [(spec.uses_mla, "multi-head latent attention"),
                       (plan.tp > 1 and not plan.sequence_parallel, "tp > 1 without sequence_parallel"),
                       (spec.capacity_factor > 0 and plan.tp > 1, "capacity_factor with tp > 1"),
                       (spec.capacity_factor > 0 and plan.cp > 1, "capacity_factor with cp > 1")]
        for bad, what in unsupported:
            if bad:
                raise ValueError(f"the engine does not run {what} of model {spec.name} (the cost model prices it)")
    elif plan.ep > 1 or plan.etp > 1:
        raise ValueError(f"ep and etp need a mixture-of-experts model; {spec.name} is dense")


def compute_dtype(precision: str) -> torch.dtype:
    """The torch dtype of a job's compute precision."""
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def build_local_chunks(cfg, *, pp_rank: int, tp: TPContext, device: torch.device, deferred: bool = False,
                       share_tied: bool = False, cp: CPContext | None = None,
                       ep: EPContext | None = None) -> tuple[list[int], list[Chunk]]:
    """The chunks pipeline rank `pp_rank` holds under a RunConfig's plan, in local order (chunk c = j * pp +
    pp_rank), with the loss scaled to the global batch's mean. `deferred`: parameters without storage
    (`deferred_init`; the engine draws its shards), buffers on `device`. `share_tied`: a tied head whose
    chunk also holds the embedding uses its very Parameter (build_chunk)."""
    plan, spec = cfg.plan, cfg.model
    check_tp_shapes(spec, plan.tp)
    check_model_runnable(spec, plan)
    if cp is not None and cp.a2a_size > 1:
        check_cp_heads(spec, tp_size=plan.tp, a2a_size=cp.a2a_size)
    ranges = plan.chunk_layer_ranges(spec.num_layers)
    recompute = list(plan.recompute_layers) if plan.recompute_layers is not None else plan.recompute
    loss_scale = 1.0 / (cfg.job.global_batch * cfg.job.seq_len)
    chunk_ids = [j * plan.pp + pp_rank for j in range(plan.virtual_stages)]
    chunks = []
    for c in chunk_ids:
        with deferred_init() if deferred else contextlib.nullcontext():
            chunk = build_chunk(spec, layers=ranges[c], first=c == 0, last=c == plan.num_chunks - 1, seed=cfg.seed,
                                tp=tp, recompute=recompute, loss_scale=loss_scale, share_tied=share_tied, cp=cp,
                                ep=ep, aux_scale=1.0 / cfg.job.global_batch)
        chunks.append(_buffers_to(chunk, device) if deferred else chunk.to(device))
    return chunk_ids, chunks


def _buffers_to(module: nn.Module, device: torch.device) -> nn.Module:
    """Move only the buffers (the parameters have no storage yet)."""
    for m in module.modules():
        for key, buf in m._buffers.items():
            if buf is not None:
                m._buffers[key] = buf.to(device)
    return module
