"""Search for the fastest plan that fits: enumerate, bound, price, rank.

    planner search --model llama3-70b --hardware h100 --gpus 1024 --global-batch 1024 --seq-len 4096

    from planner.search import search, SearchOptions
    result = search(problem, options=SearchOptions(top_k=5))

Branch and bound over the plan space. A *slot* fixes the degrees (dp, tp, pp, and cp with its kind),
virtual stages, schedule, micro-batch, recomputation and sequence parallelism; its *variants* add the DP sharding point (every
Lins point `lins_points`: ZeRO-0..3, HSDP and the mixes such as parameters and gradients inside a node with
optimizer states over all of DP), commshift and a uniform MAZ3 cache tier. Every slot gets a step-time lower bound from the per-layer
costs alone (the pipeline's compute critical path, no communication or bubble beyond it), and every
variant a memory lower bound (model states, ZeRO accounting, plus the activations the schedule keeps in
flight) and, from the cost model where it has one (`CostModel.step_time_lower_bounds`, the real model's
`cost_models.estimate.step_time_lower_bound_s`), a step-time lower bound of its own: the pipeline's
critical path over the variant's own action durations, exposed DP/ZeRO communication and SM contention
included, which the slot's bound cannot see. Slots and variants are taken best first by bound
(`_BranchAndBound.run`) and the search stops when the next bound cannot change the answer: beat the
k-th best plan found, or enter the few fitting plans the ILPs below start from (`_BranchAndBound.need_s`).
Exact whenever the bounds are true lower bounds of the cost model, which the tests check against brute
force, and the search counts any violation it sees (`bound_violations`).

The per-layer costs depend only on (tp, sequence parallel, micro-batch, cp, ep, etp), so they are computed once per
such key and shared by every slot, and handed to the estimate of each variant. The ILPs (planner/ilp.py) then refine the best few plans: unequal
stages and per-layer recomputation, and each layer's MAZ3 tier (`_refine_cache_with_ilp`). A variant
that only adds a cache tier or commshift to its plain plan is skipped when the plain plan's compute,
recomputation and optimizer time already cannot change the answer (`_BranchAndBound._cannot_help`).
"""

from __future__ import annotations

import functools
import heapq
import logging
import time
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable, Iterator

from cost_models.estimate import Estimate
from specs.schedule import rank_actions
from cost_models import moe as moe_cost
from specs.errors import PlannerError
from specs.problem import Problem
from specs.plan import CACHE_TIERS, RECOMPUTE, Plan

log = logging.getLogger(__name__)
GIB = 1024**3


@dataclass(frozen=True)
class CostModel:
    """The two pricing calls the search makes (the real ones in cost_models/estimate.py, or synthetic
    ones in tests): `estimate(plan, *, model, cluster, job) -> Estimate` and
    `layer_costs(plan, *, model, cluster, job) -> LayerCosts`."""

    estimate: Callable[..., Estimate]
    layer_costs: Callable[..., object]
    # `cache_cost_inputs(plan, *, model, cluster, job) -> CacheCostInputs` for the MAZ3 tier ILP; None
    # skips that refinement (synthetic cost models).
    cache_cost_inputs: Callable[..., object] | None = None
    # `step_time_lower_bounds(plans, *, model, cluster, job, costs) -> list[float]`, each never above its
    # plan's estimated step time: each variant's own bound (one call per slot, so that its variants may
    # share work), which orders and prunes variants the way the slot bound does slots; None: every
    # variant gets its slot's bound.
    step_time_lower_bounds: Callable[..., list[float]] | None = None
    # Whether `estimate` and `step_time_lower_bounds` take `costs=`, the layer costs the search computed once
    # per layer shape (`_Pricer.slot_costs`), instead of computing them again for every plan.
    takes_layer_costs: bool = False
    # The engine runs context parallelism with MoE layers (EngineModel.moe_context_parallel): the search
    # then tries cp > 1 for MoE models.
    moe_context_parallel: bool = False


def default_cost_model(engine: str = "ours") -> CostModel:
    """The real cost model, pricing plans as `engine` (cost_models/engines.py) runs them."""
    from cost_models import estimate as est
    from cost_models.engines import engine_model

    eng = engine_model(engine)  # an unknown engine is refused here, before any plan is priced
    return CostModel(estimate=functools.partial(est.estimate, engine=engine),
                     layer_costs=functools.partial(est.layer_costs, engine=engine),
                     cache_cost_inputs=functools.partial(est.cache_cost_inputs, engine=engine),
                     step_time_lower_bounds=functools.partial(est.step_time_lower_bounds_s, engine=engine),
                     takes_layer_costs=True, moe_context_parallel=eng.moe_context_parallel)


@dataclass(frozen=True)
class SearchOptions:
    top_k: int = 10
    max_virtual_stages: int = 8
    recompute: tuple[str, ...] = RECOMPUTE
    use_ilp: bool = True
    ilp_candidates: int = 3
    # Wall-clock cap per ILP solve; the best layout found by then is re-priced like any other plan.
    ilp_time_limit_s: float = 0.5
    # Price every candidate without bounds or pruning: the brute force the tests compare against.
    exhaustive: bool = False
    # Called with the number of plans priced so far (for a progress display).
    on_progress: Callable[[int], None] | None = None
    # Only plans with these (dp, tp, pp) (cp 1) or (dp, cp, tp, pp), e.g. to choose the sharding, schedule and
    # knobs of a fixed layout.
    degrees: tuple[int, ...] | None = None
    # Context parallelism is tried where every CP rank keeps at least this many tokens: below it a ring
    # step's attention is too short to hide its K/V, and the search would only price plans that lose.
    min_tokens_per_cp_rank: int = 4096

    def __post_init__(self) -> None:
        if self.top_k < 1 or self.max_virtual_stages < 1 or self.ilp_candidates < 0:
            raise ValueError(f"top_k and max_virtual_stages must be at least 1 and ilp_candidates at least 0, got "
                             f"{self.top_k}, {self.max_virtual_stages}, {self.ilp_candidates}")
        bad = [p for p in self.recompute if p not in RECOMPUTE]
        if bad or not self.recompute:
            raise ValueError(f"recompute policies must be a non-empty subset of {', '.join(RECOMPUTE)}, got {bad}")


@dataclass(frozen=True)
class Candidate:
    plan: Plan
    estimate: Estimate

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "estimate": self.estimate.to_dict()}


@dataclass(frozen=True)
class SearchResult:
    winner: Candidate
    candidates: tuple[Candidate, ...]  # fitting plans fastest first, then the rest by memory shortfall
    pareto: tuple[Candidate, ...]  # fitting plans no other plan beats on both step time and memory
    num_evaluated: int  # plans priced by the full cost model
    num_pruned_memory: int  # variants dropped without pricing by the memory bound (or `_cannot_help`)
    search_time_s: float
    bound_violations: int = 0  # priced plans faster than their lower bound (0 unless the cost model changed)


@dataclass(frozen=True)
class Slot:
    """Everything but the DP sharding variant; the unit of the time bound."""

    dp: int
    tp: int
    pp: int
    virtual_stages: int
    schedule: str
    micro_batch: int
    num_micro_batches: int
    recompute: str
    sequence_parallel: bool
    cp: int = 1
    cp_kind: str = "ring"
    ep: int = 1  # MoE models: expert-parallel degree, folded over tp x cp x dp
    etp: int = 1  # MoE models: expert tensor-parallel degree (each expert's FFN width over etp ranks)

    def plan(self, *, shards: tuple[int, int, int] = (1, 1, 1), cache: str = "none", commshift: bool = False) -> Plan:
        return Plan(dp=self.dp, tp=self.tp, pp=self.pp, cp=self.cp, cp_kind=self.cp_kind, ep=self.ep, etp=self.etp,
                    virtual_stages=self.virtual_stages,
                    micro_batch=self.micro_batch, num_micro_batches=self.num_micro_batches,
                    schedule=self.schedule, recompute=self.recompute, sequence_parallel=self.sequence_parallel,
                    param_shard=shards[0], grad_shard=shards[1], optim_shard=shards[2], param_cache=cache,
                    commshift=commshift)


# --- enumeration ---------------------------------------------------------------------------------------
def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def degree_options(problem: Problem) -> list[tuple[int, int, int]]:
    """Valid (dp, tp, pp): dp x tp x pp = devices, TP inside a node and dividing heads, KV heads and
    FFN, at most one layer per stage, and dp dividing the global batch."""
    model, n = problem.model, problem.cluster.num_devices
    out = []
    for tp in divisors(problem.cluster.devices_per_node):
        if n % tp or any(x % tp for x in (model.num_heads, model.num_kv_heads, model.ffn_hidden_size)):
            continue
        for pp in divisors(n // tp):
            dp = n // (tp * pp)
            if pp <= model.num_layers and problem.job.global_batch % dp == 0:
                out.append((dp, tp, pp))
    return out


def schedule_options(*, pp: int, num_micro_batches: int, num_layers: int, max_v: int) -> list[tuple[str, int]]:
    """(schedule, virtual stages) worth pricing for one pipeline depth and micro-batch count.

    Interleaving needs the micro-batches to divide by pp (Plan's rule) and, as in Megatron, the layers to
    divide by pp x v, or the layers plus two: Megatron-Core's account_for_embedding_in_pipeline_split and
    account_for_loss_in_pipeline_split count the embedding and the loss as a layer each
    (megatron/core/transformer/transformer_config.py, __post_init__; Megatron-Bridge's Llama 3.1 405B
    recipe sets both), so the first and last chunk hold one layer fewer, which is Plan.chunk_layer_counts'
    even split of such a count. GPipe has 1F1B's bubble and keeps all micro-batches in flight, so it can only tie
    or win when there are no more micro-batches than stages (then both keep every micro-batch in flight).
    """
    if pp == 1:
        return [("1f1b", 1)]
    out = [("1f1b", 1)]
    v = 2
    while v <= max_v and pp * v <= num_layers:
        if num_micro_batches % pp == 0 and (num_layers % (pp * v) == 0 or (num_layers + 2) % (pp * v) == 0):
            out.append(("interleaved-1f1b", v))
        v *= 2
    if num_micro_batches <= pp:
        out.append(("gpipe", 1))
    return out


def context_options(problem: Problem, *, min_tokens_per_rank: int = 4096) -> list[tuple[int, int, int, int, str]]:
    """Valid (dp, cp, tp, pp, cp kind) with cp > 1: the sequence splits into 2 x cp chunks of which each rank
    keeps at least `min_tokens_per_rank` tokens, dp divides the global batch, TP as in degree_options; every
    kind whose head split the model allows (all-to-all: heads and K/V heads per TP rank divisible by cp;
    hierarchical only where it is neither of the others, an all-to-all part strictly inside the CP group)."""
    model, job, n = problem.model, problem.job, problem.cluster.num_devices
    per_node = problem.cluster.devices_per_node
    out = []
    for tp in divisors(per_node):
        if n % tp or any(x % tp for x in (model.num_heads, model.num_kv_heads, model.ffn_hidden_size)):
            continue
        heads = (model.num_heads // tp, model.num_kv_heads // tp)
        for cp in divisors(n // tp)[1:]:
            if job.seq_len % (2 * cp) or job.seq_len // cp < min_tokens_per_rank:
                continue
            for pp in divisors(n // (tp * cp)):
                dp = n // (tp * cp * pp)
                if pp > model.num_layers or job.global_batch % dp:
                    continue
                kinds = ["ring"]
                if all(h % cp == 0 for h in heads):
                    kinds.append("all-to-all")
                inside = Plan(cp=cp, tp=tp, cp_kind="hierarchical").cp_split(ranks_per_node=per_node)[0]
                if 1 < inside < cp and all(h % inside == 0 for h in heads):
                    kinds.append("hierarchical")
                out.extend((dp, cp, tp, pp, kind) for kind in kinds)
    return out


def enumerate_slots(problem: Problem, options: SearchOptions, *, moe_context_parallel: bool = False) -> Iterator[Slot]:
    model, job = problem.model, problem.job
    layouts = [(dp, 1, tp, pp, "ring") for dp, tp, pp in degree_options(problem)]
    layouts += context_options(problem, min_tokens_per_rank=options.min_tokens_per_cp_rank)
    for dp, cp, tp, pp, kind in layouts:
        if options.degrees is not None and options.degrees not in ((dp, tp, pp) if cp == 1 else (), (dp, cp, tp, pp)):
            continue
        per_replica = job.global_batch // dp
        local_seq = job.seq_len // cp
        for mb in divisors(per_replica):
            m = per_replica // mb
            for schedule, v in schedule_options(pp=pp, num_micro_batches=m, num_layers=model.num_layers,
                                                max_v=options.max_virtual_stages):
                for rc in options.recompute:
                    for sp in ((False, True) if tp > 1 and local_seq % tp == 0 else (False,)):
                        for ep, etp in expert_options(problem, dp=dp, cp=cp, tp=tp, sequence_parallel=sp,
                                                      context_parallel=moe_context_parallel):
                            yield Slot(dp, tp, pp, v, schedule, mb, m, rc, sp, cp, kind, ep, etp)


def expert_options(problem: Problem, *, dp: int, cp: int, tp: int, sequence_parallel: bool,
                   context_parallel: bool = False) -> list[tuple[int, int]]:
    """The (ep, etp) degrees worth pricing for one layout: [(1, 1)] for a dense model; for an MoE model
    every ep that divides the experts and every etp that divides the attention's TP and the experts' FFN
    width (Megatron-Core's usual choices, 1 and tp, and those between: expert TP stays inside the TP
    group's node), with etp x ep folding over the tp x cp x dp ranks of a stage (specs/plan.py), where the
    engine runs it: CP only where `context_parallel` (Megatron-Core and this project's engine) and, like
    TP, not with a capacity factor (the engine drops per whole sequence, in position order), TP only with
    sequence parallelism (each TP rank routes its own tokens)."""
    model = problem.model
    if not model.is_moe:
        return [(1, 1)]
    if (cp > 1 and (not context_parallel or model.capacity_factor > 0)) or (
            tp > 1 and (not sequence_parallel or model.capacity_factor > 0)):
        return []
    etps = [t for t in divisors(tp) if model.expert_ffn_hidden_size % t == 0]
    return [(ep, etp) for etp in etps for ep in divisors(model.num_experts) if (tp * cp * dp) % (ep * etp) == 0]


def _fills_nodes(degree: int, *, dp: int, dp_per_node: int) -> bool:
    """A sharding group of `degree` consecutive DP positions fills a node before it spans nodes: it
    divides the DP ranks of a node (stays inside one) or is a multiple of them (whole nodes). Degrees 1
    and dp are always allowed (ZeRO's points)."""
    return degree in (1, dp) or dp_per_node % degree == 0 or degree % dp_per_node == 0


def lins_points(dp: int, *, dp_per_node: int) -> list[tuple[int, int, int]]:
    """Every (s_p, s_g, s_os) of Lins' rule (Chen et al., IWQoS 2024; AMSP, arXiv 2311.00257) over `dp`
    ranks with `dp_per_node` of them in a node: s_p | s_g | s_os | dp, s_g equal to s_p or s_os, each
    degree filling a node before spanning nodes (so each factors into an intra-node part and an
    inter-node part). ZeRO-0..3 and HSDP/MiCS (g, g, g) are points of it."""
    degrees = [d for d in divisors(dp) if _fills_nodes(d, dp=dp, dp_per_node=dp_per_node)]
    points = []
    for s_p in degrees:
        for s_os in degrees:
            if s_os % s_p:
                continue
            for s_g in sorted({s_p, s_os}):
                points.append((s_p, s_g, s_os))
    return points


def sharding_variants(slot: Slot, *, devices_per_node: int) -> list[tuple[tuple[int, int, int], str, bool]]:
    """(shard degrees, cache tier, commshift) for one slot: every Lins point (`lins_points`), each
    uniform MAZ3 cache tier on the points with one sharding group (s_p = s_g = s_os > 1; the ILP then
    mixes tiers per layer for the best plans of any point), commshift where pp > 1 and dp > 1."""
    dp = slot.dp * slot.cp  # CP ranks shard and reduce gradients with DP's (runners/mesh.py)
    if dp == 1:
        return [((1, 1, 1), "none", False)]
    dp_per_node = max(1, min(dp, devices_per_node // slot.tp))
    shifts = (False, True) if slot.pp > 1 and slot.dp * slot.cp > 1 else (False,)
    out = []
    for shards in lins_points(dp, dp_per_node=dp_per_node):
        # Uniform tiers on the points where parameters, gradients and states share one group (ZeRO-3,
        # HSDP): the ~dp^2 mixed points would multiply the priced plans by four; the ILP still gives
        # the best plans of any point their per-layer tiers (_refine_cache_with_ilp).
        uniform = shards[0] > 1 and shards[0] == shards[2]
        for cache in (CACHE_TIERS if uniform else ("none",)):
            out.extend((shards, cache, shift) for shift in shifts)
    return out


# --- bounds --------------------------------------------------------------------------------------------
def _saturated_micro_batches(schedule: str, pp: int, m: int) -> int:
    """Micro-batches enough to reach every rank's peak in flight: 1F1B's warm-up holds at most pp,
    interleaving's at most (v + 1) pp virtual micro-batches, reached within 4 pp micro-batches (as
    cost_models/estimate.py's memory timeline assumes); more only repeat the steady state. GPipe holds
    them all. Fewer actions can never raise the peak, so the memory bound stays a lower bound."""
    return m if schedule == "gpipe" else min(m, 4 * pp)


@lru_cache(maxsize=4096)
def rank_in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[int, ...]:
    """Most micro-batch chunk activations each pipeline rank holds at once under the schedule."""
    out = []
    m = _saturated_micro_batches(schedule, pp, m)
    for actions in rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m):
        live = peak = 0
        for a in actions:
            live += 1 if a.kind == "F" else -1
            peak = max(peak, live)
        out.append(peak)
    return tuple(out)


@lru_cache(maxsize=4096)
def chunk_in_flight(schedule: str, pp: int, v: int, m: int) -> tuple[int, ...]:
    """Per chunk: the most micro-batches whose activations it holds at once (for the ILP, which prices
    each chunk's layers separately; summing these over a rank's chunks over-counts, never under)."""
    peaks = [0] * (pp * v)
    m = _saturated_micro_batches(schedule, pp, m)
    for actions in rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m):
        live = [0] * (pp * v)
        for a in actions:
            live[a.chunk] += 1 if a.kind == "F" else -1
            peaks[a.chunk] = max(peaks[a.chunk], live[a.chunk])
    return tuple(peaks)


@lru_cache(maxsize=4096)
def chunk_counts(num_layers: int, pp: int, v: int) -> tuple[int, ...]:
    schedule = "interleaved-1f1b" if v > 1 else "1f1b"
    return Plan(pp=pp, virtual_stages=v, schedule=schedule, num_micro_batches=pp).chunk_layer_counts(num_layers)


def time_lower_bound_s(slot: Slot, costs, *, num_layers: int) -> float:
    """A step can be no shorter than its pipeline's compute critical path.

    Rank r runs m micro-batches through its chunks, and before its first forward (after its last
    backward) the chunks before its first chunk, chunk r, must run forward (backward) for one micro-
    batch: step >= max_r [m T_r + sum_{c<r} T_c] with T the per-micro-batch forward+backward time. For
    equal stages this is the classic (m + pp - 1) T of GPipe/1F1B, and (m + (pp - 1)/v) T_rank for
    interleaving (Narayanan et al., SC21, sec. 2.2). Communication and the optimizer only add to it.
    """
    counts = chunk_counts(num_layers, slot.pp, slot.virtual_stages)
    t_layer = costs.time_s[slot.recompute]
    chunk_t = [n * t_layer for n in counts]
    chunk_t[0] += costs.first_extra_time_s
    chunk_t[-1] += costs.last_extra_time_s
    rank_t = [sum(chunk_t[r::slot.pp]) for r in range(slot.pp)]
    return max(slot.num_micro_batches * rank_t[r] + sum(chunk_t[:r]) for r in range(slot.pp))


def state_bytes_per_param(precision: str) -> tuple[int, int, int]:
    """(weights, gradients, optimizer) bytes per parameter with Adam: 2 + 2 + 12 in mixed precision,
    4 + 4 + 8 in fp32 (Rajbhandari et al., ZeRO, SC20, sec. 3.1)."""
    return (4, 4, 8) if precision == "fp32" else (2, 2, 12)


@dataclass(frozen=True)
class SlotMemory:
    """What the memory bound of a slot's variants needs: per rank, parameters per device (all split by
    TP, the lowest any split can give) and the activations its schedule keeps in flight."""

    rank_params: tuple[float, ...]
    rank_activation_bytes: tuple[float, ...]

    def lower_bound_bytes(self, shards: tuple[int, int, int], precision: str) -> float:
        w, g, o = state_bytes_per_param(precision)
        per_param = w / shards[0] + g / shards[1] + o / shards[2]
        return max(p * per_param + a for p, a in zip(self.rank_params, self.rank_activation_bytes))


def slot_memory(slot: Slot, costs, problem: Problem) -> SlotMemory:
    model = problem.model
    counts = chunk_counts(model.num_layers, slot.pp, slot.virtual_stages)
    num_chunks = len(counts)
    params, acts = [], []
    live = rank_in_flight(slot.schedule, slot.pp, slot.virtual_stages, slot.num_micro_batches)
    for r in range(slot.pp):
        chunks = range(r, num_chunks, slot.pp)
        n = sum(counts[c] for c in chunks)
        ends = (model.embedding_params() if 0 in chunks else 0) + (model.head_params() if num_chunks - 1 in chunks else 0)
        if model.is_moe:
            # Non-expert parameters as the estimate holds them, experts split over EP (under the dense
            # shards, at least as many as the experts' own: a lower bound).
            experts = moe_cost.moe_fraction(model) * moe_cost.expert_params_per_device(
                model, num_moe_layers=1, ep=slot.ep, etp=slot.etp)
            params.append(n * (moe_cost.nonexpert_layer_params_per_device(model, tp=slot.tp) + experts) + ends / slot.tp)
        else:
            params.append((n * model.layer_params() + ends) / slot.tp)
        # The rank holds `live` chunk activations at its peak, each at least its smallest chunk's.
        acts.append(live[r] * min(counts[c] for c in chunks) * costs.activation_bytes[slot.recompute])
    return SlotMemory(tuple(params), tuple(acts))


# --- the search ------------------------------------------------------------------------------------------
class _Pricer:
    """Calls the cost model, counting full estimates and caching per-layer costs per (tp, sp, mb)."""

    def __init__(self, problem: Problem, cost: CostModel, on_progress: Callable[[int], None] | None) -> None:
        self.problem, self.cost, self.on_progress = problem, cost, on_progress
        self.layer_cache: dict[tuple, object] = {}
        self.num_evaluated = 0

    def _kwargs(self) -> dict:
        p = self.problem
        return {"model": p.model, "cluster": p.cluster, "job": p.job}

    def slot_costs(self, slot: Slot):
        # Per-layer time and activations depend on the layer's shape on one device (tp, sequence
        # parallelism, micro-batch), not on how many replicas or stages there are; unsharded states give
        # the smallest per-layer time, so the bound stays a lower bound for every sharding variant.
        key = (slot.tp, slot.sequence_parallel, slot.micro_batch, slot.cp, slot.cp_kind, slot.ep, slot.etp)
        if self.problem.model.is_moe:
            # The EP overlap hides dispatch and combine in the passes the schedule pairs (estimate.paired_share).
            key += (slot.pp, slot.virtual_stages, slot.num_micro_batches)
        if key not in self.layer_cache:
            self.layer_cache[key] = self.cost.layer_costs(slot.plan(), **self._kwargs())
        return self.layer_cache[key]

    def layer_costs(self, plan: Plan):
        return self.cost.layer_costs(plan, **self._kwargs())

    def _kwargs_for(self, slot: Slot | None) -> dict:
        # The slot's layer costs stand for every variant's: the estimate reads only their times and
        # activations, which the sharding variant does not change (cost_models/estimate.estimate).
        if slot is None or not self.cost.takes_layer_costs:
            return self._kwargs()
        return {**self._kwargs(), "costs": self.slot_costs(slot)}

    def price(self, plan: Plan, slot: Slot | None = None) -> Candidate:
        """The full estimate of `plan` (one of `slot`'s variants, if given)."""
        self.num_evaluated += 1
        if self.on_progress is not None and self.num_evaluated % 64 == 0:
            self.on_progress(self.num_evaluated)
        return Candidate(plan, self.cost.estimate(plan, **self._kwargs_for(slot)))

    def variant_bounds(self, plans: list[Plan], slot: Slot, slot_bound: float) -> list[float]:
        """For each of the slot's variants, the larger of the slot's bound and the cost model's own bound
        for it (both lower bounds)."""
        if self.cost.step_time_lower_bounds is None or not plans:
            return [slot_bound] * len(plans)
        return [max(slot_bound, b) for b in self.cost.step_time_lower_bounds(plans, **self._kwargs_for(slot))]


def search(problem: Problem, *, options: SearchOptions = SearchOptions(), cost: CostModel | None = None) -> SearchResult:
    """The fastest plans that fit, ranked, with the throughput-memory Pareto front.

    Raises PlannerError when no plan fits, naming the least memory per device any plan needs.
    """
    start = time.perf_counter()
    pricer = _Pricer(problem, cost or default_cost_model(), options.on_progress)
    bounded = []
    slots = enumerate_slots(problem, options, moe_context_parallel=pricer.cost.moe_context_parallel)
    for i, slot in enumerate(slots):
        bounded.append((time_lower_bound_s(slot, pricer.slot_costs(slot), num_layers=problem.model.num_layers), i, slot))
    if not bounded:
        raise PlannerError(f"no valid degrees for {problem.cluster.num_devices} devices: dp x tp x pp must equal the "
                           f"device count with tp inside a node dividing the heads and dp dividing the global "
                           f"batch {problem.job.global_batch}")
    bounded.sort(key=lambda item: (item[0], item[1]))
    state = _BranchAndBound(problem, pricer, options)
    state.run(bounded)
    if not state.fitting:
        raise PlannerError(state.nothing_fits_message())
    priced = state.priced
    if options.use_ilp:
        priced = priced + _refine_with_ilp(sorted(state.fitting, key=_speed), pricer, problem, options)
        priced = priced + _refine_cache_with_ilp(sorted((c for c in priced if c.estimate.fits), key=_speed),
                                                 pricer, problem, options)
    # The ILP may turn a plan into one already priced (e.g. a per-layer mix that is all one policy).
    priced = list({c.plan: c for c in reversed(priced)}.values())
    fitting = sorted((c for c in priced if c.estimate.fits), key=_speed)
    rest = sorted((c for c in priced if not c.estimate.fits), key=lambda c: c.estimate.memory_shortfall_bytes)
    return SearchResult(winner=fitting[0], candidates=tuple(fitting + rest), pareto=pareto_front(fitting),
                        num_evaluated=pricer.num_evaluated, num_pruned_memory=state.num_pruned,
                        search_time_s=time.perf_counter() - start, bound_violations=state.violations)


def _has_layout(pp: int, recompute: str) -> bool:
    """Whether the layout ILP (`_refine_with_ilp`) may refine a plan: more than one stage, or recomputation."""
    return not (pp == 1 and recompute == "none")


def _push_best(negated: list[float], step_time_s: float, *, keep: int) -> None:
    """Keep the `keep` smallest step times in a max-heap of negated times."""
    heapq.heappush(negated, -step_time_s)
    if len(negated) > keep:
        heapq.heappop(negated)


def _speed(c: Candidate) -> tuple:
    """Rank by step time, then memory, then, on a tie, the plan with fewer knobs turned on (a knob the
    cost model says buys nothing is one less thing to run)."""
    p = c.plan
    extras = (p.commshift, p.param_cache != "none", p.recompute_layers is not None, p.stage_layers is not None)
    return (c.estimate.step_time_s, c.estimate.peak_memory_bytes, sum(extras))


class _BranchAndBound:
    """The mutable state of one search call: what was priced, the k best that fit, what was pruned."""

    def __init__(self, problem: Problem, pricer: _Pricer, options: SearchOptions) -> None:
        self.problem, self.pricer, self.options = problem, pricer, options
        hw = problem.cluster.hardware
        self.limit_bytes = float(hw.memory_bytes) * (1.0 - problem.job.headroom(hw.device_type))
        self.priced: list[Candidate] = []
        self.fitting: list[Candidate] = []
        self.top_times: list[float] = []  # negated step times of the k fastest fitting plans (a max-heap)
        self.pruned: list[tuple[float, Slot]] = []
        self.num_pruned = 0
        self.violations = 0
        self.num_queued = 0
        # Negated step times of the best fitting plans the ILPs may start from (see need_s), max-heaps.
        self.layout_times: list[float] = []
        self.base_times: list[float] = []
        self.base_best: dict[Plan, float] = {}
        # Each slot's plain variants (no MAZ3 tier, no commshift) once priced, by (slot, shard degrees).
        self.plain: dict[tuple[Slot, tuple[int, int, int]], Candidate] = {}

    def need_s(self, *, layout: bool, sharded: bool) -> float:
        """The step time a plan must beat to change the search's answer: enter the top k, or, for the ILPs
        (`search`), the best `ilp_candidates` fitting plans with a layout to re-place (`layout`: pp > 1
        or recomputation) or the best `ilp_candidates` sharded bases the MAZ3 ILP starts from
        (`sharded`: param_shard > 1). Those seeds are ranked among all fitting plans, so a bound that only
        kept the top k exact could change them. inf while any of those lists is short."""
        if self.options.exhaustive:
            return float("inf")
        need = -self.top_times[0] if len(self.top_times) >= self.options.top_k else float("inf")
        if self.options.use_ilp and self.options.ilp_candidates > 0:
            if layout:
                need = max(need, self._nth_or_inf(self.layout_times))
            if sharded:
                need = max(need, self._nth_or_inf(self.base_times))
        return need

    def _nth_or_inf(self, negated: list[float]) -> float:
        return -negated[0] if len(negated) >= self.options.ilp_candidates else float("inf")

    def need_for_slot(self, slot: Slot) -> float:
        return self.need_s(layout=_has_layout(slot.pp, slot.recompute), sharded=slot.dp * slot.cp > 1)

    def need_for_plan(self, plan: Plan) -> float:
        return self.need_s(layout=_has_layout(plan.pp, plan.recompute), sharded=plan.param_shard > 1)

    def run(self, bounded: list[tuple[float, int, Slot]]) -> None:
        """Best first over slots and their variants, by bound, until no bound left can change the answer.

        `bounded` holds the slots by their bound. A slot taken from it is expanded into its variants
        that may fit, each queued under its own bound (`_Pricer.variant_bound`, at least the slot's);
        whichever is lower, the next slot's bound or the queue's first variant's, is taken next. A slot
        or variant is dropped when its bound is at least what it must beat (`need_for_slot`,
        `need_for_plan`, never above `need_s(layout=True, sharded=True)`, where the search stops). Every
        plan not priced then has a bound (its own, or its slot's) at least that, so, the bounds being
        lower bounds, it can enter neither the top k nor the ILPs' seeds: those are the exhaustive
        search's. With no bound of its own a variant is queued under its slot's and comes straight
        after it, as the variants of one slot came before."""
        queue: list[tuple[float, int, Slot, Plan]] = []
        next_slot = 0
        while True:
            slot_bound = bounded[next_slot][0] if next_slot < len(bounded) else float("inf")
            if queue and queue[0][0] <= slot_bound:
                bound, _, slot, plan = heapq.heappop(queue)
                if bound >= self.need_s(layout=True, sharded=True):
                    return
                if bound < self.need_for_plan(plan):
                    self.visit_variant(slot, plan, bound)
                continue
            if next_slot == len(bounded) or slot_bound >= self.need_s(layout=True, sharded=True):
                return
            slot = bounded[next_slot][2]
            next_slot += 1
            if slot_bound >= self.need_for_slot(slot):
                continue
            for plan, bound in self.expand(slot, slot_bound):
                heapq.heappush(queue, (bound, self.num_queued, slot, plan))
                self.num_queued += 1

    def expand(self, slot: Slot, bound: float) -> list[tuple[Plan, float]]:
        """The slot's variants that the memory bound lets through, each with its time bound."""
        memory = slot_memory(slot, self.pricer.slot_costs(slot), self.problem)
        variants = sharding_variants(slot, devices_per_node=self.problem.cluster.devices_per_node)
        precision = self.problem.job.precision
        leanest = min(memory.lower_bound_bytes(shards, precision) for shards, _, _ in variants)
        if leanest > self.limit_bytes and not self.options.exhaustive:
            self.pruned.append((leanest, slot))
            self.num_pruned += len(variants)
            return []
        plans = []
        for shards, cache, shift in variants:
            if memory.lower_bound_bytes(shards, precision) > self.limit_bytes and not self.options.exhaustive:
                self.num_pruned += 1
                continue
            plans.append(slot.plan(shards=shards, cache=cache, commshift=shift))
        if self.options.exhaustive:
            return [(plan, bound) for plan in plans]
        return list(zip(plans, self.pricer.variant_bounds(plans, slot, bound)))

    def visit_variant(self, slot: Slot, plan: Plan, bound: float) -> None:
        shards = (plan.param_shard, plan.grad_shard, plan.optim_shard)
        plain = plan.param_cache == "none" and not plan.commshift
        base = None if plain else self.plain.get((slot, shards))
        if base is not None and self._cannot_help(base):
            self.num_pruned += 1
            return
        cand = self.pricer.price(plan, slot)
        if plain:
            self.plain[(slot, shards)] = cand
        self.add(cand, bound)

    def _cannot_help(self, base: Candidate) -> bool:
        """Whether a MAZ3 tier or commshift on top of `base` (the same plan without them, priced first)
        can be skipped: neither changes compute, recomputation or the optimizer, so the critical rank's
        sum of those bounds the variant from below, and the variant cannot change the answer if that sum
        is at least what it must beat (the same as `base`'s: it has the same layout and sharding)."""
        est = base.estimate
        floor_s = est.breakdown.get("compute_s", 0.0) + est.breakdown.get("recompute_s", 0.0) + est.breakdown.get(
            "optimizer_s", 0.0)
        return floor_s >= self.need_for_plan(base.plan)

    def add(self, cand: Candidate, bound: float) -> None:
        est = cand.estimate
        # The cost model's own limit (it may hold some memory back) prunes at least as much.
        self.limit_bytes = min(self.limit_bytes, float(est.memory_limit_bytes))
        if est.step_time_s < bound * (1 - 1e-9):
            self.violations += 1
            log.warning("step time %.6g s of %s is below its lower bound %.6g s", est.step_time_s,
                        cand.plan.describe(), bound)
        self.priced.append(cand)
        if not est.fits:
            return
        self.fitting.append(cand)
        _push_best(self.top_times, est.step_time_s, keep=self.options.top_k)
        plan = cand.plan
        if _has_layout(plan.pp, plan.recompute):
            _push_best(self.layout_times, est.step_time_s, keep=max(1, self.options.ilp_candidates))
        if plan.param_shard > 1:
            # The MAZ3 ILP's seeds are distinct bases (the plan without its tiers), each at its best time.
            base = plan.replace(param_cache="none")
            if est.step_time_s < self.base_best.get(base, float("inf")):
                self.base_best[base] = est.step_time_s
                keep = max(1, self.options.ilp_candidates)
                self.base_times = [-t for t in heapq.nsmallest(keep, self.base_best.values())]
                heapq.heapify(self.base_times)

    def nothing_fits_message(self) -> str:
        """Find the least peak memory any plan needs (pricing pruned slots in order of their bound
        while they could still need less) and say it in one line."""
        leanest = min(self.priced, key=lambda c: c.estimate.peak_memory_bytes, default=None)
        precision = self.problem.job.precision
        for lower, slot in sorted(self.pruned, key=lambda item: item[0]):
            if leanest is not None and lower >= leanest.estimate.peak_memory_bytes:
                break
            memory = slot_memory(slot, self.pricer.slot_costs(slot), self.problem)
            for shards, cache, shift in sharding_variants(slot, devices_per_node=self.problem.cluster.devices_per_node):
                if leanest is not None and memory.lower_bound_bytes(shards, precision) >= leanest.estimate.peak_memory_bytes:
                    continue
                cand = self.pricer.price(slot.plan(shards=shards, cache=cache, commshift=shift))
                if leanest is None or cand.estimate.peak_memory_bytes < leanest.estimate.peak_memory_bytes:
                    leanest = cand
        est = leanest.estimate
        hw = self.problem.cluster.hardware
        headroom = self.problem.job.headroom(hw.device_type)
        room = f" ({format_bytes(hw.memory_bytes)} less the {headroom:.0%} memory headroom)" if headroom else ""
        return (f"no plan fits in {format_bytes(est.memory_limit_bytes)} per device{room}; the leanest "
                f"({leanest.plan.describe()}) needs {format_bytes(est.peak_memory_bytes)} per device")


def format_bytes(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.1f} GiB" if num_bytes >= GIB else f"{num_bytes / 2**20:.1f} MiB"


# Step times (and memories) that agree within this fraction are one to the cost model: a tenth of its error
# against measured runs (README: 5-10% after calibration).
SAME_PLAN_TOLERANCE = 0.01
# The knobs that make a plan's layout: its degrees and how the batch is split. Plans that share them differ
# in refinements (recomputation, sharding point, MAZ3 tiers, unequal stages, commshift, buckets, prefetch).
_LAYOUT = ("dp", "cp", "cp_kind", "tp", "pp", "virtual_stages", "schedule", "micro_batch", "num_micro_batches", "sequence_parallel")


@dataclass(frozen=True)
class DistinctPlan:
    """A ranked plan and the plans collapsed into it (see distinct_plans)."""

    candidate: Candidate
    alike: tuple[Candidate, ...] = ()

    def differing_knobs(self) -> list[str]:
        """The plan fields in which the collapsed plans differ from this one."""
        mine = self.candidate.plan
        return [f for f in mine.__dataclass_fields__
                if any(getattr(c.plan, f) != getattr(mine, f) for c in self.alike)]


def distinct_plans(candidates, *, limit: int, tolerance: float = SAME_PLAN_TOLERANCE) -> list[DistinctPlan]:
    """The first `limit` plans of a ranking (fastest first) that the cost model tells apart. A plan collapses
    into an earlier kept one when its step time is within `tolerance` of it and it has the same layout
    (only refinements differ, which then buy nothing measurable), or when its step time and peak memory
    both are (the ranking puts the plan with fewer knobs turned on first, `_speed`)."""
    kept: list[tuple[Candidate, list[Candidate]]] = []

    def close(a: float, b: float) -> bool:
        return abs(a - b) <= tolerance * max(abs(a), abs(b), 1e-30)

    def alike(c: Candidate, first: Candidate) -> bool:
        if not close(c.estimate.step_time_s, first.estimate.step_time_s):
            return False
        same_layout = all(getattr(c.plan, f) == getattr(first.plan, f) for f in _LAYOUT)
        return same_layout or close(c.estimate.peak_memory_bytes, first.estimate.peak_memory_bytes)

    for c in candidates:
        group = next((group for first, group in kept if alike(c, first)), None)
        if group is not None:
            group.append(c)
        elif len(kept) < limit:
            kept.append((c, []))
    return [DistinctPlan(first, tuple(group)) for first, group in kept]


def pareto_front(candidates: list[Candidate]) -> tuple[Candidate, ...]:
    """Plans no other plan beats on both step time and peak memory, least memory first."""
    front: list[Candidate] = []
    for c in sorted(candidates, key=lambda c: (c.estimate.peak_memory_bytes, c.estimate.step_time_s)):
        if not front or c.estimate.step_time_s < front[-1].estimate.step_time_s:
            front.append(c)
    return tuple(front)


# --- ILP refinement --------------------------------------------------------------------------------------
def _refine_with_ilp(ranked: list[Candidate], pricer: _Pricer, problem: Problem,
                     options: SearchOptions) -> list[Candidate]:
    """Re-place layers (unequal stages) and choose recomputation per layer for the best few plans,
    keeping a refined plan only if the full cost model says it fits."""
    out: list[Candidate] = []
    seen: set[Plan] = set()
    for cand in ranked:
        if len(seen) >= options.ilp_candidates:
            break
        plan = cand.plan
        if plan.pp == 1 and plan.recompute == "none":
            continue  # one stage and nothing recomputed: no layout or policy to improve
        seen.add(plan)
        refined = _ilp_layout(cand, pricer, problem, time_limit_s=options.ilp_time_limit_s)
        if refined is not None:
            out.append(refined)
    return out


def _stage_costs(plan: Plan, costs, problem: Problem, *, memory_cap_bytes: float):
    from planner.ilp import StageCosts

    in_flight = chunk_in_flight(plan.schedule, plan.pp, plan.virtual_stages, plan.num_micro_batches)
    return StageCosts(
        num_layers=problem.model.num_layers, pp=plan.pp, num_chunks=plan.num_chunks,
        time_s=dict(costs.time_s), activation_bytes=dict(costs.activation_bytes),
        state_bytes=float(costs.state_bytes), in_flight=in_flight, memory_cap_bytes=memory_cap_bytes,
        first_extra_time_s=costs.first_extra_time_s, last_extra_time_s=costs.last_extra_time_s,
        # The embedding's and head's states and buffers, plus what they keep per micro-batch in flight.
        first_extra_bytes=costs.first_extra_bytes + in_flight[0] * getattr(costs, "first_extra_activation_bytes", 0.0),
        last_extra_bytes=costs.last_extra_bytes + in_flight[-1] * getattr(costs, "last_extra_activation_bytes", 0.0))


def _ilp_layout(cand: Candidate, pricer: _Pricer, problem: Problem, *, time_limit_s: float) -> Candidate | None:
    """One ILP refinement of `cand`; None when it cannot improve or its result does not fit.

    The ILP sees only layer states, activations and the ends; everything else the cost model counts
    (buffers, caches, reserve) is taken as fixed: the gap between the estimate's peak and the ILP's own
    count for the current layout. If the full model disagrees, retry once with the cap lowered by the
    shortfall.
    """
    from planner.ilp import balance_stages, layout_bottleneck_s, layout_memory_bytes

    plan = cand.plan
    costs = pricer.layer_costs(plan)
    current = [{plan.recompute: n} for n in plan.chunk_layer_counts(problem.model.num_layers)]
    probe = _stage_costs(plan, costs, problem, memory_cap_bytes=0.0)
    other_bytes = cand.estimate.peak_memory_bytes - max(layout_memory_bytes(probe, current))
    cap = cand.estimate.memory_limit_bytes - other_bytes
    for _ in range(2):
        try:
            layout = balance_stages(_stage_costs(plan, costs, problem, memory_cap_bytes=cap), time_limit_s=time_limit_s)
        except PlannerError:
            return None
        if layout.bottleneck_time_s >= layout_bottleneck_s(probe, current) * (1 - 1e-6):
            return None
        policies = set(layout.recompute_layers)
        even = layout.stage_layers == plan.chunk_layer_counts(problem.model.num_layers)
        new_plan = plan.replace(stage_layers=None if even else layout.stage_layers,
                                recompute=policies.pop() if len(policies) == 1 else plan.recompute,
                                recompute_layers=None if len(set(layout.recompute_layers)) == 1 else layout.recompute_layers)
        if new_plan == plan:
            return None
        refined = pricer.price(new_plan)
        if refined.estimate.fits:
            # Keep it only for a real gain: a rounding-level one would add a look-alike to the ranking.
            return refined if refined.estimate.step_time_s < cand.estimate.step_time_s * (1 - 1e-6) else None
        cap -= refined.estimate.memory_shortfall_bytes
    return None


def _cache_ilp_inputs(plan: Plan, inputs, problem: Problem, *, device_cap_bytes: float):
    from planner.ilp import CacheCosts

    layer_chunk = tuple(c for c, n in enumerate(inputs.chunk_layers) for _ in range(n))
    num_layers = len(layer_chunk)
    return CacheCosts(
        fetch_s=(dict(inputs.fetch_s),) * num_layers, forward_extra_s=(dict(inputs.forward_extra_s),) * num_layers,
        device_bytes=(dict(inputs.device_bytes),) * num_layers, host_bytes=(dict(inputs.host_bytes),) * num_layers,
        layer_chunk=layer_chunk, pp=plan.pp, backward_window_s=inputs.backward_window_s,
        forward_window_s=inputs.forward_window_s, num_micro_batches=plan.num_micro_batches,
        device_cap_bytes=(max(0.0, device_cap_bytes),) * plan.pp,
        host_cap_bytes=(float(problem.cluster.hardware.host_memory_bytes),) * plan.pp)


def _refine_cache_with_ilp(ranked: list[Candidate], pricer: _Pricer, problem: Problem,
                           options: SearchOptions) -> list[Candidate]:
    """MAZ3 for the best few plans with sharded parameters: choose each layer's tier with the ILP
    (planner/ilp.py `choose_param_cache`) on the plan without caching, and keep the result if the full
    cost model says it fits and is faster. The device cap is the memory the cache-free plan leaves
    free on its worst rank (taken for every rank: never more than a rank has); if the full model
    disagrees, retry once with the cap lowered by the shortfall."""
    from planner.ilp import choose_param_cache

    if pricer.cost.cache_cost_inputs is None:
        return []
    out: list[Candidate] = []
    seen: set[Plan] = set()
    for cand in ranked:
        if len(seen) >= options.ilp_candidates:
            break
        base = cand.plan.replace(param_cache="none")
        if base.param_shard == 1 or base in seen:
            continue
        seen.add(base)
        plain = cand if cand.plan == base else pricer.price(base)
        inputs = pricer.cost.cache_cost_inputs(base, model=problem.model, cluster=problem.cluster, job=problem.job)
        cap = plain.estimate.memory_limit_bytes - plain.estimate.peak_memory_bytes
        for _ in range(2):
            try:
                choice = choose_param_cache(_cache_ilp_inputs(base, inputs, problem, device_cap_bytes=cap),
                                            time_limit_s=options.ilp_time_limit_s)
            except PlannerError:
                break
            tiers = set(choice.tiers)
            plan = base.replace(param_cache=tiers.pop() if len(tiers) == 1 else choice.tiers)
            if plan == cand.plan:
                break
            refined = pricer.price(plan)
            if refined.estimate.fits:
                if refined.estimate.step_time_s < cand.estimate.step_time_s * (1 - 1e-6):
                    out.append(refined)
                break
            cap -= refined.estimate.memory_shortfall_bytes
    return out
