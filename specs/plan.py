"""The plan: how one training job is parallelised. The common language of search, cost model and runner.

A frozen, hashable dataclass that checks itself on construction (`__post_init__`) and against a model,
cluster and job (`check_plan`). JSON round-trips it exactly (`to_dict` / `from_dict`).

Data-parallel sharding is three degrees over the DP group (Lins' s_p, s_g, s_os): parameters are sharded
over groups of `param_shard` DP ranks, gradients over `grad_shard`, optimizer states over `optim_shard`,
each dividing the next and the gradient-reduction group. The ZeRO stages are named points: ZeRO-0 (1, 1, 1),
ZeRO-1 (1, 1, dp), ZeRO-2 (1, dp, dp), ZeRO-3 (dp, dp, dp); HSDP/MiCS is (g, g, g) with g inside a node.

Context parallelism (cp > 1) splits every sequence over cp ranks that hold the same parameters, so their
gradients are reduced together with DP's, as Megatron-LM's data-parallel-with-CP group does: the
gradient-reduction (and sharding) group is dp x cp ranks (`dp_cp`), and "dp" in the ZeRO points above
reads dp x cp. The mesh orders ranks TP innermost, then CP, DP, PP (Megatron-LM, torchtitan).

Expert parallelism folds over the same ranks (Megatron-Core's "parallel folding", Liu et al. 2025): the
tp x cp x dp ranks of a pipeline stage that run attention as TP x CP x DP run the MoE layers as
ETP x EP x expert-DP, etp innermost: ep ranks each hold num_experts / ep of the experts (tokens reach
them by all-to-all), etp ranks split each expert's FFN, and the expert_dp = tp x cp x dp / (etp x ep)
ranks holding the same experts reduce (and shard) their gradients together. Expert parameters are
sharded over expert-DP at the plan's sharding degrees cut to what expert_dp allows
(`expert_shard_degrees`).
"""

from __future__ import annotations

import dataclasses
import math
import warnings
from dataclasses import dataclass

from specs.errors import PlannerError
from specs.jsonio import dataclass_from_dict, dataclass_to_dict
from specs.knobs import CUSTOM, check_knob, knob, knob_fields

SCHEDULES = ("gpipe", "1f1b", "interleaved-1f1b")
RECOMPUTE = ("none", "selective", "full")
# MAZ3 tiers for parameters gathered in forward: kept on device until backward, kept in host memory,
# kept as an intra-node secondary shard, or dropped (plain ZeRO-3: gathered again in backward).
CACHE_TIERS = ("none", "device", "host", "secondary")
DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024
# How attention is computed over a sequence split across cp ranks: K/V passed around a ring of
# point-to-point sends (Liu et al., ring attention; Megatron's p2p), heads exchanged by all-to-all so
# each rank attends over the whole sequence for cp-th of the heads (DeepSpeed Ulysses; Megatron's a2a),
# or both: all-to-all among the CP ranks inside a node and a ring across nodes (Megatron's a2a+p2p).
CP_KINDS = ("ring", "all-to-all", "hierarchical")


def zero_degrees(level: int, dp: int) -> tuple[int, int, int]:
    """(param_shard, grad_shard, optim_shard) of ZeRO stage `level` over `dp` ranks."""
    table = {0: (1, 1, 1), 1: (1, 1, dp), 2: (1, dp, dp), 3: (dp, dp, dp)}
    if level not in table:
        raise PlannerError(f"--zero must be 0, 1, 2 or 3, got {level}")
    return table[level]


MIB = 1024 * 1024
BUCKET_MB_CHOICES = (1, 5, 25, 100, 400)
MAX_PREFETCH_DEPTH = 4


@dataclass(frozen=True)
class Plan:
    """How one job is parallelised. Each field is a knob declared once with its Knob (specs/knobs.py):
    the CLI, the checks, the tuning space and the exporters read it from here."""

    dp: int = knob(1, help="Data-parallel degree (default: the devices tp x pp leave).", minimum=1,
                   exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    tp: int = knob(1, help="Tensor-parallel degree (Megatron column/row-parallel layers, vocab-parallel loss).",
                   minimum=1, exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    pp: int = knob(1, help="Pipeline-parallel degree.", minimum=1,
                   exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    cp: int = knob(1, help="Context-parallel degree: each sequence split over cp ranks (two mirrored chunks "
                   "each, for a balanced causal split).", minimum=1,
                   exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    cp_kind: str = knob("ring", help="How attention crosses the CP ranks: ring (K/V by point-to-point), "
                        "all-to-all (heads, Ulysses), hierarchical (all-to-all inside a node, ring across).",
                        choices=CP_KINDS, applies=lambda plan: plan.cp > 1, needs="context parallelism (cp > 1)",
                        exports={"megatron": CUSTOM, "torchtitan": ("ring",)})  # searched with cp (planner/search.py)
    # Expert parallelism (MoE models): folded over the tp x cp x dp ranks of a stage (module docstring).
    # Exported to Megatron-LM and torchtitan (whole experts only); DeepSpeed's exporter refuses MoE models.
    ep: int = knob(1, help="Expert-parallel degree: each rank of an EP group holds num_experts / ep experts, "
                   "tokens dispatched and combined by all-to-all (MoE models).", minimum=1,
                   exports={"megatron": CUSTOM, "torchtitan": CUSTOM})
    etp: int = knob(1, help="Expert tensor-parallel degree: each expert's FFN split over etp ranks (MoE models; "
                    "Megatron-Core's --expert-tensor-parallel-size).", minimum=1, exports={"megatron": CUSTOM})
    virtual_stages: int = knob(1, help="Model chunks per pipeline rank (interleaved 1F1B).", minimum=1,
                               exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    micro_batch: int = knob(1, help="Sequences per micro-batch.", minimum=1,
                            exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    # Derived from the global batch on the command line.
    num_micro_batches: int = knob(1, help="Micro-batches per step on each DP replica.", minimum=1, cli=False,
                                  exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    schedule: str = knob("1f1b", help="Pipeline schedule (default: 1f1b, interleaved-1f1b with --virtual-stages).",
                         choices=SCHEDULES, exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    recompute: str = knob("none", help="Activation recomputation of every layer.", choices=RECOMPUTE,
                          exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    # Per-layer recomputation (length num_layers), overriding `recompute` where set (the ILP's output).
    recompute_layers: tuple[str, ...] | None = knob(
        None, help="Recomputation per layer (the search's ILP output), overriding --recompute.", choices=RECOMPUTE,
        cli=False, exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    sequence_parallel: bool = knob(False, help="Megatron sequence parallelism (needs tp > 1).",
                                   tune=(False, True), exports={"megatron": CUSTOM, "torchtitan": CUSTOM})
    param_shard: int = knob(1, help="DP ranks that shard parameters (Lins' s_p; --zero sets all three).", minimum=1,
                            exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    grad_shard: int = knob(1, help="DP ranks that shard gradients (Lins' s_g).", minimum=1,
                           exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    optim_shard: int = knob(1, help="DP ranks that shard optimizer states (Lins' s_os).", minimum=1,
                            exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    # Transformer layers per model chunk, chunk c = v * pp + p on pipeline rank p (Megatron's
    # interleaved order); None splits evenly. The embedding is on chunk 0, the head on the last chunk.
    stage_layers: tuple[int, ...] | None = knob(
        None, help="Layers per pipeline chunk (unequal stages; the search's ILP output).", minimum=1, cli=False,
        exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})
    # Overlap: layers whose parameters are gathered ahead of use, and the gradient bucket size.
    prefetch_depth: int = knob(1, help="Layers whose sharded parameters are gathered ahead of use.", minimum=0,
                               applies=lambda plan: plan.param_shard > 1, needs="sharded parameters (param_shard > 1)",
                               tune=tuple(range(MAX_PREFETCH_DEPTH + 1)), exports={"deepspeed": CUSTOM})
    bucket_size_bytes: int = knob(DEFAULT_BUCKET_BYTES, help="Gradient bucket size.", minimum=1,
                                  flag="--bucket-size-mb", cli_unit=MIB, cli_help_unit="MiB",
                                  applies=lambda plan: plan.dp_cp > 1, needs="data parallelism (dp x cp > 1)",
                                  tune=tuple(mb * MIB for mb in BUCKET_MB_CHOICES),
                                  exports={"megatron": CUSTOM, "deepspeed": CUSTOM})
    # MAZ3: one tier for every layer or one per layer.
    param_cache: str | tuple[str, ...] = knob(
        "none", help="MAZ3 tier of forward-gathered parameters until backward: none (gather again), device "
        "(keep), host (copy to host memory), secondary (keep an intra-node shard, ZeRO++ hpZ).",
        choices=CACHE_TIERS, exports={"torchtitan": ("device",), "deepspeed": ("secondary",)})
    # Commshift: issue the DP gradient reduction after the stage's last input-gradient send.
    commshift: bool = knob(False, help="Move the DP gradient reduction of a stage's last micro-batch behind its "
                           "last input-gradient send (Commshift).", applies=lambda plan: plan.pp > 1 and plan.dp_cp > 1,
                           needs="both pipeline (pp > 1) and data parallelism (dp x cp > 1)", tune=(False, True))
    # Under bf16/fp16: gradients accumulated over micro-batches and reduced over DP in fp32 (torch FSDP's
    # reduce_dtype=float32, Megatron's --accumulate-allreduce-grads-in-fp32) instead of the compute dtype
    # (ZeRO's 2-byte gradients): 4 bytes per gradient element held and sent. No effect under fp32.
    reduce_fp32: bool = knob(False, help="Accumulate and reduce gradients in fp32 under bf16/fp16 (4-byte "
                             "gradient buffers and reductions; default: the compute dtype).",
                             exports={"megatron": CUSTOM, "torchtitan": CUSTOM, "deepspeed": CUSTOM})

    def __post_init__(self) -> None:
        for spec in PLAN_KNOBS:
            check_knob(spec, getattr(self, spec.name))
        self._check_schedule()
        self._check_sharding()
        if (self.tp * self.dp_cp) % (self.ep * self.etp):
            raise ValueError(f"etp x ep = {self.etp} x {self.ep} = {self.etp * self.ep} does not divide the "
                             f"tp x cp x dp = {self.tp * self.dp_cp} ranks of a pipeline stage it folds over")
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1")
        if self.stage_layers is not None and len(self.stage_layers) != self.num_chunks:
            raise ValueError(f"stage_layers has {len(self.stage_layers)} entries, but pp x virtual_stages "
                             f"= {self.pp} x {self.virtual_stages} = {self.num_chunks}")
        tiers = (self.param_cache,) if isinstance(self.param_cache, str) else self.param_cache
        if any(t != "none" for t in tiers) and self.param_shard == 1:
            raise ValueError("param_cache needs sharded parameters (param_shard > 1)")
        for spec in PLAN_KNOBS:
            if spec.knob.applies is not None and getattr(self, spec.name) != spec.default and not spec.knob.applies(self):
                warnings.warn(f"{spec.name} has no effect without {spec.knob.needs}", stacklevel=3)

    def _check_schedule(self) -> None:
        if self.schedule not in SCHEDULES:
            raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {self.schedule!r}")
        if self.schedule == "interleaved-1f1b":
            if self.pp < 2 or self.virtual_stages < 2:
                raise ValueError("interleaved-1f1b needs pp >= 2 and virtual_stages >= 2, "
                                 f"got pp={self.pp}, virtual_stages={self.virtual_stages}")
            if self.num_micro_batches % self.pp:
                raise ValueError(f"interleaved-1f1b needs num_micro_batches ({self.num_micro_batches}) "
                                 f"divisible by pp ({self.pp})")
        elif self.virtual_stages != 1:
            raise ValueError(f"virtual_stages={self.virtual_stages} needs schedule interleaved-1f1b, "
                             f"got {self.schedule}")

    def _check_sharding(self) -> None:
        chain = (("param_shard", self.param_shard), ("grad_shard", self.grad_shard),
                 ("optim_shard", self.optim_shard))
        group = "dp" if self.cp == 1 else f"dp x cp = {self.dp_cp}"
        for name, degree in chain:
            if self.dp_cp % degree:
                raise ValueError(f"{name} {degree} does not divide {group}")
        if self.grad_shard % self.param_shard or self.optim_shard % self.grad_shard:
            raise ValueError("sharding degrees must nest: param_shard divides grad_shard divides optim_shard, "
                             f"got ({self.param_shard}, {self.grad_shard}, {self.optim_shard})")

    # --- derived quantities --------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        return self.dp * self.cp * self.tp * self.pp

    @property
    def dp_cp(self) -> int:
        """Ranks that hold the same parameters and reduce (and shard) gradients together: dp x cp."""
        return self.dp * self.cp

    @property
    def expert_dp(self) -> int:
        """Ranks that hold the same experts and reduce their gradients together: tp x cp x dp / (etp x ep)."""
        return self.tp * self.dp_cp // (self.ep * self.etp)

    @property
    def expert_shard_degrees(self) -> tuple[int, int, int]:
        """(param, grad, optim) shard degrees of expert parameters over expert-DP: each of the plan's degrees
        cut to its gcd with expert_dp (ZeRO-3 over dp shards experts over all of expert-DP when it divides;
        nesting is kept, since gcd(a, n) divides gcd(b, n) when a divides b)."""
        return tuple(math.gcd(s, self.expert_dp) for s in self.shard_degrees)  # type: ignore[return-value]

    def cp_split(self, *, ranks_per_node: int) -> tuple[int, int]:
        """(all-to-all size, ring size) of the CP group, their product cp: ring (1, cp), all-to-all (cp, 1),
        hierarchical the CP ranks inside a node exchange heads and the node groups form a ring (CP ranks
        sit tp apart, so a node of `ranks_per_node` holds gcd(cp, ranks_per_node // tp) of them)."""
        if self.cp_kind == "ring":
            return 1, self.cp
        if self.cp_kind == "all-to-all":
            return self.cp, 1
        inside = math.gcd(self.cp, max(1, ranks_per_node // self.tp))
        return inside, self.cp // inside

    def degrees_text(self) -> str:
        """'dp x tp x pp = 2 x 2 x 1' (with cp where it is > 1), for messages."""
        names = ("dp", "cp", "tp", "pp") if self.cp > 1 else ("dp", "tp", "pp")
        return (" x ".join(names) + " = " + " x ".join(str(getattr(self, n)) for n in names)
                + f" = {self.world_size}")

    @property
    def num_chunks(self) -> int:
        """Model chunks over the whole pipeline: pp x virtual_stages."""
        return self.pp * self.virtual_stages

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batch * self.num_micro_batches

    @property
    def shard_degrees(self) -> tuple[int, int, int]:
        return (self.param_shard, self.grad_shard, self.optim_shard)

    @property
    def zero_level(self) -> int | None:
        """The ZeRO stage this sharding is, or None for other points (HSDP, Lins mixes)."""
        for level in (0, 1, 2, 3):
            if self.shard_degrees == zero_degrees(level, self.dp_cp):
                return level
        return None

    def chunk_layer_counts(self, num_layers: int) -> tuple[int, ...]:
        """Transformer layers in each model chunk (stage_layers, or an even split with the remainder
        given to middle chunks, since the first and last chunks also hold the embedding and head)."""
        if self.stage_layers is not None:
            return self.stage_layers
        chunks = self.num_chunks
        base, extra = divmod(num_layers, chunks)
        order = list(range(1, chunks - 1)) + [0, chunks - 1] if chunks > 2 else list(range(chunks))
        counts = [base] * chunks
        for c in order[:extra]:
            counts[c] += 1
        return tuple(counts)

    def chunk_layer_ranges(self, num_layers: int) -> list[range]:
        """Global layer indices of each chunk c (chunk c lives on pipeline rank c % pp)."""
        ranges, start = [], 0
        for count in self.chunk_layer_counts(num_layers):
            ranges.append(range(start, start + count))
            start += count
        return ranges

    def layer_recompute(self, layer: int) -> str:
        return self.recompute_layers[layer] if self.recompute_layers is not None else self.recompute

    def layer_cache(self, layer: int) -> str:
        return self.param_cache if isinstance(self.param_cache, str) else self.param_cache[layer]

    def describe(self) -> str:
        """A short one-line name, e.g. 'dp4 tp2 pp2 mb1x8 1f1b rc=full shard=(4,4,4)'."""
        parts = [f"dp{self.dp}", f"tp{self.tp}", f"pp{self.pp}"]
        if self.cp > 1:
            parts.insert(1, f"cp{self.cp}" + {"ring": "", "all-to-all": "-a2a", "hierarchical": "-hier"}[self.cp_kind])
        if self.ep > 1 or self.etp > 1:
            parts.insert(len(parts) - 1, f"ep{self.ep}" + (f"etp{self.etp}" if self.etp > 1 else ""))
        if self.virtual_stages > 1:
            parts.append(f"v{self.virtual_stages}")
        parts.append(f"mb{self.micro_batch}x{self.num_micro_batches}")
        if self.pp > 1:
            parts.append(self.schedule)
        parts.append(f"rc={self.recompute if self.recompute_layers is None else 'per-layer'}")
        if self.sequence_parallel:
            parts.append("sp")
        level = self.zero_level
        parts.append(f"zero{level}" if level is not None and self.dp_cp > 1 else
                     f"shard=({self.param_shard},{self.grad_shard},{self.optim_shard})" if level is None else "")
        if self.param_cache != "none":
            parts.append(f"cache={self.param_cache if isinstance(self.param_cache, str) else 'per-layer'}")
        if self.commshift:
            parts.append("commshift")
        if self.reduce_fp32:
            parts.append("grads-fp32")
        return " ".join(p for p in parts if p)

    def replace(self, **changes: object) -> "Plan":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, what: str = "plan") -> "Plan":
        return dataclass_from_dict(cls, data, what=what)


# The knob table: every Plan field with its Knob, in declaration order.
PLAN_KNOBS = knob_fields(Plan)


def check_plan(plan: Plan, *, model, num_devices: int, job) -> None:
    """Raise PlannerError if `plan` cannot train `model` on `num_devices` devices with `job`'s batch."""
    if plan.world_size != num_devices:
        raise PlannerError(f"{plan.degrees_text()}, but the cluster has {num_devices} devices")
    for name, value in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads),
                        ("ffn_hidden_size", model.ffn_hidden_size)):
        if value % plan.tp:
            raise PlannerError(f"tp {plan.tp} does not divide the model's {name} {value}")
    if plan.num_chunks > model.num_layers:
        raise PlannerError(f"pp x virtual_stages = {plan.num_chunks} exceeds the model's {model.num_layers} layers")
    if sum(plan.chunk_layer_counts(model.num_layers)) != model.num_layers:
        raise PlannerError(f"stage_layers {list(plan.stage_layers or ())} sum to "
                           f"{sum(plan.stage_layers or ())}, but the model has {model.num_layers} layers")
    if plan.global_batch != job.global_batch:
        raise PlannerError(f"dp x micro_batch x num_micro_batches = {plan.dp} x {plan.micro_batch} x "
                           f"{plan.num_micro_batches} = {plan.global_batch}, but the global batch is {job.global_batch}")
    if plan.sequence_parallel and job.seq_len % plan.tp:
        raise PlannerError(f"sequence parallel needs tp {plan.tp} to divide seq_len {job.seq_len}")
    check_seq_len(model, seq_len=job.seq_len)
    check_context_parallel(plan, model=model, seq_len=job.seq_len)
    check_expert_parallel(plan, model=model)
    for name, per_layer in (("recompute_layers", plan.recompute_layers),
                            ("param_cache", None if isinstance(plan.param_cache, str) else plan.param_cache)):
        if per_layer is not None and len(per_layer) != model.num_layers:
            raise PlannerError(f"{name} has {len(per_layer)} entries, but the model has {model.num_layers} layers")


def check_seq_len(model, *, seq_len: int) -> None:
    """A sequence longer than the model's positions is refused: learned positions have no row for it, and a
    RoPE model was trained only that far unless its config extends it (rope scaling, as Llama 3.1's
    config.json does with max_position_embeddings 131072)."""
    if seq_len <= model.max_seq_len:
        return
    what = "learned positions" if model.learned_positions else "positions (max_position_embeddings)"
    hint = "" if model.learned_positions else (
        "; use a model whose config allows it (rope scaling), e.g. the llama3.1-8b / llama3.1-70b presets "
        "or a config.json with a larger max_position_embeddings")
    raise PlannerError(f"seq_len {seq_len} exceeds {model.name}'s {model.max_seq_len} {what}{hint}")


def check_context_parallel(plan: Plan, *, model, seq_len: int, ranks_per_node: int | None = None) -> None:
    """One clear line for a CP degree the model or sequence cannot take (see Plan.cp_split for the kinds;
    the hierarchical kind's head check needs the node size, `ranks_per_node`, and is skipped without it)."""
    if plan.cp == 1:
        return
    if seq_len % (2 * plan.cp):
        raise PlannerError(f"cp {plan.cp} needs seq_len {seq_len} divisible by 2 x cp = {2 * plan.cp} (each rank "
                           f"holds two mirrored chunks for a balanced causal split)")
    if plan.sequence_parallel and (seq_len // plan.cp) % plan.tp:
        raise PlannerError(f"sequence parallel needs tp {plan.tp} to divide the {seq_len // plan.cp} tokens "
                           f"per CP rank (seq_len {seq_len} / cp {plan.cp})")
    if plan.cp_kind == "all-to-all" or (plan.cp_kind == "hierarchical" and ranks_per_node is not None):
        # The all-to-all part hands each of its ranks a slice of the heads; with GQA of the K/V heads too,
        # so each rank keeps whole query groups (no K/V head is split or repeated).
        inside = plan.cp_split(ranks_per_node=ranks_per_node or 1)[0]
        for name, value in (("num_heads", model.num_heads), ("num_kv_heads", model.num_kv_heads)):
            per_tp = value // plan.tp
            if per_tp % inside:
                raise PlannerError(f"cp_kind {plan.cp_kind} exchanges heads over {inside} CP ranks, which do not "
                                   f"divide the {per_tp} {name} per TP rank ({name} {value} / tp {plan.tp}); "
                                   f"use cp_kind ring")


def check_expert_parallel(plan: Plan, *, model) -> None:
    """One clear line for expert-parallel degrees the model cannot take."""
    if not getattr(model, "is_moe", False):
        if plan.ep > 1 or plan.etp > 1:
            raise PlannerError(f"ep {plan.ep} and etp {plan.etp} need a mixture-of-experts model; {model.name} is dense")
        return
    if model.num_experts % plan.ep:
        raise PlannerError(f"ep {plan.ep} does not divide the model's num_experts {model.num_experts}")
    if model.expert_ffn_hidden_size % plan.etp:
        raise PlannerError(f"etp {plan.etp} does not divide the model's expert_ffn_hidden_size "
                           f"{model.expert_ffn_hidden_size}")
    if plan.tp > 1 and not plan.sequence_parallel:
        # Megatron-Core requires it too: without it the TP ranks would hold (and route) the same tokens.
        raise PlannerError(f"an MoE model with tp {plan.tp} needs sequence_parallel (each TP rank routes its "
                           f"own slice of the sequence)")


def micro_batches_for(*, global_batch: int, dp: int, micro_batch: int) -> int:
    """Micro-batches per DP replica per step; raises PlannerError when the batch does not divide."""
    if global_batch % (dp * micro_batch):
        raise PlannerError(f"global batch {global_batch} is not divisible by dp x micro_batch = "
                           f"{dp} x {micro_batch} = {dp * micro_batch}")
    return global_batch // (dp * micro_batch)
