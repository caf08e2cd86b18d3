"""Tensor parallelism for `--engine torch` on DTensor: torch's own parallel styles over a torch-native twin of
our units, so that every TP collective is torch's, not runners/tensor_parallel.py's.

    planner run --engine torch --tp 2 [--sequence-parallel] ...   (runners/torch_engine.py calls parallelize_chunk)

Why a twin rather than DTensor parameters inside our own units: ColwiseParallel / RowwiseParallel shard an
nn.Linear or nn.Embedding and convert activations at that module's boundary, which is where Megatron's f
and g sit. Our Attention, MLP, Embedding and LMHead call F.linear on raw parameters inside one forward,
so a style on the unit would run the whole attention core (head reshapes, rope with plain buffers, GQA's
repeat_interleave, SDPA) on DTensors, where sharding rules are partial (no SDPA rule on CPU); torchtitan
keeps that core on local tensors too. So the twin wraps *the very Parameter objects* of a TPContext.single()
chunk (full, seeded by name: the one-process model) in nn.Linear / nn.Embedding shells, and keeps our
Block (residual, rope, recomputation policy), Norm and Positions unchanged; only the GEMM-holding units
get nn.Linear forms whose arithmetic is the same (F.linear with the same weight and bias).

The parallel plan, per unit, is torchtitan's Llama plan (torchtitan/models/llama3/infra/parallelize.py)
on our [seq, batch, hidden] activations (sequence dim 0):
- Embedding: RowwiseParallel on nn.Embedding (weight Shard(0), vocab-parallel; the masked partial sum is
  all-reduced, or reduce-scattered along the sequence under sequence parallelism).
- Attention / MLP: PrepareModuleInput turns the input into one Replicate DTensor (one all-reduce of the
  input gradient in backward, Megatron's f; the sequence all-gather under SP), ColwiseParallel on wq, wk,
  wv, w_in, w_gate (Shard(0)), RowwiseParallel on wo, w_out (Shard(1); output all-reduced, Megatron's g, or
  reduce-scattered along the sequence under SP). The core runs on local tensors with heads / tp heads.
- Norms and learned positions under sequence parallelism: SequenceParallel(sequence_dim=0): Replicate
  parameters applied to Shard(0) activations, whose gradients DTensor sums over the TP group.
- Head: ColwiseParallel with Shard(-1) logits kept as a DTensor; the summed cross entropy runs under
  loss_parallel() (vocab-parallel, never gathering the logits), times the head's loss_scale, so the
  loss is our head's: the sum over tokens divided by the global token count.
A tied head re-uses the embedding's DTensor parameter (both Shard(0) on the same mesh), one Parameter as
in the one-process reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from runners.transformer import MLP, Attention, Block, Chunk, Embedding, LMHead, Norm, Positions, _rope


def _linear(weight: nn.Parameter, bias: nn.Parameter | None) -> nn.Linear:
    """An nn.Linear shell around existing parameters (built on meta: nothing allocated or drawn)."""
    layer = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None, device="meta")
    layer.weight = weight
    if bias is not None:
        layer.bias = bias
    return layer


class TorchAttention(nn.Module):
    """Attention with nn.Linear projections; heads are inferred from the (local) projection width."""

    def __init__(self, attn: Attention) -> None:
        super().__init__()
        self.head_dim, self.selective = attn.spec.head_dim, attn.selective
        self.wq, self.wk, self.wv = _linear(attn.wq, attn.bq), _linear(attn.wk, attn.bk), _linear(attn.wv, attn.bv)
        self.wo = _linear(attn.wo, attn.bo)
        # Qwen3's head norms, our modules as they are: the engine refuses them under TP (make_torch_trainer),
        # where their weights would need a gradient sum over the heads' ranks that no DTensor style gives.
        self.q_norm, self.k_norm = attn.q_norm, attn.k_norm

    @staticmethod
    def _core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # As Attention._core: [s, b, heads, d] -> [b, heads, s, d]; GQA repeats each KV head.
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return out.permute(2, 0, 1, 3).flatten(2)

    def forward(self, x: torch.Tensor, rope) -> torch.Tensor:
        """`rope`: the block's runners.transformer.Rope (None for learned positions)."""
        s, b, d = x.shape[0], x.shape[1], self.head_dim
        q = self.wq(x).view(s, b, -1, d)
        k = self.wk(x).view(s, b, -1, d)
        v = self.wv(x).view(s, b, -1, d)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if rope is not None:
            cos, sin = rope.tables(s, x.dtype)
            q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        ctx = checkpoint(self._core, q, k, v, use_reentrant=False) if self.selective else self._core(q, k, v)
        return self.wo(ctx)


class TorchMLP(nn.Module):
    def __init__(self, mlp: MLP) -> None:
        super().__init__()
        self.gated, self.gelu = mlp.gated, mlp.gelu
        self.w_in = _linear(mlp.w_in, mlp.b_in)
        self.w_gate = _linear(mlp.w_gate, None) if self.gated else None
        self.w_out = _linear(mlp.w_out, mlp.b_out)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = F.silu(self.w_gate(x)) * self.w_in(x) if self.gated else F.gelu(self.w_in(x), approximate=self.gelu)
        return self.w_out(hidden)


class TorchEmbedding(nn.Module):
    """tokens [b, s] -> [s, b, h] through an nn.Embedding holding our embedding's weight."""

    def __init__(self, embedding: Embedding) -> None:
        super().__init__()
        self.embed = nn.Embedding(*embedding.weight.shape, device="meta")
        self.embed.weight = embedding.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed(tokens.t())


class TorchHead(nn.Module):
    """Logits through an nn.Linear, then our head's loss: summed cross entropy times loss_scale.

    Vocab-sharded logits (a DTensor) take torch's vocab-parallel cross entropy, which is correct only
    inside loss_parallel() for forward and backward; the trainers enter it around both."""

    def __init__(self, head: LMHead) -> None:
        super().__init__()
        self.proj, self.loss_scale = _linear(head.weight, None), head.loss_scale

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        logits = self.proj(x)  # [s, b, V]
        flat = logits.float().reshape(-1, logits.shape[-1])
        loss = F.cross_entropy(flat, targets.t().reshape(-1), reduction="sum") * self.loss_scale
        # loss_parallel's sum is Replicate on every TP rank: the local scalar is the loss.
        return loss.to_local() if hasattr(loss, "to_local") else loss


def torch_native_chunk(chunk: Chunk) -> Chunk:
    """The same chunk (same Parameter objects, same order of units) with nn.Linear / nn.Embedding units."""
    units: list[nn.Module] = []
    for unit in chunk.units:
        if isinstance(unit, Embedding):
            units.append(TorchEmbedding(unit))
        elif isinstance(unit, LMHead):
            units.append(TorchHead(unit))
        elif isinstance(unit, Block):
            unit.attn, unit.mlp = TorchAttention(unit.attn), TorchMLP(unit.mlp)
            units.append(unit)
        else:
            assert isinstance(unit, (Norm, Positions)), type(unit)
            units.append(unit)
    return _TorchChunk(units)


class _TorchChunk(Chunk):
    def forward(self, x: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        for unit in self.units:
            x = unit(x, targets) if isinstance(unit, TorchHead) else unit(x)
        return x


def parallelize_chunk(chunk: Chunk, *, tp_mesh, sequence_parallel: bool) -> None:
    """Shard a torch_native_chunk over `tp_mesh` in place with torch's parallel styles (module docstring)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, RowwiseParallel,
                                                   SequenceParallel, parallelize_module)

    sp = sequence_parallel
    # The residual stream between units: a Shard(0) DTensor along the sequence under SP, else a plain
    # (replicated) local tensor.
    stream = Shard(0) if sp else Replicate()
    seq_style = {"use_local_output": not sp, "output_layouts": stream}
    units = list(chunk.units)
    # Decided before any style swaps the Parameters for DTensors.
    tied = isinstance(units[0], TorchEmbedding) and isinstance(units[-1], TorchHead) and \
        units[-1].proj.weight is units[0].embed.weight
    embedding = None
    for unit in units:
        if isinstance(unit, TorchEmbedding):
            parallelize_module(unit, tp_mesh, {"embed": RowwiseParallel(input_layouts=Replicate(), **seq_style)})
            embedding = unit
        elif isinstance(unit, (Norm, Positions)):
            if sp:
                parallelize_module(unit, tp_mesh, SequenceParallel(sequence_dim=0))
        elif isinstance(unit, Block):
            plan = {
                "attn": PrepareModuleInput(input_layouts=(stream, None), desired_input_layouts=(Replicate(), None)),
                "attn.wq": ColwiseParallel(), "attn.wk": ColwiseParallel(), "attn.wv": ColwiseParallel(),
                "attn.wo": RowwiseParallel(**seq_style),
                "mlp": PrepareModuleInput(input_layouts=(stream,), desired_input_layouts=(Replicate(),)),
                "mlp.w_in": ColwiseParallel(), "mlp.w_out": RowwiseParallel(**seq_style),
            }
            if unit.mlp.gated:
                plan["mlp.w_gate"] = ColwiseParallel()
            if sp:
                plan.update({"norm1": SequenceParallel(sequence_dim=0), "norm2": SequenceParallel(sequence_dim=0)})
            parallelize_module(unit, tp_mesh, plan)
        elif isinstance(unit, TorchHead):
            parallelize_module(unit, tp_mesh, {"proj": ColwiseParallel(input_layouts=stream, output_layouts=Shard(-1),
                                                                      use_local_output=False)})
            if tied:  # parallelize_module made a second DTensor; keep one shared Parameter
                unit.proj.weight = embedding.embed.weight
