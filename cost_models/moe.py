"""Price of an MoE layer's MLP: router and expert GEMMs at their real shapes, the token all-to-all, expert
state memory under ep / etp and expert-DP sharding, and the layer's activations.

Per micro-batch a rank holds `tokens` tokens (b x s / cp, / tp under sequence parallelism). Its EP group
of ep ranks routes ep x tokens x k assignments over num_experts experts; a rank holds num_experts / ep of
them, so each local expert sees ep x tokens x k / num_experts rows on average, etp x that with expert TP
(the etp ranks of an expert all see its rows, each computing 1/etp of its width; Megatron-Core). The
busiest expert sets the time every EP rank waits for: `imbalance` (max / mean rows per expert) multiplies
the rows; 1 is perfect balance. A calibration's moe_imbalance sets it where measured (runners/moe.py's
tiny runs give it on CPU, benchmarks/moe.py); elsewhere `expected_imbalance` derives it from how the model
balances its router (ModelSpec.load_balancing). The GEMM model
(cost_models/compute.gemm_time_s) prices the small, thin expert GEMMs at their own efficiency.

All-to-all (runners/expert_parallel.py): dispatch sends each assignment's hidden vector to its expert's
rank, combine sends it back; under uniform routing (ep - 1) / ep of the tokens x k assignments leave the
rank, of which the share whose destination is on another node crosses nodes (EP ranks sit etp apart
within a stage, `ep_ranks_per_node`). Forward is dispatch + combine, backward the same pair reversed;
full recomputation repeats the forward pair.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from dataclasses import dataclass

from cost_models.comm import flat_collective_time_s
from cost_models.compute import Gemm, activation_bytes_per_element, backward_gemms_time_s, gemm_time_s, memory_time_s
from cost_models.memory import model_state_bytes
from specs.hardware import Hardware
from specs.model import ModelSpec


def dense_view(model: ModelSpec) -> ModelSpec:
    """The model's dense layer (attention and a dense MLP of ffn_hidden_size): its leading dense layers."""
    return dataclasses.replace(model, num_experts=0, num_experts_per_token=0, expert_ffn_hidden_size=0,
                               shared_expert_ffn_hidden_size=0, shared_expert_gate=False, num_dense_layers=0,
                               capacity_factor=0.0, aux_loss_coeff=0.0)


def attention_view(model: ModelSpec, *, tp: int) -> ModelSpec:
    """The dense layer with an MLP of width 8 x tp: an MoE layer's part outside its MLP, priced by the
    dense model (the remaining tiny MLP stands for the MoE layer's own elementwise ops and router input)."""
    return dataclasses.replace(dense_view(model), ffn_hidden_size=8 * tp)


def moe_fraction(model: ModelSpec) -> float:
    """Share of the layers that are MoE layers (the per-layer prices average the two kinds)."""
    return model.num_moe_layers / model.num_layers


def nonexpert_layer_params_per_device(model: ModelSpec, *, tp: int) -> float:
    """A layer's parameters outside the routed experts on one TP rank, averaged over the layers: attention
    and MLPs split over TP (MLA's latent down-projections too, a slight undercount), norms and the router
    replicated."""
    phi = moe_fraction(model)
    moe_mlp = model.router_params() + model.shared_expert_params() / tp
    mlp = (1 - phi) * model.mlp_params() / tp + phi * moe_mlp
    return model.attention_params() / tp + 2 * model.norm_params() + mlp


def expert_plan_view(plan):
    """The plan as the expert parameters' data parallelism sees it: expert-DP ranks as its DP group, spaced
    ep x etp ranks apart (its `tp`, the stride cost_models/estimate.py's DP collectives use), sharded at
    Plan.expert_shard_degrees; the engine's expert sharding engine runs the same view (runners/train.py)."""
    s_p, s_g, s_os = plan.expert_shard_degrees
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return plan.replace(dp=plan.expert_dp, cp=1, tp=plan.ep * plan.etp, ep=1, etp=1, sequence_parallel=False,
                            param_shard=s_p, grad_shard=s_g, optim_shard=s_os, param_cache="none")


def rows_per_expert(model: ModelSpec, *, tokens: float, ep: int, etp: int = 1, imbalance: float = 1.0) -> float:
    """Rows the busiest local expert processes in one micro-batch on one rank (see the module docstring)."""
    return etp * ep * tokens * model.num_experts_per_token / model.num_experts * imbalance


# Wang et al. 2024, "Auxiliary-Loss-Free Load Balancing Strategy for Mixture-of-Experts" (arXiv:2408.15664),
# Table 2: MaxVio_global = (max_i Load_i - mean Load_i) / mean Load_i over the validation set, 0.52 for
# their 3B model trained with a balancing loss (alpha 0.001, 200B tokens; 0.72 at 1B) and 0.04 with
# bias-adjusted (auxiliary-loss-free) routing at both scales. The larger model's figure stands for
# "aux_loss". "forced" routing has no standing preference, but it is random, not round-robin:
# Megatron-Core's --moe-router-force-load-balancing replaces the router's logits with i.i.d. normal ones
# drawn per token (moe_utils.RandomSTE), so each token's top-k is a uniform draw and the loads keep
# their sampling spread.
MAX_LOAD_VIOLATION = {"aux_loss": 0.52, "aux_free": 0.04, "forced": 0.0}
# A trained router's preference within one sequence (a document routes unlike the corpus): each sequence's
# expert shares drawn as Dirichlet(alpha / E, ...), so a rank's g experts hold a share q = g / E with
# variance q (1 - q) / (alpha + 1) for one sequence, / n over n independent sequences. Sized from FEPLB (Qi,
# Liu, Zhao 2026, arXiv:2604.19654): GLM-5's MoE layers (128 experts, no auxiliary loss, EP 8, H100) lose
# 18.6% of their GPU time to the busiest rank, max / mean = 1 / (1 - 0.186) = 1.229 per micro-batch; with
# its standing and sampling spreads negligible (loss-free balancing, thousands of tokens a rank) and one
# sequence a rank (its micro-batch is not stated: 1 assumed, no TP or CP), 0.229 = sqrt(2 ln 8) x
# sqrt((7/8) / ((1/8) x 8 x (alpha + 1))), so alpha + 1 = 69.7. Forced routing has none.
SEQUENCE_ROUTING_DRAWS = {"aux_loss": 68.7, "aux_free": 68.7, "forced": math.inf}


def expected_imbalance(model: ModelSpec, *, tokens: float, ep: int, seq_len: int) -> float:
    """Expected busiest-EP-rank load over the mean in one micro-batch (max / mean rows), the wait every EP
    rank pays at the combine. A rank holds g = E / ep experts and receives, on average, tokens x k of the
    ep x tokens x k assignments of its group. Three spreads add in quadrature, as relative standard
    deviations of a rank's load:
    - sampling: a token puts a hypergeometric number of its k distinct experts on the rank, variance
      k (g/E)(1 - g/E)(E - k)/(E - 1), summed over the ep x tokens tokens (uniform routing's floor, all
      that "forced" routing's random logits leave);
    - the trained router's standing preference for some experts over the whole corpus: a measured maximum
      excess MaxVio over E experts is ~ sqrt(2 ln E) standard deviations of one expert's share, sigma_e =
      MaxVio / sqrt(2 ln E), and a rank's g experts average theirs, sigma_e / sqrt(g);
    - its preference within each sequence (SEQUENCE_ROUTING_DRAWS): the group's tokens come from
      n = ep x tokens / seq_len sequences (fewer than one where CP and SP split a sequence over the group's
      ranks, then the one sequence they share), so sqrt((1 - q) / (q (alpha + 1) n)) with q = 1 / ep.
    The expected maximum of ep such loads is about mean + sqrt(2 ln ep) sigma (Gaussian maximum). A capacity
    factor caps it (tokens over capacity are dropped); ep 1 has no rank to wait for."""
    violation = MAX_LOAD_VIOLATION[model.load_balancing]
    if ep == 1 or tokens <= 0:
        return 1.0
    e, k = model.num_experts, model.num_experts_per_token
    share = 1.0 / ep  # g / E
    per_token_var = k * share * (1 - share) * (e - k) / max(1, e - 1)
    sampling = math.sqrt(ep * tokens * per_token_var) / (tokens * k)
    standing = violation / math.sqrt(2 * math.log(e)) / math.sqrt(e / ep)
    sequences = max(1.0, ep * tokens / seq_len)
    within = math.sqrt((1 - share) / (share * (SEQUENCE_ROUTING_DRAWS[model.load_balancing] + 1) * sequences))
    imbalance = 1.0 + math.sqrt(2 * math.log(ep)) * math.sqrt(sampling ** 2 + standing ** 2 + within ** 2)
    return min(imbalance, model.capacity_factor) if model.capacity_factor > 0 else imbalance


def moe_gemms(model: ModelSpec, *, tokens: int, ep: int, etp: int = 1, tp: int = 1,
              imbalance: float = 1.0) -> dict[str, list[Gemm]]:
    """Forward GEMMs of one MoE layer's MLP on one rank holding `tokens` tokens: 'router' (tokens x E from
    h), 'experts' (gate, up, down of every local expert, batched over them) and 'shared' (the shared
    expert, TP-split like a dense MLP over the tp x tokens of the gathered sequence)."""
    h, f = model.hidden_size, model.expert_ffn_hidden_size // etp
    m = round(rows_per_expert(model, tokens=tokens, ep=ep, etp=etp, imbalance=imbalance))
    local = model.num_experts // ep
    experts = [Gemm(m, f, h, local), Gemm(m, f, h, local), Gemm(m, h, f, local)] if m > 0 else []
    fs = model.shared_expert_ffn_hidden_size
    shared = [Gemm(tp * tokens, fs // tp, h), Gemm(tp * tokens, fs // tp, h), Gemm(tp * tokens, h, fs // tp)] if fs else []
    return {"router": [Gemm(tokens, model.num_experts, h)], "experts": experts, "shared": shared}


@dataclass(frozen=True)
class MoETimes:
    forward_s: float
    backward_s: float


def concurrent_rounds(gemm: Gemm, *, streams: int) -> list[Gemm]:
    """The local experts' GEMMs of one projection as they run: one GEMM an expert, at most `streams` of them
    at once (each round a batch that shares the SMs' waves), the last round holding what is left.
    Transformer Engine's GroupedLinear, Megatron-Core's grouped expert MLP (TEGroupedMLP), has "only [a]
    multi-stream cublas backend": nvte_multi_stream_cublas_gemm puts expert i's GEMM on compute stream
    i % 4 (transformer_engine/common/util/multi_stream.cpp, num_compute_streams = 4), so a 16-expert rank
    runs four rounds of four GEMMs, each round's last wave part-empty, not one batch of 16 filling the
    SMs' waves. This project's engine runs the experts one after another (runners/moe.py): 1 stream."""
    full, rest = divmod(gemm.batch, max(1, streams))
    rounds = [dataclasses.replace(gemm, batch=streams)] * full
    return rounds + ([dataclasses.replace(gemm, batch=rest)] if rest else [])


def moe_compute_times(model: ModelSpec, hw: Hardware, *, tokens: int, ep: int, etp: int = 1, tp: int = 1,
                      imbalance: float = 1.0, dtype: str, accumulate_fp32: bool = False,
                      expert_streams: int | None = None) -> MoETimes:
    """Forward and backward (input + weight gradients) GEMM seconds of one MoE layer's MLP on one rank; the
    router runs in fp32 (runners/moe.py, Megatron-Core's --moe-router-dtype fp32). `accumulate_fp32`: the
    weight gradients are added into fp32 main gradients (Megatron's gradient-accumulation fusion,
    compute.gemm_time_s), which an expert's weight gradient, over its few rows, waits for in HBM bytes.
    `expert_streams`: how many expert GEMMs the engine runs at once (`concurrent_rounds`); None prices the
    local experts as one batched GEMM."""
    gemms = moe_gemms(model, tokens=tokens, ep=ep, etp=etp, tp=tp, imbalance=imbalance)
    if expert_streams is not None:
        gemms["experts"] = [r for g in gemms["experts"] for r in concurrent_rounds(g, streams=expert_streams)]
    fwd = bwd = 0.0
    for group, items in gemms.items():
        kind = "fp32" if group == "router" else dtype
        fwd += sum(gemm_time_s(hw, g, dtype=kind) for g in items)
        bwd += sum(backward_gemms_time_s(hw, g, dtype=kind, accumulate_fp32=accumulate_fp32) for g in items)
    return MoETimes(forward_s=fwd, backward_s=bwd)


def ep_ranks_per_node(*, ep: int, etp: int, ranks_per_node: int) -> int:
    """EP ranks of one group inside one node: the group's ranks sit etp apart (runners/mesh.py)."""
    return max(1, min(ep, ranks_per_node // etp))


@dataclass(frozen=True)
class AllToAllBytes:
    """Bytes one rank sends in one all-to-all of one MoE layer (dispatch or combine), by link class."""

    intra_node: float
    inter_node: float

    @property
    def total(self) -> float:
        return self.intra_node + self.inter_node


DISPATCHERS = ("alltoall", "deepep", "hybridep")


def share_of_groups_hit(*, num_experts: int, top_k: int, group_experts: int) -> float:
    """Probability that a token's k distinct experts (uniform routing) include at least one of a given
    group of `group_experts` experts: 1 - C(E - g, k) / C(E, k)."""
    miss = 1.0
    for i in range(top_k):
        miss *= max(0.0, (num_experts - group_experts - i) / (num_experts - i))
    return 1.0 - miss


def all_to_all_bytes(model: ModelSpec, *, tokens: int, ep: int, etp: int = 1, ranks_per_node: int,
                     precision: str, dispatcher: str = "alltoall") -> AllToAllBytes:
    """One dispatch (or combine) under uniform routing, split by whether the destination rank is in this
    node. "alltoall" (Megatron-Core's MoEAlltoAllTokenDispatcher permutes the tokens x k assignments
    first): tokens x k x h x bytes, the (ep - 1) / ep that leave the rank. "deepep" / "hybridep" (the
    flex dispatcher; DeepSeek-AI's DeepEP, NVIDIA's HybridEP): a token crosses the NIC once per other
    node holding one of its experts and is fanned out over NVLink once per destination rank (Zhao et
    al., DeepEP README: "tokens ... sent to the same-index GPU on each node, then forwarded via NVLink"),
    so its copies are the nodes and ranks its k experts hit, not k."""
    if ep == 1:
        return AllToAllBytes(0.0, 0.0)
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown MoE dispatcher {dispatcher!r}; choose from {', '.join(DISPATCHERS)}")
    row = tokens * model.hidden_size * activation_bytes_per_element(precision)
    inside = ep_ranks_per_node(ep=ep, etp=etp, ranks_per_node=ranks_per_node)
    if dispatcher == "alltoall":
        per_dest = row * model.num_experts_per_token / ep
        return AllToAllBytes(intra_node=per_dest * (inside - 1), inter_node=per_dest * (ep - inside))
    hit = functools.partial(share_of_groups_hit, num_experts=model.num_experts, top_k=model.num_experts_per_token)
    local = model.num_experts // ep
    rank_copies = (ep - 1) * hit(group_experts=local)  # other ranks a token reaches
    node_copies = (ep // inside - 1) * hit(group_experts=local * inside)  # other nodes it crosses to
    return AllToAllBytes(intra_node=row * max(0.0, rank_copies - node_copies), inter_node=row * node_copies)


def all_to_all_time_s(model: ModelSpec, hw: Hardware, *, tokens: int, ep: int, etp: int = 1, ranks_per_node: int,
                      precision: str, dispatcher: str = "alltoall") -> float:
    """One dispatch (or combine): the rows for ranks in this node over the intra-node link while those for
    other nodes leave over the NIC, at once (NCCL's all-to-all posts every pair's send together), so the
    slower of the two; each part as point-to-point volume on its link (latency once per destination)."""
    volume = all_to_all_bytes(model, tokens=tokens, ep=ep, etp=etp, ranks_per_node=ranks_per_node,
                              precision=precision, dispatcher=dispatcher)
    if volume.total == 0:
        return 0.0
    inside = ep_ranks_per_node(ep=ep, etp=etp, ranks_per_node=ranks_per_node)
    parts = [(volume.intra_node, "intra_node", inside - 1), (volume.inter_node, "inter_node", ep - inside)]
    return max(flat_collective_time_s(hw, collective="p2p", size_bytes=num_bytes, group_size=2, link=link)
               + (peers - 1) * hw.link(link).latency_s for num_bytes, link, peers in parts if num_bytes > 0)


def permutation_bytes(model: ModelSpec, *, tokens: int, ep: int, etp: int = 1, imbalance: float = 1.0,
                      precision: str, dispatcher: str = "alltoall") -> float:
    """Forward HBM bytes one rank's token permutations move around one MoE layer's dispatch and combine,
    as Megatron-Core's dispatchers run them (megatron/core/transformer/moe/token_dispatcher.py, each pass a
    fused kernel under --moe-permute-fusion that reads and writes every row once). With `own` = tokens x k
    assignments of the rank's tokens and `recv` the rows its experts receive:
    - "alltoall" (MoEAlltoAllTokenDispatcher): permutation 1 gathers `own` rows by destination rank before
      the all-to-all; with more than one local expert, permutation 2 sorts the `recv` rows by local expert
      after it (sort_chunks_by_idxs) and sorts them back before the combine; unpermutation 1 sums the
      returned `own` rows into the tokens: 3 own + tokens (+ 4 recv) rows. This project's engine
      (runners/expert_parallel.py: sort by expert, all_to_all_single, group by local expert and back,
      index_add) runs the same passes.
    - "deepep" / "hybridep" (MoEFlexTokenDispatcher): the dispatch delivers each token once per rank, the
      `unique` tokens that have an expert here; one permutation spreads them to `recv` expert rows after
      it and one unpermutation sums those back before the combine (the source's sum is in the combine
      kernel): 3 recv + unique rows."""
    if dispatcher not in DISPATCHERS:
        raise ValueError(f"unknown MoE dispatcher {dispatcher!r}; choose from {', '.join(DISPATCHERS)}")
    row = activation_bytes_per_element(precision) * model.hidden_size
    k, local = model.num_experts_per_token, model.num_experts // ep
    recv = rows_per_expert(model, tokens=tokens, ep=ep, etp=etp, imbalance=imbalance) * local
    if dispatcher == "alltoall":
        return row * (3 * tokens * k + tokens + (4 * recv if local > 1 else 0.0))
    hit = share_of_groups_hit(num_experts=model.num_experts, top_k=k, group_experts=local)
    unique = recv * ep * hit / k  # a rank's tokens x ep x hit, scaled like its rows
    return row * (3 * recv + unique)


def permutation_times_s(model: ModelSpec, hw: Hardware, *, tokens: int, ep: int, etp: int = 1,
                        imbalance: float = 1.0, precision: str, dispatcher: str = "alltoall") -> MoETimes:
    """The MoE layer's bandwidth-bound work outside its GEMMs, forward and backward (twice the bytes): the
    router's softmax and top-k over tokens x E fp32 probabilities, the token permutations of the
    dispatcher (`permutation_bytes`) and the experts' SwiGLU (two rows x F inputs read, one written; the
    routing weights are applied inside it, Megatron-Core's weighted SwiGLU)."""
    p = activation_bytes_per_element(precision)
    rows = rows_per_expert(model, tokens=tokens, ep=ep, etp=etp, imbalance=imbalance) * model.num_experts / ep
    f = model.expert_ffn_hidden_size / etp
    router = 3 * 4 * tokens * model.num_experts
    permute = permutation_bytes(model, tokens=tokens, ep=ep, etp=etp, imbalance=imbalance, precision=precision,
                                dispatcher=dispatcher)
    swiglu = 3 * p * rows * f
    forward = memory_time_s(hw, router + permute + swiglu, num_kernels=6 + model.num_experts // ep)
    return MoETimes(forward_s=forward, backward_s=2 * forward)


# Transformer Engine's fp8 current scaling quantises a tensor in three kernels (transformer_engine/pytorch/
# csrc/quantizer.cpp, Float8CurrentScalingQuantizer::quantize_impl): its amax (nvte_compute_amax: the bf16
# tensor read, 2 bytes an element), the scale from it (one tiny kernel), and the cast (nvte_quantize_v2: the
# tensor read again, written as fp8 row-wise and, for the other GEMM of the pair, column-wise: Hopper's fp8
# GEMMs take only the TN layout, so the transpose is a second 1-byte copy).
FP8_AMAX_BYTES = 2
FP8_CAST_BYTES = 2 + 1 + 1


def fp8_quantize_times_s(model: ModelSpec, hw: Hardware, *, tokens: int, ep: int, etp: int = 1,
                         imbalance: float = 1.0) -> MoETimes:
    """Forward and backward seconds of the fp8 casts of one MoE layer's expert GEMM operands on one rank.

    Transformer Engine's GroupedLinear (Megatron-Core's TEGroupedMLP) splits its input by expert and
    quantises each expert's part on its own under current scaling (tex.split_quantize; csrc/extensions/
    cast.cpp multi_tensor_quantize_impl fuses the experts only for delayed scaling): per local expert, the
    fc1 input (rows x h) and fc2 input (rows x F) forward, the fc2 and fc1 output gradients (rows x h,
    rows x 2F of the gated fc1) backward, each at FP8_AMAX_BYTES + FP8_CAST_BYTES an element in three
    kernels. The weights' casts are cached across a step's micro-batches (Megatron passes
    is_first_microbatch) and not priced here."""
    rows = rows_per_expert(model, tokens=tokens, ep=ep, etp=etp, imbalance=imbalance)
    h, f = model.hidden_size, model.expert_ffn_hidden_size / etp

    def cast_s(width: float) -> float:
        elements = rows * width
        return (memory_time_s(hw, FP8_AMAX_BYTES * elements) + memory_time_s(hw, 0.0)
                + memory_time_s(hw, FP8_CAST_BYTES * elements))

    local = model.num_experts // ep
    return MoETimes(forward_s=local * (cast_s(h) + cast_s(f)), backward_s=local * (cast_s(h) + cast_s(2 * f)))


# Aten ops (views aside) runners/moe.py's MoE MLP dispatches beyond a dense MLP's (5 forward, 10 backward,
# which the layer's attention view already counts), (forward, backward): the routing (router GEMM, softmax,
# top-k sort, renormalisation, the per-sequence counts, the assignment order and bincount, the dispatch's
# regrouping and the combine's weighted index_add), each local expert's SwiGLU (its split, three GEMMs,
# silu, mul; backward the six GEMMs, the weight slices' gradients), the shared expert and its residual add,
# the load-balancing loss, Qwen2-MoE's shared gate, EP's receive buffers and expert TP's gather and
# reduce-scatter buffers and sum (the all-to-alls themselves are priced as collectives). Counted by
# dispatching tiny-moe's layer (tests/unit/test_cost_moe.py keeps them equal to the engine's).
MOE_ROUTING_OPS = (33 - 5, 22 - 10)
MOE_EXPERT_OPS = (5, 16)
MOE_SHARED_OPS = (6, 11)
MOE_AUX_OPS = (5, 5)
MOE_GATE_OPS = (3, 7)
MOE_EP_OPS = (3, 2)
MOE_ETP_OPS = (6, 4)


def moe_extra_ops(model: ModelSpec, *, ep: int, etp: int = 1) -> tuple[int, int]:
    """(forward, backward) ops one MoE layer's MLP launches on a rank beyond a dense MLP's: charged at the
    profile's op_overhead_s, as every op of this project's eager engine is (cost_models/estimate.py)."""
    parts = [(MOE_ROUTING_OPS, 1), (MOE_EXPERT_OPS, model.num_experts // ep),
             (MOE_SHARED_OPS, 1 if model.shared_expert_ffn_hidden_size else 0),
             (MOE_AUX_OPS, 1 if model.aux_loss_coeff > 0 else 0), (MOE_GATE_OPS, 1 if model.shared_expert_gate else 0),
             (MOE_EP_OPS, 1 if ep > 1 else 0), (MOE_ETP_OPS, 1 if etp > 1 else 0)]
    return (sum(ops[0] * n for ops, n in parts), sum(ops[1] * n for ops, n in parts))


def all_to_alls_per_layer(policy: str) -> int:
    """All-to-alls of one MoE layer per micro-batch: dispatch and combine forward and backward, and the
    forward pair again under full recomputation."""
    return 6 if policy == "full" else 4


def expert_params_per_device(model: ModelSpec, *, num_moe_layers: int, ep: int, etp: int) -> float:
    """Routed-expert parameters one rank holds for `num_moe_layers` MoE layers."""
    return num_moe_layers * model.num_experts // ep * model.expert_params() / etp


def expert_state_bytes(model: ModelSpec, *, num_moe_layers: int, ep: int, etp: int,
                       expert_shard_degrees: tuple[int, int, int], precision: str) -> float:
    """Weights, gradients and Adam states of a rank's experts, sharded over expert-DP at the plan's
    expert_shard_degrees (runners/sharding/ over the expert view of the mesh)."""
    s_p, s_g, s_os = expert_shard_degrees
    params = expert_params_per_device(model, num_moe_layers=num_moe_layers, ep=ep, etp=etp)
    return model_state_bytes(params, param_shard=s_p, grad_shard=s_g, optim_shard=s_os,
                             precision=precision).total_bytes


def moe_activation_bytes(model: ModelSpec, *, tokens: int, ep: int = 1, etp: int = 1, imbalance: float = 1.0,
                         precision: str) -> float:
    """Bytes one MoE layer's MLP keeps for backward per micro-batch without recomputation, as
    runners/moe.py keeps them: the fp32 router probabilities (tokens x E), the dispatched rows (tokens x k x
    h, by a rank's experts after the all-to-all), each expert's gate and up outputs and their SwiGLU
    product (3 x rows x F / etp), the combined rows before weighting (tokens x k x h), and the shared
    expert's input, gate, up and product."""
    p, h, k = activation_bytes_per_element(precision), model.hidden_size, model.num_experts_per_token
    rows = rows_per_expert(model, tokens=tokens, ep=ep, etp=etp, imbalance=imbalance) * model.num_experts / ep
    f = model.expert_ffn_hidden_size / etp
    routed = 4 * tokens * model.num_experts + p * (rows * h + 3 * rows * f + tokens * k * h)
    fs = model.shared_expert_ffn_hidden_size
    return routed + (p * tokens * (h + 3 * fs) if fs else 0.0)
