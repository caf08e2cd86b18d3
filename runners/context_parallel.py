"""Context parallelism: a sequence split over the cp ranks of a group, and attention across them.

Layout (the load-balanced causal split of Megatron-LM and torchtitan): the sequence is cut into 2 x cp
chunks and CP rank r holds chunks r and 2 cp - 1 - r, so every rank has as many early (cheap) as late
(costly) query rows under the causal mask. Every token-wise layer runs on the local tokens unchanged;
RoPE and learned positions take the positions of this layout (`CPContext.positions`), and the loss is the
sum over local tokens scaled by 1 / (tokens in the global batch), so gradients summed over the dp x cp
ranks (runners/mesh.py) are those of the global mean.

Attention has three kinds (specs.plan.CP_KINDS), all one code path over the (all-to-all, ring) split of
the CP group (Plan.cp_split):
- all-to-all (DeepSpeed Ulysses): an all-to-all over the a2a ranks trades the head dimension for the
  sequence: each rank gets every local token of its a2a peers for 1/a of the heads (whole GQA groups: the
  K/V heads are split the same way), attends, and a second all-to-all returns the output;
- ring (Liu et al. 2023; Megatron's p2p): K/V travel around the ring by point-to-point sends issued before
  each step's partial attention, so the transfer hides behind it; the partial results merge by their
  log-sum-exp (online softmax); backward passes K/V around again and the K/V gradients travel with them,
  arriving home after one full turn;
- hierarchical (Megatron's a2a+p2p): the all-to-all inside a node, then the ring across node groups.
  Gathering the a2a group's chunks yields exactly two mirrored chunks of the 2 x ring split, so the ring's
  balanced block structure holds at the coarser grain.

The ring's blocks (for ring size n, my ring rank j, K/V from ring rank i steps back, src = j - i mod n):
step 0 is causal over my two chunks (the local layout is increasing in position); src < j: every query
row sees src's first chunk only; src > j: only my second chunk's rows see src's two chunks. Every step but
the first computes half of a full local block, so the ranks stay balanced.

A step's partial attention needs its log-sum-exp for the merge. On CPUs (fp32, bf16, fp16) torch's flash kernel
(`_scaled_dot_product_flash_attention_for_cpu`) returns it, and its backward, given the merged output and
log-sum-exp, yields exactly the block's share of the gradients: the blocks run tiled, in the inputs' dtype,
with no score block in memory. Elsewhere they are written out (scores, masked softmax, weighted values) in
fp32. The running output and log-sum-exp are fp32 either way; the full-sequence part of the all-to-all
kind uses scaled_dot_product_attention.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from runners.comm import Comm

KV_TAG, DKV_TAG = 11, 12  # gloo tells a ring step's K/V and K/V-gradient messages apart by tag


@dataclass
class CPContext:
    """This rank's place in its CP group (size 1: no context parallelism) and the groups of the split."""

    size: int = 1
    rank: int = 0
    comm: Comm | None = None
    group: object = None  # the whole CP group (MoE layers sum their per-sequence expert counts over it)
    a2a_group: object = None
    a2a_size: int = 1
    a2a_rank: int = 0
    ring_group: object = None
    ring_ranks: tuple[int, ...] = (0,)  # global ranks in ring order
    ring_rank: int = 0
    _positions: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_mesh(cls, mesh, *, comm: Comm) -> "CPContext":
        return cls(size=mesh.cp, rank=mesh.cp_rank, comm=comm, group=mesh.groups.get("cp"),
                   a2a_group=mesh.groups.get("cp_a2a"),
                   a2a_size=len(mesh.cp_a2a_ranks), a2a_rank=mesh.cp_a2a_ranks.index(mesh.rank),
                   ring_group=mesh.groups.get("cp_ring"), ring_ranks=mesh.cp_ring_ranks,
                   ring_rank=mesh.cp_ring_ranks.index(mesh.rank))

    @property
    def ring_size(self) -> int:
        return len(self.ring_ranks)

    def positions(self, num_local: int, device: torch.device) -> torch.Tensor:
        """Global positions of this rank's `num_local` tokens: chunks rank and 2 cp - 1 - rank."""
        key = (num_local, device)
        if key not in self._positions:
            self._positions[key] = local_positions(num_local * self.size, cp=self.size, rank=self.rank).to(device)
        return self._positions[key]

    def local_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        """This rank's tokens of [batch, seq] token ids (or targets), in the layout's order."""
        if self.size == 1:
            return tokens
        return tokens[:, self.positions(tokens.shape[1] // self.size, tokens.device)].contiguous()


def local_positions(seq_len: int, *, cp: int, rank: int) -> torch.Tensor:
    """Positions held by CP rank `rank` of `cp` in a sequence of `seq_len`: chunks rank and 2 cp - 1 - rank
    of 2 cp equal chunks."""
    chunk = seq_len // (2 * cp)
    first, second = rank * chunk, (2 * cp - 1 - rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


# --- the attention of one rank ------------------------------------------------------------------------
def context_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """Causal attention of this rank's tokens over the whole sequence: q [s, b, heads, d], k and v
    [s, b, kv_heads, d] (this rank's tokens, the layout's order) -> [s, b, heads, d]."""
    if cp.a2a_size > 1:
        q, k, v = (_SeqToHeads.apply(t, cp) for t in (q, k, v))
        q, k, v = (_to_ring_order(t, cp.a2a_size) for t in (q, k, v))
    # [s, b, heads, d] -> [b, heads, s, d]
    q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))
    if cp.ring_size > 1:
        out = _RingAttention.apply(q.contiguous(), k.contiguous(), v.contiguous(), cp)
    else:  # the whole sequence is here in position order
        rep = q.shape[1] // k.shape[1]
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = out.permute(2, 0, 1, 3)
    if cp.a2a_size > 1:
        out = _HeadsToSeq.apply(_from_ring_order(out, cp.a2a_size), cp)
    return out


def _to_ring_order(x: torch.Tensor, a: int) -> torch.Tensor:
    """The a2a group's gathered tokens [a x (2 chunks)] into position order of its two mirrored chunks:
    the a first chunks in rank order, then the a second chunks in reverse rank order."""
    parts = x.view(a, 2, x.shape[0] // (2 * a), *x.shape[1:])
    return torch.cat([parts[:, 0].flatten(0, 1), parts[:, 1].flip(0).flatten(0, 1)])


def _from_ring_order(x: torch.Tensor, a: int) -> torch.Tensor:
    half = x.shape[0] // 2
    first = x[:half].view(a, half // a, *x.shape[1:])
    second = x[half:].view(a, half // a, *x.shape[1:]).flip(0)
    return torch.stack([first, second], dim=1).flatten(0, 2)


def _all_to_all(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    x = x.contiguous()
    out = torch.empty_like(x)
    cp.comm.all_to_all(out, x, cp.a2a_group)
    return out


def _seq_to_heads(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """[s, b, h, d] -> [a s, b, h / a, d]: my head slice of every a2a peer's tokens (peer order)."""
    a = cp.a2a_size
    s, b, h, d = x.shape
    send = x.view(s, b, a, h // a, d).permute(2, 0, 1, 3, 4)  # slice u goes to peer u
    return _all_to_all(send, cp).view(a * s, b, h // a, d)


def _heads_to_seq(x: torch.Tensor, cp: CPContext) -> torch.Tensor:
    """The inverse of _seq_to_heads: [a s, b, h / a, d] -> [s, b, h, d]."""
    a = cp.a2a_size
    s_all, b, hs, d = x.shape
    back = _all_to_all(x.view(a, s_all // a, b, hs, d), cp)  # [a (head slices), s, b, h / a, d]
    return back.permute(1, 2, 0, 3, 4).reshape(s_all // a, b, a * hs, d)


class _SeqToHeads(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _seq_to_heads(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return _heads_to_seq(grad, ctx.cp), None


class _HeadsToSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, cp):
        ctx.cp = cp
        return _heads_to_seq(x, cp)

    @staticmethod
    def backward(ctx, grad):
        return _seq_to_heads(grad, ctx.cp), None


# --- ring attention -------------------------------------------------------------------------------------
def _block(step: int, *, me: int, n: int, half: int) -> tuple[slice, slice, bool]:
    """(query rows, key columns, causal) of ring step `step` (module docstring)."""
    if step == 0:
        return slice(None), slice(None), True
    src = (me - step) % n
    if src < me:
        return slice(None), slice(0, half), False
    return slice(half, None), slice(None), False


def _repeat_kv(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _scores(q, k, *, causal: bool, scale: float) -> torch.Tensor:
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if causal:  # square block on the diagonal: a key after its query is masked
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return scores


FUSED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # the kernel's log-sum-exp is fp32 for these


def _fused_blocks(q: torch.Tensor) -> bool:
    """Whether this device runs the ring's blocks on torch's flash kernel, which returns the log-sum-exp
    (CPU, the training dtypes); elsewhere they are written out."""
    return (q.device.type == "cpu" and q.dtype in FUSED_DTYPES
            and hasattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu"))


def _partial(q, k, v, *, causal: bool, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention of q over one K/V block: (output fp32, log-sum-exp of the scores [b, heads, rows])."""
    rep = q.shape[1] // k.shape[1]
    if _fused_blocks(q):
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, _repeat_kv(k, rep), _repeat_kv(v, rep), 0.0, causal, scale=scale)
        return out.float(), lse
    scores = _scores(q, _repeat_kv(k, rep), causal=causal, scale=scale)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - lse.unsqueeze(-1)), _repeat_kv(v, rep).float()), lse


def _partial_backward(q, k, v, dout, out, lse, delta, *, causal: bool, scale: float):
    """Gradients (fp32) of one block given the final output, its log-sum-exp and delta = rowsum(dout x out)
    (FlashAttention's backward, Dao et al. 2022): (dq, dk, dv), dk and dv summed over each GQA group. Given
    the merged output and log-sum-exp, the fused kernel's backward yields exactly this block's share."""
    rep = q.shape[1] // k.shape[1]
    if _fused_blocks(q):
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            dout.to(q.dtype), q, _repeat_kv(k, rep), _repeat_kv(v, rep), out.to(q.dtype), lse, 0.0, causal,
            scale=scale)
        dq, dk, dv = dq.float(), dk.float(), dv.float()
    else:
        kr, vr = _repeat_kv(k, rep).float(), _repeat_kv(v, rep).float()
        p = torch.exp(_scores(q, kr, causal=causal, scale=scale) - lse.unsqueeze(-1))
        dv = torch.matmul(p.transpose(-1, -2), dout)
        ds = p * (torch.matmul(dout, vr.transpose(-1, -2)) - delta.unsqueeze(-1))
        dq = torch.matmul(ds, kr) * scale
        dk = torch.matmul(ds.transpose(-1, -2), q.float()) * scale
    if rep > 1:
        b, _, s, d = dk.shape
        dk, dv = (t.view(b, k.shape[1], rep, s, d).sum(2) for t in (dk, dv))
    return dq, dk, dv


def ring_forward_step(q, k, v, out, lse, *, rows: slice, cols: slice, causal: bool, scale: float) -> None:
    """One ring step's forward on this rank: q's `rows` attend over the K/V block's `cols` (`_block`), merged
    into the running output `out` and log-sum-exp `lse` in place (online softmax). The step
    `planner profile` times as the ring's forward kernel (runners/probe.measure_attention_blocks)."""
    o_i, lse_i = _partial(q[:, :, rows], k[:, :, cols], v[:, :, cols], causal=causal, scale=scale)
    merged = torch.logaddexp(lse[:, :, rows], lse_i)
    out[:, :, rows] = (out[:, :, rows] * torch.exp(lse[:, :, rows] - merged).unsqueeze(-1)
                       + o_i * torch.exp(lse_i - merged).unsqueeze(-1))
    lse[:, :, rows] = merged


def ring_backward_step(q, k, v, dout, out, lse, delta, dq, *, rows: slice, cols: slice, causal: bool,
                       scale: float) -> torch.Tensor:
    """One ring step's backward: adds this block's query gradient into `dq` (fp32, in place) and returns the
    gradient of the block's K/V owner, [2, b, kv_heads, s, d] fp32 (zero outside `cols`). The step
    `planner profile` times as the ring's backward kernel."""
    dq_i, dk_i, dv_i = _partial_backward(q[:, :, rows], k[:, :, cols], v[:, :, cols], dout[:, :, rows],
                                         out[:, :, rows], lse[:, :, rows], delta[:, :, rows], causal=causal,
                                         scale=scale)
    dq[:, :, rows] += dq_i
    dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=q.device)
    dkv[0][:, :, cols] = dk_i
    dkv[1][:, :, cols] = dv_i
    return dkv


class _Ring:
    """Point-to-point steps around the ring: send to the next ring rank, receive from the previous."""

    def __init__(self, cp: CPContext) -> None:
        self.cp = cp
        n, j = cp.ring_size, cp.ring_rank
        self.next, self.prev = cp.ring_ranks[(j + 1) % n], cp.ring_ranks[(j - 1) % n]

    def start(self, tensor: torch.Tensor, *, tag: int):
        recv = torch.empty_like(tensor)
        works = self.cp.comm.exchange(tensor, recv, dst=self.next, src=self.prev, group=self.cp.ring_group, tag=tag)
        return works, recv

    def finish(self, pending) -> torch.Tensor:
        works, recv = pending
        for w in works:
            self.cp.comm.wait(w)
        return recv


class _RingAttention(torch.autograd.Function):
    """Causal attention over the ring: q [b, heads, s, d], k, v [b, kv_heads, s, d] in the ring layout."""

    @staticmethod
    def forward(ctx, q, k, v, cp):
        ring, n, me = _Ring(cp), cp.ring_size, cp.ring_rank
        scale, half = q.shape[-1] ** -0.5, q.shape[2] // 2
        # Laid out [s, b, heads, d] (viewed [b, heads, s, d]): the layout context_attention hands the output
        # projection, so in fp32 the output it keeps for backward is this tensor, not a re-laid-out copy
        # (one s x h activation per layer more than the unsplit path, whose fused kernel returns that layout).
        b, h, s, d = q.shape
        out = torch.zeros(s, b, h, d, dtype=torch.float32, device=q.device).permute(1, 2, 0, 3)
        lse = torch.full(q.shape[:3], float("-inf"), dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        for step in range(n):
            pending = ring.start(kv, tag=KV_TAG) if step < n - 1 else None  # hides behind this step
            rows, cols, causal = _block(step, me=me, n=n, half=half)
            ring_forward_step(q, kv[0], kv[1], out, lse, rows=rows, cols=cols, causal=causal, scale=scale)
            if pending is not None:
                kv = ring.finish(pending)
        ctx.cp = cp
        ctx.save_for_backward(q, k, v, out, lse)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        cp = ctx.cp
        ring, n, me = _Ring(cp), cp.ring_size, cp.ring_rank
        scale, half = q.shape[-1] ** -0.5, q.shape[2] // 2
        dout = dout.float()
        delta = (dout * out).sum(-1)
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        pending_dkv = None
        for step in range(n):
            pending = ring.start(kv, tag=KV_TAG) if step < n - 1 else None
            rows, cols, causal = _block(step, me=me, n=n, half=half)
            # The K/V gradient of this step's K/V owner: what the previous ranks added, plus mine.
            dkv = ring_backward_step(q, kv[0], kv[1], dout, out, lse, delta, dq, rows=rows, cols=cols,
                                     causal=causal, scale=scale)
            if pending_dkv is not None:
                dkv += ring.finish(pending_dkv).float()
            pending_dkv = ring.start(dkv.to(k.dtype), tag=DKV_TAG)
            if pending is not None:
                kv = ring.finish(pending)
        dkv = ring.finish(pending_dkv)  # my own K/V's gradient, home after a full turn
        return dq.to(q.dtype), dkv[0], dkv[1], None

