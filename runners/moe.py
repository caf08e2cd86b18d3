"""The mixture-of-experts MLP: router, top-k, routed experts over the EP group, shared expert, aux loss.

Per token: router logits (fp32, hidden -> num_experts), softmax, the top-k experts by probability with
ties to the lower expert index (a stable sort, so every plan routes as one process does), the k weights
their probabilities renormalised to sum to one (Mixtral's, Qwen3-MoE's norm_topk_prob) or, where the
model says norm_topk_prob false (Qwen1.5/Qwen2-MoE), as they are; the token's output is the weighted
sum of its experts' SwiGLU outputs, plus the shared expert's.

Everything that couples tokens is per sequence, so that micro-batching, DP and EP split nothing it
sums: the capacity (capacity_factor > 0: each expert takes at most ceil(cf x seq_len x k / E) of a
sequence's assignments, earliest positions first; the overflow is dropped) and the load-balancing loss,
Megatron-Core's switch form per sequence, coeff x E / (S^2 k) x sum_e P_e c_e (P_e the sequence's summed
router probabilities of expert e, c_e its assignment count), averaged over the global batch's sequences.
Under sequence parallelism a sequence's counts are summed over the TP group first, and under context
parallelism over the CP group (each CP rank routes its chunks of the sequence; the capacity, which needs
the sequence's positions in order, is refused there, as under TP). The aux loss is
not added to the reported loss: its gradient is attached to the layer's output (Megatron-Core's
MoEAuxLossAutoScaler), which works unchanged across pipeline stages and recomputation.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from runners.context_parallel import CPContext
from runners.expert_parallel import EPContext, combine, dispatch, plan_dispatch
from runners.param_init import INIT_STD, _param
from runners.tensor_parallel import TPContext, sequence_parallel_param


class GroupedExperts(nn.Module):
    """This EP rank's num_experts / ep SwiGLU experts as stacked weights [local, ...] (one sharding unit).

    Each weight is EP rank r's rows r x local .. (r + 1) x local - 1 of the full [num_experts, ...] weight,
    and under expert TP this ETP rank's 1/etp of each expert's FFN width (w_gate, w_in: dim 1; w_out: dim
    2), drawn from it (runners/transformer.py's seeded init), so every plan starts from one process's
    experts."""

    def __init__(self, spec, *, name: str, seed: int, ep: EPContext) -> None:
        super().__init__()
        e, h, f = spec.num_experts, spec.hidden_size, spec.expert_ffn_hidden_size
        out_std = INIT_STD / math.sqrt(2 * spec.num_layers)
        self.num_local = e // ep.size
        shards = dict(seed=seed, tp=ep, split_dim=0)  # _param slices dim 0 by (rank, size) of `tp`

        def etp(dim: int) -> tuple[int, int, int]:
            return (dim, ep.etp_rank, ep.etp_size)

        self.w_gate = _param((e, f, h), name=f"{name}.w_gate", std=INIT_STD, extra_split=etp(1), **shards)
        self.w_in = _param((e, f, h), name=f"{name}.w_in", std=INIT_STD, extra_split=etp(1), **shards)
        self.w_out = _param((e, h, f), name=f"{name}.w_out", std=out_std, extra_split=etp(2), **shards)
        for p, etp_dim in ((self.w_gate, 1), (self.w_in, 1), (self.w_out, 2)):
            # Split over EP (and ETP), not TP: the sharding engine keeps them apart (runners/train.py) and
            # the one-process view joins them over the EP and ETP groups.
            p.tp_split_dim, p.ep_split_dim, p.etp_split_dim, p.is_expert = None, 0, etp_dim, True

    def forward(self, rows: torch.Tensor, tokens_per_expert: list[int]) -> torch.Tensor:
        outs = []
        for i, part in enumerate(rows.split(tokens_per_expert)):
            hidden = F.silu(F.linear(part, self.w_gate[i])) * F.linear(part, self.w_in[i])
            outs.append(F.linear(hidden, self.w_out[i]))
        return torch.cat(outs) if outs else rows


class _AttachAux(torch.autograd.Function):
    """Identity on the layer output; backward gives the aux loss the gradient `scale` (its weight in the
    global loss), so its gradient joins the main loss's without touching the reported loss."""

    @staticmethod
    def forward(ctx, out, aux, scale):
        ctx.scale = scale
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        return grad, torch.full((), ctx.scale, dtype=torch.float32, device=grad.device), None


class MoE(nn.Module):
    """An MoE layer's MLP on x [s, b, h] (this rank's tokens: its sequence slice under SP); `shared`: the
    shared expert (a dense MLP, TP-split like any), or None."""

    def __init__(self, spec, *, name: str, seed: int, tp: TPContext, ep: EPContext, aux_scale: float,
                 shared: nn.Module | None = None, cp: CPContext | None = None) -> None:
        super().__init__()
        self.spec, self.tp, self.ep = spec, tp, ep
        self.cp = cp or CPContext()  # a sequence's tokens are over its CP ranks too
        self.k, self.num_experts = spec.num_experts_per_token, spec.num_experts
        self.aux_scale = aux_scale  # 1 / sequences in the global batch (times the fp16 loss scale)
        self.layer_index = int(name.split(".")[1]) if name.startswith("layers.") else 0
        self.counters = None  # runners.comm.CommCounters that count the routing (set by the trainer)
        self.router = _param((spec.num_experts, spec.hidden_size), name=f"{name}.router", seed=seed, std=INIT_STD,
                             tp=TPContext.single())
        self.experts = GroupedExperts(spec, name=f"{name}.experts", seed=seed, ep=ep)
        self.shared = shared
        # Qwen2-MoE's gate on the shared expert: sigmoid(x . w) per token, w replicated over TP.
        self.shared_gate = (_param((1, spec.hidden_size), name=f"{name}.shared_gate", seed=seed, std=INIT_STD,
                                   tp=TPContext.single()) if shared is not None and spec.shared_expert_gate else None)

    def route(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(probabilities [N, E] fp32, top-k expert ids [N, k], their weights [N, k]: renormalised where the
        model's norm_topk_prob says so)."""
        router = sequence_parallel_param(self.router, self.tp)  # replicated over TP, tokens sharded under SP
        probs = F.linear(tokens.float(), router.float()).softmax(dim=-1)
        ids = torch.sort(probs.detach(), dim=-1, descending=True, stable=True).indices[:, :self.k]
        weights = probs.gather(1, ids)
        return probs, ids, weights / weights.sum(dim=-1, keepdim=True) if self.spec.norm_topk_prob else weights

    def _sequence_counts(self, ids: torch.Tensor, batch: int) -> torch.Tensor:
        """[s_local, b, E] one-hot assignments and their per-sequence totals [b, E] (over TP under SP, over CP)."""
        one_hot = torch.zeros(ids.shape[0], self.num_experts, dtype=torch.int64, device=ids.device)
        one_hot.scatter_(1, ids, 1)
        per_position = one_hot.view(-1, batch, self.num_experts)
        totals = per_position.sum(0)
        if self.tp.sequence_parallel and self.tp.size > 1:
            self.tp.comm.all_reduce(totals, self.tp.group)
        if self.cp.size > 1:  # the sequence's other chunks
            self.cp.comm.all_reduce(totals, self.cp.group)
        return per_position, totals

    def _aux_loss(self, probs: torch.Tensor, totals: torch.Tensor, batch: int) -> torch.Tensor:
        """Sum over my sequences of coeff x E / (S^2 k) x sum_e P_e c_e, P_e over my tokens (linear in them,
        so the TP ranks' parts add up to the sequence's)."""
        seq_len = probs.shape[0] // batch * (self.tp.size if self.tp.sequence_parallel else 1) * self.cp.size
        summed = probs.view(-1, batch, self.num_experts).sum(0)  # [b, E]
        coeff = self.spec.aux_loss_coeff * self.num_experts / (seq_len * seq_len * self.k)
        return coeff * (summed * totals.to(summed.dtype)).sum()

    def _keep(self, per_position: torch.Tensor, ids: torch.Tensor, seq_len: int) -> torch.Tensor:
        """[N, k] which assignments fit their expert's per-sequence capacity (earliest positions first)."""
        capacity = math.ceil(self.spec.capacity_factor * seq_len * self.k / self.num_experts)
        fits = per_position.cumsum(0) <= capacity  # [s, b, E]: the assignment's place within its expert
        return fits.view(-1, self.num_experts).gather(1, ids)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, b, h = x.shape
        tokens = x.reshape(-1, h)  # token n is position n // b of sequence n % b
        probs, ids, weights = self.route(tokens)
        per_position, totals = self._sequence_counts(ids, b)
        assign_token = torch.arange(tokens.shape[0], device=x.device).repeat_interleave(self.k)
        assign_expert, assign_weight = ids.reshape(-1), weights.reshape(-1)
        if self.spec.capacity_factor > 0:
            kept = self._keep(per_position, ids, s).reshape(-1)
            assign_token, assign_expert, assign_weight = assign_token[kept], assign_expert[kept], assign_weight[kept]
        order = torch.argsort(assign_expert, stable=True)
        counts = torch.bincount(assign_expert, minlength=self.num_experts)
        route = plan_dispatch(counts, self.ep)
        if self.counters is not None:  # every forward, a recomputed one too
            self.counters.count_routing(self.layer_index, counts.tolist(),
                                        off_rank=sum(route.send_splits) - route.send_splits[self.ep.rank])
        rows = dispatch(tokens[assign_token[order]], route, self.ep)
        outs = combine(self.experts(rows, route.tokens_per_local_expert), route, self.ep)
        weighted = torch.empty_like(outs).index_copy(0, order, outs) * assign_weight.to(x.dtype).unsqueeze(1)
        out = torch.zeros_like(tokens).index_add(0, assign_token, weighted).view(s, b, h)
        if self.shared is not None:
            shared = self.shared(x)
            if self.shared_gate is not None:
                shared = shared * torch.sigmoid(F.linear(x, sequence_parallel_param(self.shared_gate, self.tp)))
            out = out + shared
        if self.spec.aux_loss_coeff > 0 and torch.is_grad_enabled():
            out = _AttachAux.apply(out, self._aux_loss(probs, totals, b), self.aux_scale)
        return out
