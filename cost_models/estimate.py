"""The cost model's answer for one plan, and the entry point that prices a plan.

    from cost_models.estimate import estimate
    est = estimate(plan, model=spec, cluster=cluster, job=job)

A plan is priced per model chunk: its layers' compute (compute.py) under their recomputation policies,
exposed TP communication and the per-micro-batch DP/ZeRO communication overlapped on a separate
stream except the first layer's gather and the last bucket's reduce-scatter (comm.py); the chunks'
actions then run through the pipeline schedule with the step-end gradient reduction placed with or
without commshift (timeline.py), and each rank's memory peaks over its in-flight micro-batches
(memory.py). `layer_costs` gives the same per-layer numbers to the search's ILP; `estimate` prices a
chunk as their sum, so the two agree.

Calibration keys read from `hardware.calibration` (free parameters `planner calibrate` may fit; all
optional): compute_time_scale (multiplies every GEMM and elementwise time, default 1),
memory_bandwidth_efficiency (fraction of the HBM datasheet bandwidth elementwise kernels reach,
default 0.8), comm_time_scale (multiplies every collective and transfer time, default 1),
framework_reserve_bytes (memory no tensor accounts for: 2 GiB per GPU for the CUDA context and
workspaces; on CPU the runtime's anonymous memory, 146 MiB). Note that the runner measures
torch.cuda.max_memory_allocated on GPUs (tensors only: subtract the reserve to compare) and the
anonymous peak on CPU (the resident set less mapped library files, runtime included).

CPU-side costs the datasheet model leaves out, also calibration keys (default 0; `planner calibrate`
fits them to measured runs, see planner/calibrate.py): op_overhead_s (seconds every op our eager engine
launches pays in Python dispatch and allocation, on top of its kernel time; counted per layer, embedding,
head and optimizer unit by `num_ops`), collective_overhead_s (seconds every collective call pays on top
of its latency-bandwidth time per exchange of its algorithm, `sync_rounds`: gloo's synchronisation with a
partner process under a busy host), comm_overlap_efficiency (the fraction of per-micro-batch DP/ZeRO
communication the separate stream hides, default 1; see `_overlap`), recompute_overhead_s and selective_recompute_overhead_s
(seconds per checkpointed layer / attention core and micro-batch, see `_policy_times`) and step_overhead_s (seconds per
optimizer step outside any op: the step loop's bookkeeping). Measured by the CPU profile, not fitted:
shard_grad_unit_s and shard_param_unit_s (the sharding engine's own seconds per unit and micro-batch,
`sharding_bookkeeping_s`). On small models on CPUs these dominate the
step; on GPUs they are hidden behind the kernel queue and stay 0.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass, field

from cost_models.comm import collective_time_s as _collective_time_s
from cost_models.comm import sync_wait_s, sync_waits_s
from cost_models.context import context_comm, message_extra_s, with_extra
from cost_models.compute import (FUSED_BACKWARD_RATIO, _elementwise_kernels, activation_bytes_per_element, contended, end_compute_times,
                                 fused_attention, layer_compute_times, layer_gemms, memory_time_s,
                                 model_flops_per_step)
from cost_models import moe as moe_cost
from cost_models.memory import (ALLOCATOR_FRAGMENTATION, CPU_FRAMEWORK_RESERVE_BYTES, StateBytes, end_activation_bytes,
                                gpu_runtime_bytes, end_params_per_device, in_flight_profiles, layer_activation_bytes,
                                layer_params_per_device, logits_bytes, model_state_bytes, peak_from_profiles,
                                state_bytes_per_param)
from cost_models.engines import engine_model, ring_blocks_written_out
from cost_models.linkshare import shared_send_delay_s
from specs.schedule import rank_actions
from cost_models.timeline import ChunkDurations, simulate
from specs.errors import PlannerError
from specs.plan import check_plan


@dataclass(frozen=True)
class Estimate:
    """Predicted performance and memory of one plan on one cluster.

    `breakdown` holds named components in seconds per step (compute_s, recompute_s, tp_comm_s,
    pp_comm_s, dp_comm_s, exposed_comm_s, bubble_s, optimizer_s, ...) and bytes per device
    (weights_bytes, grads_bytes, optimizer_bytes, activations_bytes, buffers_bytes, ...).
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    tflops_per_gpu: float
    peak_memory_bytes: int
    memory_limit_bytes: int
    breakdown: dict[str, float] = field(default_factory=dict)
    # Host memory per device that the plan keeps (MAZ3's host tier) and what the host has per device;
    # a limit of 0 means unchecked.
    host_memory_bytes: int = 0
    host_memory_limit_bytes: int = 0

    @property
    def fits(self) -> bool:
        host_fits = self.host_memory_limit_bytes <= 0 or self.host_memory_bytes <= self.host_memory_limit_bytes
        return self.peak_memory_bytes <= self.memory_limit_bytes and host_fits

    @property
    def memory_shortfall_bytes(self) -> int:
        """How much more memory per device the plan needs than the device has (0 when it fits)."""
        return max(0, self.peak_memory_bytes - self.memory_limit_bytes)

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "tflops_per_gpu": self.tflops_per_gpu, "peak_memory_bytes": int(self.peak_memory_bytes),
            "memory_limit_bytes": int(self.memory_limit_bytes), "fits": self.fits,
            "memory_shortfall_bytes": int(self.memory_shortfall_bytes), "breakdown": dict(self.breakdown),
            "host_memory_bytes": int(self.host_memory_bytes), "host_memory_limit_bytes": int(self.host_memory_limit_bytes),
        }


# --- pricing --------------------------------------------------------------------------------------
POLICIES = ("none", "selective", "full")
# Ops Adam launches per flat unit (runners/sharding/adam.py: lerp, mul, addcmul, sqrt, div, add,
# addcdiv, the copy, the gradient zeroing) and a backward's ops per forward op (autograd runs an
# input-gradient and, for GEMMs, a weight-gradient kernel for most forward ops).
ADAM_OPS_PER_UNIT = 10
BACKWARD_OPS_PER_FORWARD_OP = 2


# Sequential exchanges of one call of each collective as gloo runs it (CPU): allreduce is its ring
# (gloo/allreduce.cc `ring`: a reduce-scatter then an allgather, each n - 1 steps); allgather a ring of
# n - 1 steps; reduce-scatter is an allreduce of the whole input (torch's ProcessGroupGloo::
# reduce_scatter_tensor_coalesced clones it, all-reduces it and keeps its chunk); alltoall and broadcast
# post every message at once; a send or a receive is one.
GLOO_SYNC_ROUNDS = {"all_reduce": lambda n: 2 * (n - 1), "all_gather": lambda n: n - 1,
                    "reduce_scatter": lambda n: 2 * (n - 1), "all_to_all": lambda n: 1, "broadcast": lambda n: 1,
                    "p2p": lambda n: 1}


def sync_rounds(collective: str, *, group_size: int, device_type: str) -> float:
    """The rounds of one call in which a rank waits for a partner process to be scheduled and answer:
    on CPU the exchanges of gloo's algorithm (GLOO_SYNC_ROUNDS); on GPUs log2(group size), the rounds of
    recursive doubling (Thakur et al. 2005)."""
    if device_type == "cpu":
        return GLOO_SYNC_ROUNDS[collective](group_size)
    return math.log2(2 if collective == "p2p" else group_size)


def collective_time_s(cluster, *, collective: str, size_bytes: float, group_size: int, stride: int) -> float:
    """cost_models.comm.collective_time_s plus the calibrated per-call overhead for a call that moves data:
    collective_overhead_s x `sync_rounds`, the exchanges in which a rank waits for a partner process to
    be scheduled and answer; an all-to-all (every one this engine calls blocks its step) also the context
    probe's measured extra per call where a CPU profile has one (cost_models/context.message_extra_s).

    Memoised on the cluster (`Cluster.collective_memo`): a search prices the same few collectives for
    thousands of plans."""
    key = (collective, size_bytes, group_size, stride)
    memo = getattr(cluster, "collective_memo", None)  # tests may pass a stand-in without one
    if memo is not None and key in memo:
        return memo[key]
    time_s = _collective_time_s(cluster, collective=collective, size_bytes=size_bytes, group_size=group_size,
                                stride=stride)
    if time_s > 0:
        calibration = cluster.hardware.calibration
        time_s += calibration.get("collective_overhead_s", 0.0) * sync_rounds(
            collective, group_size=group_size, device_type=cluster.hardware.device_type)
        if collective == "all_to_all":  # the context probe's in-engine extra (cost_models/context.py; CPU)
            time_s = with_extra(time_s, message_extra_s(calibration, "a2a", group_size))
    else:
        time_s = 0.0
    if memo is not None:
        memo[key] = time_s
    return time_s


def _overlap(compute_s: float, comm_s: float, cluster, *, wire_s: float = 0.0, efficiency: float = 1.0) -> float:
    """Seconds of compute with communication issued beside it: compute + comm - e x min(compute, comm),
    where e is the share of the shorter one that hides.

    GPUs: NCCL's CTAs hold nccl_ctas SMs for as long as a collective runs, so the compute beside it runs
    on the rest (its GEMM waves re-quantized) at `efficiency` of its own speed: the compute's time on the
    whole device over its time on the contended one (LayerCosts.overlap_efficiency_*), whatever the link.
    CPUs: the calibration key comm_overlap_efficiency (default 1): the gloo threads compete with compute
    for the same cores, so only part of the communication hides; below 0 (down to -1) the two slow each
    other down, which the profile's overlap probe measures on hosts with fewer cores than ranks. There
    `wire_s` of the communication, time spent waiting on an inter-node wire (the bandwidth term of
    inter-node collectives, `_wire_fraction`), takes no core: it hides behind compute fully, and the
    efficiency applies to the rest against the compute left. A calibrated comm_overlap_efficiency
    (`planner calibrate`) replaces the GPU's contention figure too."""
    hw = cluster.hardware
    if hw.device_type == "cuda":
        efficiency = min(1.0, max(-1.0, hw.calibration.get("comm_overlap_efficiency", efficiency)))
        return compute_s + comm_s - efficiency * min(compute_s, comm_s)
    efficiency = min(1.0, max(-1.0, hw.calibration.get("comm_overlap_efficiency", 1.0)))
    wire_s = min(max(wire_s, 0.0), comm_s)
    hidden_wire = min(compute_s, wire_s)
    return compute_s + comm_s - hidden_wire - efficiency * min(compute_s - hidden_wire, comm_s - wire_s)


def _wire_fraction(cluster, *, collective: str, size_bytes: float, group_size: int, stride: int) -> float:
    """The share of a collective's time that is its bandwidth term on an inter-node group (0 inside a
    node): its time less the time of a near-empty message of the same kind."""
    if size_bytes <= 0 or cluster.group_link(size=group_size, stride=stride) != "inter_node":
        return 0.0
    kwargs = dict(collective=collective, group_size=group_size, stride=stride)
    total = collective_time_s(cluster, size_bytes=size_bytes, **kwargs)
    if total <= 0:
        return 0.0
    return max(0.0, total - collective_time_s(cluster, size_bytes=1.0, **kwargs)) / total


def num_ops(model) -> dict[str, int]:
    """Forward ops our engine launches: one layer ('layer'), its attention core ('core', what selective
    recomputation repeats), the embedding ('embed') and final norm + head + loss ('head'). The layer's
    GEMMs and elementwise kernels are compute.py's; fused attention is one op, the materialised core two
    GEMMs and a softmax with its dropout; the head is the norm's elementwise ops, one GEMM, ~4 for the loss."""
    gemms = layer_gemms(model, micro_batch=1, seq_len=1)
    core = 1 if fused_attention(model) else len(gemms["attention"]) + 2
    norm = 7 if model.arch == "llama" else 1
    return {"layer": len(gemms["dense"]) + core + _elementwise_kernels(model), "core": core, "embed": 1,
            "head": norm + 1 + 4}


def context_parallel_ops(a2a: int, ring: int) -> tuple[int, int]:
    """(forward, backward) ops runners/context_parallel.py launches per layer beyond the unsplit attention's,
    outside the ring's own steps (priced from their measured times): the all-to-all's copies into and out
    of its buffers and its reorder into the ring layout (q, k, v in, the output back: cat, flip, stack and
    their backward), and the ring's accumulators, K/V stack and receive buffers (one per step forward, one
    K/V and one gradient buffer per step backward). Counted by dispatching a tiny layer's forward and
    backward (tests/unit/test_cost_estimate.py keeps them equal to the engine's)."""
    forward = backward = 0
    if a2a > 1:
        forward, backward = forward + 25, backward + 28
    if ring > 1:
        forward, backward = forward + 4 + 2 * ring, backward + 5 * ring - 1
    return forward, backward


# A fused Adam touches per parameter of its shard: the gradient (read), fp32 master, m and v (read + write)
# and the compute-dtype parameter (write): 2 + 24 + 2 bytes mixed precision, 4 + 8 + 16 for fp32. An
# engine whose optimizer is unfused says so (EngineModel.optimizer_bytes_per_param).
ADAM_BYTES_PER_PARAM = 28


def reduce_bytes_per_param(precision: str, eng, *, reduce_fp32: bool = False) -> int:
    """Bytes per parameter the DP gradient reduction moves: the gradient's dtype, fp32 where the engine
    reduces fp32 main gradients (Megatron) or reduces in fp32 (torchtitan's FSDP2), or the plan asks it
    of this engine (the reduce_fp32 knob)."""
    grad_bytes = state_bytes_per_param(precision, reduce_fp32=reduce_fp32)[1]
    return 4 if eng.reduce_fp32 else grad_bytes


# PyTorch FSDP1 (torch/distributed/fsdp/_runtime_utils.py `_post_backward_hook`, 2.0-2.1; the same steps
# in 1.13's fully_sharded_data_parallel.py) handles each FlatParameter's whole unsharded gradient every
# micro-batch: autograd writes it by concatenating the original parameters' gradients (the backward of the
# split that made them views of the flat parameter: read + write in the compute dtype); the hook casts it
# to MixedPrecision's reduce_dtype when that differs (`flat_param.grad.to(reduce_dtype)`: read 2, write 4
# under Composer's DEFAULT, fp32) and the default reduce-scatter hook divides it in place by the gradient
# pre-divide factor (default_hooks.reduce_scatter_hook; the factor is above 1 for every world size of 2 or
# more: read + write in the reduce dtype). FSDP2 (torch/distributed/_composable/fsdp/_fsdp_collectives.py,
# foreach_reduce) copies the per-parameter gradients into one reduce-scatter input in the reduce dtype
# (foreach_reduce_scatter_copy_in: read in the compute dtype, write in the reduce dtype) and pre-divides
# only an fp16 reduction (fp32 and bf16 use NCCL's average). The shard-sized post-divide and accumulation
# (1/dp of it) are left out. Kernels per unit: FSDP1's three passes, FSDP2's one copy.
UNSHARDED_GRAD_KERNELS = {"fsdp1": 3, "fsdp2": 1}


def unsharded_grad_pass_bytes(precision: str, *, reduce_bytes: int, dp: int, kind: str = "fsdp1") -> int:
    """HBM bytes per parameter an FSDP's passes over the unsharded gradient move each micro-batch (comment
    above): `kind` "fsdp1" or "fsdp2", `reduce_bytes` the reduce dtype's size, `dp` the reduction's group size."""
    compute = activation_bytes_per_element(precision)
    if kind == "fsdp2":
        return compute + reduce_bytes if dp > 1 else 0
    cast = compute + reduce_bytes if reduce_bytes != compute else 0
    return 2 * compute + (cast + 2 * reduce_bytes if dp > 1 else 0)


def gathered_param_bytes(precision: str, eng) -> int:
    """Bytes per parameter a parameter all-gather moves: the compute-dtype weight; in fp8 the bf16 copy, or
    the 1-byte fp8 weight where the engine keeps only that (EngineModel.fp8_param_gather: Megatron's
    distributed optimizer gathers the uint8 parameter buffer, param_and_grad_buffer.py)."""
    if precision == "fp8":
        return 1 if eng.fp8_param_gather else 2
    return state_bytes_per_param(precision)[0]


@dataclass(frozen=True)
class LayerCosts:
    """Per-layer prices for the search's ILP, on one device under the plan's TP, SP and sharding.

    time_s[policy]: forward + backward + recomputation of one layer for one micro-batch, with its exposed
    TP communication. activation_bytes[policy]: what the layer keeps per micro-batch in flight.
    state_bytes: weights + gradients + optimizer states of one layer on one device.
    first/last_extra_time_s: the embedding (first chunk) and final norm + head + loss (last chunk) per
    micro-batch, with their TP communication. first/last_extra_bytes: their model states and fixed
    buffers (the fp32 logits on the last chunk); first/last_extra_activation_bytes: what they keep per
    micro-batch in flight.
    """

    time_s: dict[str, float]
    activation_bytes: dict[str, float]
    state_bytes: float
    first_extra_time_s: float
    last_extra_time_s: float
    first_extra_bytes: float
    last_extra_bytes: float
    first_extra_activation_bytes: float = 0.0
    last_extra_activation_bytes: float = 0.0
    # The parts estimate() needs to build actions: forward-only seconds per layer, and the rest.
    forward_time_s: dict[str, float] = field(default_factory=dict)
    first_extra_forward_s: float = 0.0
    last_extra_forward_s: float = 0.0
    first_extra_tp_comm_s: float = 0.0
    last_extra_tp_comm_s: float = 0.0
    tp_comm_s: dict[str, float] = field(default_factory=dict)  # exposed in-layer communication: TP and CP
    cp_comm_s: dict[str, float] = field(default_factory=dict)  # the CP part of it (cost_models/context.py)
    # The part of it (every policy) that sums the replicated parameters' gradients over TP under sequence
    # parallelism (`_sp_replicated_reduce_s`).
    replicated_reduce_s: float = 0.0
    recompute_time_s: dict[str, float] = field(default_factory=dict)
    # The largest transient of this engine's written-out ring (GPUs): one step's fp32 scores and probabilities.
    cp_working_bytes: float = 0.0
    # Speed of the layer's forward / backward compute while a collective holds some of the GPU's SMs, over
    # its speed on the whole device (compute.contended); 1 on CPUs.
    overlap_efficiency_forward: float = 1.0
    overlap_efficiency_backward: float = 1.0


def _with_op_overhead(model, times, ends, *, op_overhead_s: float, cp_split: tuple[int, int] = (1, 1)):
    """Layer and end compute times plus `op_overhead_s` per launched op (`num_ops`; backward
    BACKWARD_OPS_PER_FORWARD_OP times the forward's ops), and the context-parallel attention's own ops
    (`context_parallel_ops` of the plan's (all-to-all, ring) split), which run inside the attention core."""
    if op_overhead_s <= 0:
        return times, ends
    ops, k = num_ops(model), BACKWARD_OPS_PER_FORWARD_OP
    cp_forward, cp_backward = context_parallel_ops(*cp_split)
    times = dataclasses.replace(
        times, forward_s=times.forward_s + (ops["layer"] + cp_forward) * op_overhead_s,
        backward_s=times.backward_s + (k * ops["layer"] + cp_backward) * op_overhead_s,
        attention_core_forward_s=times.attention_core_forward_s + (ops["core"] + cp_forward) * op_overhead_s)
    ends = dataclasses.replace(
        ends, embed_forward_s=ends.embed_forward_s + ops["embed"] * op_overhead_s,
        embed_backward_s=ends.embed_backward_s + k * ops["embed"] * op_overhead_s,
        head_forward_s=ends.head_forward_s + ops["head"] * op_overhead_s,
        head_backward_s=ends.head_backward_s + k * ops["head"] * op_overhead_s)
    return times, ends


def sharding_bookkeeping_s(hw, *, shards: tuple[int, int, int], eng) -> tuple[float, float]:
    """(forward, backward) seconds our sharding engine's own bookkeeping adds to each unit (a layer, the
    embedding, the final norm, the head; an MoE layer's experts are one more) and micro-batch at Lins
    degrees `shards` (s_p, s_g, s_o): under s_g > 1 each parameter's gradient copied into its bucket's send
    buffer and the bucket's reduce-scatter bookkeeping (backward); under s_p > 1 the gather and free around
    each forward and backward use and the backward pre-hook's autograd nodes (half in each pass). The
    calibration keys shard_grad_unit_s and shard_param_unit_s come measured from the CPU profile's sharding
    probe (runners/probe.measure_sharding; 0 elsewhere: on a GPU the kernel queue hides them as it hides
    op_overhead_s). The collectives' own time is priced from their curves (comm.py), not here."""
    if eng.name != "ours":
        return 0.0, 0.0
    param_s = hw.calibration.get("shard_param_unit_s", 0.0) if shards[0] > 1 else 0.0
    grad_s = hw.calibration.get("shard_grad_unit_s", 0.0) if shards[1] > 1 else 0.0
    return param_s / 2, param_s / 2 + grad_s


def _with_host_costs(model, times, ends, *, hw, plan, eng, cp_split: tuple[int, int]):
    """Layer and end compute times plus what the eager engine's host adds: per-op dispatch
    (`_with_op_overhead`) and the sharding engine's bookkeeping (`_with_bookkeeping`)."""
    times, ends = _with_op_overhead(model, times, ends, op_overhead_s=hw.calibration.get("op_overhead_s", 0.0),
                                    cp_split=cp_split)
    return _with_bookkeeping(model, times, ends, hw=hw, plan=plan, eng=eng)


def end_units(model) -> tuple[int, int]:
    """The runner's units outside the layers (runners/transformer.py): (first end: the embedding and, where
    the model learns them, the positions; last end: the final norm and the head)."""
    return 1 + int(model.learned_positions), 2


def _with_bookkeeping(model, times, ends, *, hw, plan, eng):
    """Layer and end compute times plus the sharding engine's bookkeeping (`sharding_bookkeeping_s`):
    one unit a layer, the embedding (and learned positions) at the first end, the final norm and the head
    at the last."""
    f, b = sharding_bookkeeping_s(hw, shards=(plan.param_shard, plan.grad_shard, plan.optim_shard), eng=eng)
    if f <= 0 and b <= 0:
        return times, ends
    first_units, last_units = end_units(model)
    times = dataclasses.replace(times, forward_s=times.forward_s + f, backward_s=times.backward_s + b)
    ends = dataclasses.replace(
        ends, embed_forward_s=ends.embed_forward_s + first_units * f,
        embed_backward_s=ends.embed_backward_s + first_units * b,
        head_forward_s=ends.head_forward_s + last_units * f, head_backward_s=ends.head_backward_s + last_units * b)
    return times, ends


def _tp_collectives_s(cluster, *, act_bytes: float, tp: int) -> tuple[float, float, float]:
    """(all-gather, reduce-scatter, all-reduce) seconds of one b x s x h activation over the TP group.
    Megatron: two all-reduces per layer forward, two backward; under sequence parallelism each becomes an
    all-gather + reduce-scatter pair (the same ring volume)."""
    return tuple(collective_time_s(cluster, collective=c, size_bytes=act_bytes, group_size=tp, stride=1)
                 for c in ("all_gather", "reduce_scatter", "all_reduce"))


def _layer_activations(plan, *, model, job, eng, hw, dims: dict, ring: int) -> dict[str, float]:
    """Bytes one layer keeps per micro-batch under each recomputation policy, as `eng` runs it. This
    engine's ring keeps no scores (its blocks are transient); a materialised core after the all-to-all
    keeps the whole sequence's square for 1/cp of the heads."""
    cp, b, tp = plan.cp, plan.micro_batch, plan.tp
    fused = fused_attention(model, eng, hw) or (cp > 1 and ring > 1)
    activation = {p: layer_activation_bytes(model, policy=p, **dims, fused=fused, fused_elementwise=eng.fused_elementwise,
                                            dropout=eng.gpt_dropout) for p in POLICIES}
    if cp > 1 and not fused:
        square = _materialized_scores_bytes(model, micro_batch=b, seq_len=job.seq_len, heads_split=tp * cp,
                                            precision=job.precision, dropout=eng.gpt_dropout)
        local_square = _materialized_scores_bytes(model, micro_batch=b, seq_len=dims["seq_len"], heads_split=tp,
                                                  precision=job.precision, dropout=eng.gpt_dropout)
        activation = {p: v + (square - local_square if p == "none" else 0.0) for p, v in activation.items()}
    return activation


def _policy_times(times, hw, *, tp_fwd_s: float, cp_fwd_s: float, cp_bwd_s: float,
                  tp_bwd_s: float = 0.0) -> tuple[dict, dict, dict]:
    """Per recompute policy: (recomputed seconds, TP + CP communication seconds, CP communication seconds)
    of one layer's forward and backward; `tp_bwd_s`: TP seconds of the backward alone, never recomputed."""
    # Each checkpointed region also pays its calibrated overhead once per micro-batch: torch.utils.checkpoint's
    # saved-tensor hooks, RNG state save/restore and re-entry, on top of the recomputed ops (default 0):
    # recompute_overhead_s for the layer (full), selective_recompute_overhead_s for the attention core (a
    # profile from before profiler version 3 has only the first, used for both).
    checkpoint_s = hw.calibration.get("recompute_overhead_s", 0.0)
    core_checkpoint_s = hw.calibration.get("selective_recompute_overhead_s", checkpoint_s)
    recompute_s = {"none": 0.0, "selective": times.attention_core_forward_s + core_checkpoint_s,
                   "full": times.forward_s + checkpoint_s}
    # Recomputation repeats the forward's CP communication: the whole layer (full), or the core with its
    # all-to-all and ring (selective: runners/context_parallel.py runs inside the checkpointed core).
    cp_comm = {"none": cp_fwd_s + cp_bwd_s, "selective": 2 * cp_fwd_s + cp_bwd_s, "full": 2 * cp_fwd_s + cp_bwd_s}
    tp_comm = {"none": 2 * tp_fwd_s + tp_bwd_s, "selective": 2 * tp_fwd_s + tp_bwd_s, "full": 3 * tp_fwd_s + tp_bwd_s}
    return recompute_s, {p: tp_comm[p] + cp_comm[p] for p in POLICIES}, cp_comm


def _sync_waits(plan, hw, *, times, a2a: int) -> tuple[tuple[float, float], tuple[float, float]]:
    """(TP's, the CP all-to-all's) (forward, backward) seconds one layer and micro-batch waits at its blocking
    collectives for the ranks that reach them last (cost_models/comm.sync_wait_s; on CPU profiles, 0 elsewhere):
    TP meets its group twice a pass (after the attention block and after the MLP: an all-reduce, or under
    sequence parallelism a reduce-scatter whose all-gather follows a norm later), the all-to-all twice (q, k and
    v before the core, its output after), the pass's compute split evenly among them. The ring is not here: its
    exchange is waited for after the step's partial attention, which hides a late neighbour as it hides the wire."""
    syncs_tp, syncs_cp = 2 * (plan.tp > 1), 2 * (a2a > 1)
    syncs = syncs_tp + syncs_cp
    if not syncs:
        return (0.0, 0.0), (0.0, 0.0)
    group = max(plan.tp if syncs_tp else 1, a2a if syncs_cp else 1)
    f, b = sync_waits_s(hw.calibration, group_size=group, syncs=syncs, forward_s=times.forward_s,
                        backward_s=times.backward_s)
    return (f * syncs_tp / syncs, b * syncs_tp / syncs), (f * syncs_cp / syncs, b * syncs_cp / syncs)


def layer_costs(plan, *, model, cluster, job, engine: str = "ours") -> LayerCosts:
    """Per-layer time and memory of `plan` as `engine` runs it (LayerCosts; estimate() sums them per chunk)."""
    if model.is_moe:
        return _moe_layer_costs(plan, model=model, cluster=cluster, job=job, engine=engine)
    eng = engine_model(engine)
    hw, b, tp, sp, cp = cluster.hardware, plan.micro_batch, plan.tp, plan.sequence_parallel, plan.cp
    if cp > 1 and not eng.context_parallel:
        raise PlannerError(f"engine {engine} has no context parallelism (cp {cp}); price it as ours, megatron or "
                           f"torchtitan")
    a2a, ring = plan.cp_split(ranks_per_node=cluster.devices_per_node)
    # Under CP every token-wise tensor holds this rank's seq_len / cp tokens (runners/context_parallel.py).
    s = job.seq_len // cp
    dims = dict(micro_batch=b, seq_len=s, tp=tp, sequence_parallel=sp, precision=job.precision)
    whole = dict(dims, seq_len=job.seq_len, engine=eng, cp=cp, ring_size=ring)
    times = layer_compute_times(model, hw, **whole)
    ends = end_compute_times(model, hw, **dims)
    slow = layer_compute_times(model, contended(hw), **whole)
    share_f, share_b = times.forward_s / slow.forward_s, times.backward_s / slow.backward_s
    core_fwd_s = times.attention_core_forward_s
    times, ends = _with_host_costs(model, times, ends, hw=hw, plan=plan, eng=eng, cp_split=(a2a, ring))
    # The share the engine hides behind its GEMMs (Transformer Engine's TP overlap) leaves the path, but
    # slows those GEMMs for the SMs it holds (see _overlap).
    exposed = 1.0 - eng.tp_comm_hidden * 0.5 * (share_f + share_b)
    gather_s, scatter_s, reduce_s = _tp_collectives_s(cluster, act_bytes=b * s * model.hidden_size
                                                      * activation_bytes_per_element(job.precision), tp=tp)
    one_s = exposed * (gather_s + scatter_s if sp else reduce_s)
    embed_comm_s = exposed * (scatter_s if sp else reduce_s)
    tp_wait, cp_wait = _sync_waits(plan, hw, times=times, a2a=a2a)
    tp_fwd_s = 2 * one_s + tp_wait[0]
    cp_fwd_s, cp_bwd_s = _context_comm_s(plan, cluster, model=model, job=job, core_forward_s=core_fwd_s, wait=cp_wait)
    rep_s, rep_first_s, rep_last_s = _sp_replicated_reduce_s(plan, cluster, model=model, eng=eng, precision=job.precision)
    recompute_s, tp_comm, cp_comm = _policy_times(times, hw, tp_fwd_s=tp_fwd_s, cp_fwd_s=cp_fwd_s, cp_bwd_s=cp_bwd_s,
                                                  tp_bwd_s=rep_s + tp_wait[1] - tp_wait[0])
    first_params, last_params = end_params_per_device(model, tp=tp, pp=plan.pp)
    grad_pass_s = _unsharded_grad_pass_s(plan, eng=eng, hw=hw, precision=job.precision)
    layer_grad_s = grad_pass_s(layer_params_per_device(model, tp=tp))
    time_s = {p: times.forward_s + times.backward_s + recompute_s[p] + tp_comm[p] + layer_grad_s for p in POLICIES}
    activation = _layer_activations(plan, model=model, job=job, eng=eng, hw=hw, dims=dims, ring=ring)
    shards = dict(param_shard=plan.param_shard, grad_shard=plan.grad_shard, optim_shard=plan.optim_shard,
                  precision=job.precision, reduce_fp32=plan.reduce_fp32, fp8_params=eng.fp8_param_gather)
    state = model_state_bytes(layer_params_per_device(model, tp=tp), **shards)
    first_act, last_act = end_activation_bytes(model, **dims)
    return LayerCosts(
        time_s=time_s, activation_bytes=activation, state_bytes=state.total_bytes,
        # The vocabulary-parallel embedding sums its partial lookups (all-reduce; reduce-scatter under
        # SP); the head's input is all-reduced in backward (under SP: gathered forward, scattered back).
        first_extra_time_s=ends.embed_forward_s + ends.embed_backward_s + embed_comm_s + rep_first_s
        + grad_pass_s(first_params),
        last_extra_time_s=ends.head_forward_s + ends.head_backward_s + one_s + rep_last_s + grad_pass_s(last_params),
        first_extra_bytes=model_state_bytes(first_params, **shards).total_bytes,
        last_extra_bytes=model_state_bytes(last_params, **shards).total_bytes
        + logits_bytes(model, micro_batch=b, seq_len=s, tp=tp),
        first_extra_activation_bytes=first_act, last_extra_activation_bytes=last_act,
        forward_time_s={p: times.forward_s + tp_fwd_s + cp_fwd_s for p in POLICIES},
        first_extra_forward_s=ends.embed_forward_s + embed_comm_s,
        last_extra_forward_s=ends.head_forward_s + (exposed * gather_s if sp else 0.0),
        first_extra_tp_comm_s=embed_comm_s + rep_first_s, last_extra_tp_comm_s=one_s + rep_last_s,
        tp_comm_s=tp_comm, cp_comm_s=cp_comm, recompute_time_s=recompute_s, replicated_reduce_s=rep_s,
        cp_working_bytes=_ring_working_bytes(model, plan=plan, seq_len=job.seq_len, ring=ring, eng=eng, hw=hw),
        overlap_efficiency_forward=share_f, overlap_efficiency_backward=share_b)


def _sp_reduces_per_micro_batch(plan, eng) -> bool:
    """Whether `eng` all-reduces the replicated parameters' gradients over TP in every micro-batch under
    `plan` (sequence parallelism over more than one TP rank; EngineModel.sp_replicated_grad_reduce)."""
    return plan.sequence_parallel and plan.tp > 1 and eng.sp_replicated_grad_reduce == "micro_batch"


def _sp_replicated_reduce_s(plan, cluster, *, model, eng, precision: str) -> tuple[float, float, float]:
    """Seconds per micro-batch of the TP all-reduces that sum the replicated parameters' gradients, where the
    engine issues them in every micro-batch's backward (EngineModel.sp_replicated_grad_reduce): (one layer,
    the first chunk's extra, the last chunk's extra). Each parameter is its own call, latency-bound. Under
    sequence parallelism: a layer's two norms (LayerNorm: weight and bias) and, with biases, the two
    row-parallel ones; the learned positions on the first chunk; the final norm on the last. Timed in one
    2-process tiny tp2 sp step: 304 all-reduces, 471 of its 3708 ms (the rest of SP's extra its all-gathers
    and reduce-scatters, priced as `one_s`). Qwen3's query and key head norms under any TP > 1: each TP rank
    normalises other heads with the same weight (runners/transformer.py, HeadNorm)."""
    if plan.tp == 1 or eng.sp_replicated_grad_reduce != "micro_batch":
        return 0.0, 0.0, 0.0
    nbytes = activation_bytes_per_element(precision)

    def all_reduce_s(numel: int) -> float:
        return collective_time_s(cluster, collective="all_reduce", size_bytes=numel * nbytes, group_size=plan.tp,
                                 stride=1)

    head_norms_s = 2 * all_reduce_s(model.head_dim) if model.qk_norm else 0.0
    if not _sp_reduces_per_micro_batch(plan, eng):
        return head_norms_s, 0.0, 0.0
    h = model.hidden_size
    norm_s = all_reduce_s(h) * (2 if model.arch == "gpt2" else 1)
    layer_s = head_norms_s + 2 * norm_s + (2 * all_reduce_s(h) if model.has_bias else 0.0)
    first_s = all_reduce_s(model.max_seq_len * h) if model.learned_positions else 0.0
    return layer_s, first_s, norm_s


def _unsharded_grad_pass_s(plan, *, eng, hw, precision: str):
    """Seconds per micro-batch of the engine's FSDP passes over `params` parameters' unsharded gradient
    (`unsharded_grad_pass_bytes`), as a function of `params`; 0 for engines without them. They run on a
    side stream beside the backward's GEMMs, which leave a bandwidth-bound kernel no room to hide:
    priced on the backward's path."""
    kind = eng.unsharded_grad_passes
    if not kind or hw.device_type != "cuda":
        return lambda params: 0.0
    assert kind in UNSHARDED_GRAD_KERNELS, kind
    # The reduction group (dp x cp) decides, not the gradients' sharding: the search hands one slot's layer
    # costs to every sharding variant of it, so they may not depend on it (FSDP1's hooks run under every
    # strategy; FSDP2's copy-in is priced for a replicate-only torchtitan run too).
    per_param = unsharded_grad_pass_bytes(precision, reduce_bytes=reduce_bytes_per_param(
        precision, eng, reduce_fp32=plan.reduce_fp32), dp=plan.dp_cp, kind=kind)
    kernels = UNSHARDED_GRAD_KERNELS[kind]
    return lambda params: memory_time_s(hw, per_param * params, num_kernels=kernels) if params and per_param else 0.0


def _moe_layer_costs(plan, *, model, cluster, job, engine: str) -> LayerCosts:
    """LayerCosts of an MoE model: its dense layers priced as a dense model's, its MoE layers as the dense
    layer without its MLP (`moe_cost.attention_view`) plus the MoE MLP (cost_models/moe.py: router and
    expert GEMMs, the exposed dispatch and combine all-to-alls, ETP's gather and scatter, activations),
    averaged over the layers by their share (exact for models whose layers are all MoE; for DeepSeek-V3's 3
    of 61 dense layers every chunk is priced at the mix). The states are the non-expert parameters under
    the plan's sharding; the experts' own are added per chunk (`_price_chunk`, over expert-DP)."""
    dense = layer_costs(plan, model=moe_cost.dense_view(model), cluster=cluster, job=job, engine=engine)
    attn = layer_costs(plan, model=moe_cost.attention_view(model, tp=plan.tp), cluster=cluster, job=job, engine=engine)
    if not model.shared_expert_ffn_hidden_size:  # a shared expert is TP-split over the gathered tokens
        attn = _without_mlp_tp_comm(attn)
    hw, p = cluster.hardware, activation_bytes_per_element(job.precision)
    tokens = plan.micro_batch * job.seq_len // plan.cp // (plan.tp if plan.sequence_parallel else 1)
    # max / mean rows of the busiest EP rank: measured (a calibration's moe_imbalance) or expected from
    # how the model balances its router (cost_models/moe.py)
    imbalance = hw.calibration.get("moe_imbalance", moe_cost.expected_imbalance(model, tokens=tokens, ep=plan.ep,
                                                                                seq_len=job.seq_len))
    eng = engine_model(engine)
    times = _moe_mlp_times(model, hw, plan=plan, precision=job.precision, eng=eng, tokens=tokens, imbalance=imbalance)
    buffer = tokens * model.num_experts_per_token * model.hidden_size * p
    a2a_s = _ep_all_to_all_s(plan, cluster, model=model, eng=eng, tokens=tokens, precision=job.precision,
                             buffer_bytes=buffer) * imbalance  # the busiest rank's rows
    # Expert TP: the etp ranks of an expert gather its rows before and reduce-scatter its outputs after.
    etp_s = 2 * _etp_exchange_s(plan, cluster, gathered_bytes=buffer * plan.etp * imbalance)
    counts_s = _routing_counts_s(plan, cluster, model=model)  # every forward, a recomputed one too
    comm = {pol: moe_cost.all_to_alls_per_layer(pol) / 2 * (2 * a2a_s + etp_s) + counts_s * (2 if pol == "full" else 1)
            for pol in POLICIES}
    a2a_size = plan.cp_split(ranks_per_node=cluster.devices_per_node)[0]
    ep_f, ep_b = _ep_sync_waits(plan, hw, attn=attn, moe=times, a2a=a2a_size)
    comm = {pol: c + ep_f + ep_b + (ep_f if pol == "full" else 0.0) for pol, c in comm.items()}
    if eng.moe_a2a_overlap:
        comm = _overlapped_ep_comm(plan, comm, a2a_s=a2a_s + etp_s / 2, attn=attn, moe=times, cluster=cluster)
    act = moe_cost.moe_activation_bytes(model, tokens=tokens, ep=plan.ep, etp=plan.etp, imbalance=imbalance,
                                        precision=job.precision)
    state = model_state_bytes(moe_cost.nonexpert_layer_params_per_device(model, tp=plan.tp), precision=job.precision,
                              param_shard=plan.param_shard, grad_shard=plan.grad_shard, optim_shard=plan.optim_shard,
                              reduce_fp32=plan.reduce_fp32).total_bytes
    router_s = _moe_replicated_reduce_s(plan, cluster, model=model, eng=eng, nbytes=p)
    extra = {"time_s": {pol: times.forward_s + times.backward_s + comm[pol] + router_s
                        + (times.forward_s if pol == "full" else 0.0) for pol in POLICIES},
             "forward_time_s": {pol: times.forward_s + comm["none"] / 2 for pol in POLICIES},
             "recompute_time_s": {"none": 0.0, "selective": 0.0, "full": times.forward_s},
             "tp_comm_s": {pol: c + router_s for pol, c in comm.items()},
             "activation_bytes": {"none": act, "selective": act, "full": 0.0}}
    if eng.recompute_modules != ("core_attn",):
        dense, attn, extra = _named_module_recompute(eng.recompute_modules, dense=dense, attn=attn, extra=extra,
                                                     moe=times, comm=comm, act_bytes=act, model=model, hw=hw,
                                                     tokens=tokens, imbalance=imbalance, plan=plan, precision=job.precision)
    phi = moe_cost.moe_fraction(model)

    def mix(name: str) -> dict[str, float]:
        ours, theirs, add = getattr(dense, name), getattr(attn, name), extra.get(name, {})
        return {pol: (1 - phi) * ours[pol] + phi * (theirs[pol] + add.get(pol, 0.0)) for pol in ours}

    return dataclasses.replace(dense, state_bytes=state, **{name: mix(name) for name in (
        "time_s", "activation_bytes", "forward_time_s", "tp_comm_s", "cp_comm_s", "recompute_time_s")})


def _ep_sync_waits(plan, hw, *, attn: LayerCosts, moe, a2a: int) -> tuple[float, float]:
    """(forward, backward) seconds an MoE layer waits at EP's dispatch and combine for the ranks that reach them
    last (`_sync_waits`): the combine after the experts' compute, the dispatch after the attention block's, which
    ends at a TP or CP all-to-all collective of its own where the plan has one (only the router then)."""
    if plan.ep <= 1:
        return 0.0, 0.0
    alone = plan.tp == 1 and a2a == 1
    attn_f = attn.forward_time_s["none"] if alone else 0.0
    attn_b = attn.time_s["none"] - attn.forward_time_s["none"] if alone else 0.0
    wait = [sync_wait_s(hw.calibration, group_size=plan.ep, segment_s=s) for s in (moe.forward_s, attn_f,
                                                                                   moe.backward_s, attn_b)]
    return wait[0] + wait[1], wait[2] + wait[3]


def _moe_replicated_reduce_s(plan, cluster, *, model, eng, nbytes: int) -> float:
    """Seconds per micro-batch of an MoE layer's TP-replicated gradients' all-reduces under sequence
    parallelism, where the engine issues them every micro-batch: the router's (runners/moe.py, `route`) and
    Qwen2-MoE's shared-expert gate's."""
    if not _sp_reduces_per_micro_batch(plan, eng):
        return 0.0
    sizes = [model.router_params()] + ([model.hidden_size] if model.shared_expert_gate else [])
    return sum(collective_time_s(cluster, collective="all_reduce", size_bytes=n * nbytes, group_size=plan.tp, stride=1)
               for n in sizes)


def _ep_all_to_all_s(plan, cluster, *, model, eng, tokens: int, precision: str, buffer_bytes: float) -> float:
    """One dispatch (or combine) all-to-all over the EP group at mean load. GPUs: NCCL's pairwise sends
    (moe_cost.all_to_all_time_s). CPUs: gloo's alltoall as the profile measured it (its all_to_all curve at
    the EP group's size) with the per-call overhead every collective pays (`collective_time_s`), on the
    rank's whole buffer of tokens x k rows, as the curve's points were timed."""
    if plan.ep == 1:
        return 0.0
    if cluster.hardware.device_type == "cpu":
        return collective_time_s(cluster, collective="all_to_all", size_bytes=buffer_bytes, group_size=plan.ep,
                                 stride=plan.etp)
    return moe_cost.all_to_all_time_s(model, cluster.hardware, tokens=tokens, ep=plan.ep, etp=plan.etp,
                                      ranks_per_node=cluster.devices_per_node, precision=precision,
                                      dispatcher=eng.moe_dispatcher)


def _etp_exchange_s(plan, cluster, *, gathered_bytes: float) -> float:
    """One gather of the EP-received rows over the ETP group (its reduce-scatter back costs the same), of
    `gathered_bytes` gathered. GPUs: an all-gather (Megatron-Core's). CPUs: this engine builds both from
    gloo's alltoall (runners/expert_parallel.py), which moves the same bytes, priced from the profile's
    all_to_all curve on the whole gathered buffer, like the dispatch (`_ep_all_to_all_s`)."""
    if plan.etp == 1:
        return 0.0
    collective = "all_to_all" if cluster.hardware.device_type == "cpu" else "all_gather"
    return collective_time_s(cluster, collective=collective, size_bytes=gathered_bytes, group_size=plan.etp, stride=1)


def _routing_counts_s(plan, cluster, *, model) -> float:
    """Seconds per MoE layer forward of the routing's small collectives: summing each sequence's per-expert
    assignment counts (micro-batch x experts int64, for the load-balancing loss and the capacity) over the
    ranks holding its other tokens, the TP group under sequence parallelism, then the CP group
    (runners/moe.py, `_sequence_counts`); and under EP the exchange of the per-expert row counts that sizes
    the dispatch (runners/expert_parallel.plan_dispatch: an all-to-all of experts int64; Megatron-Core's
    alltoall dispatcher exchanges its tokens_per_expert likewise), and under expert TP the all-gather of
    the received counts over the ETP group (etp x experts int64 gathered)."""
    nbytes = plan.micro_batch * model.num_experts * 8
    seconds = 0.0
    if plan.ep > 1:
        seconds += collective_time_s(cluster, collective="all_to_all", size_bytes=model.num_experts * 8,
                                     group_size=plan.ep, stride=plan.etp)
    if plan.etp > 1:
        seconds += collective_time_s(cluster, collective="all_gather", size_bytes=plan.etp * model.num_experts * 8,
                                     group_size=plan.etp, stride=1)
    if plan.sequence_parallel and plan.tp > 1:
        seconds += collective_time_s(cluster, collective="all_reduce", size_bytes=nbytes, group_size=plan.tp, stride=1)
    if plan.cp > 1:
        seconds += collective_time_s(cluster, collective="all_reduce", size_bytes=nbytes, group_size=plan.cp,
                                     stride=plan.tp)
    return seconds


def _moe_mlp_times(model, hw, *, plan, precision: str, eng, tokens: int, imbalance: float) -> moe_cost.MoETimes:
    """Forward and backward seconds of one MoE layer's MLP compute on one rank: router and expert GEMMs,
    the dispatcher's permutations, the eager engine's per-op overhead of its extra ops, and under fp8 each
    expert's operand casts (the experts' GEMMs run in fp8: Transformer Engine's GroupedLinear under
    fp8_autocast; moe_cost.fp8_quantize_times_s)."""
    gemms = moe_cost.moe_compute_times(model, hw, tokens=tokens, ep=plan.ep, etp=plan.etp, tp=plan.tp,
                                       imbalance=imbalance, dtype=precision, accumulate_fp32=eng.main_grads_fp32,
                                       expert_streams=eng.expert_gemm_streams)
    parts = [gemms, moe_cost.permutation_times_s(model, hw, tokens=tokens, ep=plan.ep, etp=plan.etp,
                                                 imbalance=imbalance, precision=precision,
                                                 dispatcher=eng.moe_dispatcher)]
    if precision == "fp8":
        parts.append(moe_cost.fp8_quantize_times_s(model, hw, tokens=tokens, ep=plan.ep, etp=plan.etp,
                                                   imbalance=imbalance))
    op_s = hw.calibration.get("op_overhead_s", 0.0)  # the eager engine's per-op cost (0 on GPUs)
    if op_s > 0:
        ops_f, ops_b = moe_cost.moe_extra_ops(model, ep=plan.ep, etp=plan.etp)
        parts.append(moe_cost.MoETimes(forward_s=ops_f * op_s, backward_s=ops_b * op_s))
    # The experts are a unit of their own engine, at the expert sharding (runners/train.py).
    parts.append(moe_cost.MoETimes(*sharding_bookkeeping_s(hw, shards=plan.expert_shard_degrees, eng=eng)))
    return moe_cost.MoETimes(forward_s=sum(t.forward_s for t in parts), backward_s=sum(t.backward_s for t in parts))


def _without_mlp_tp_comm(attn: LayerCosts) -> LayerCosts:
    """An MoE layer's part outside its MLP (`moe_cost.attention_view`) without the dense MLP's TP collectives:
    the dense layer gathers its sequence-parallel tokens before the MLP and reduce-scatters after it (one
    of its two all-gather + reduce-scatter pairs), but Megatron-Core's MoE layer routes each TP rank's own
    sequence-parallel shard (moe_layer.py requires SP under TP; the dispatcher's only TP-like collectives
    are expert TP's, priced as etp_s), so only the attention's pair remains: half the layer's TP part. A
    shared expert (shared_experts.py) is a TP-split dense MLP over the gathered sequence, which keeps the
    pair (moe_gemms prices it over tp x tokens)."""
    tp_part = {pol: attn.tp_comm_s[pol] - attn.cp_comm_s.get(pol, 0.0) - attn.replicated_reduce_s
               for pol in attn.tp_comm_s}
    return dataclasses.replace(
        attn, time_s={pol: t - tp_part[pol] / 2 for pol, t in attn.time_s.items()},
        tp_comm_s={pol: c - tp_part[pol] / 2 for pol, c in attn.tp_comm_s.items()},
        # the forward's share: tp_comm_s["none"] is twice the forward's TP seconds (_policy_times)
        forward_time_s={pol: t - tp_part["none"] / 4 for pol, t in attn.forward_time_s.items()})


def _named_module_recompute(modules, *, dense, attn, extra, moe, comm, act_bytes, model, hw, tokens, imbalance, plan,
                            precision):
    """The selective policy as Megatron-Core runs --recompute-modules: the attention core only where named
    ("core_attn"); "layernorm" reruns a layer's two RMSNorms in backward (one read and one write of its
    tokens x h each, bandwidth-bound) and keeps neither output; "moe_act" reruns the experts' SwiGLU (two
    rows x F read, one written) and keeps not its product; "moe" reruns the whole MoE layer's forward, its
    dispatch and combine with it (the forward pair again, as under full recomputation), and keeps none of
    its activations. Returns (dense, attn, extra) with their selective entries rebuilt."""
    p, h = activation_bytes_per_element(precision), model.hidden_size
    norm_s = memory_time_s(hw, 2 * 2 * p * tokens * h, num_kernels=2) if "layernorm" in modules else 0.0
    norm_bytes = 2 * p * tokens * h if "layernorm" in modules else 0.0
    core = "core_attn" in modules
    dense, attn = (_recompute_selective(c, core=core, time_s=norm_s, comm_s=0.0, saved_bytes=norm_bytes)
                   for c in (dense, attn))
    if "moe" in modules:
        moe_s, moe_comm_s, moe_bytes = moe.forward_s, comm["full"] - comm["none"], act_bytes
    elif "moe_act" in modules:
        rows = moe_cost.rows_per_expert(model, tokens=tokens, ep=plan.ep, etp=plan.etp, imbalance=imbalance) \
            * model.num_experts / plan.ep
        f = model.expert_ffn_hidden_size / plan.etp
        moe_s, moe_comm_s, moe_bytes = memory_time_s(hw, 3 * p * rows * f, num_kernels=1), 0.0, p * rows * f
    else:
        moe_s = moe_comm_s = moe_bytes = 0.0
    extra = {**extra, **{name: {**values, "selective": values["none"] + add} for name, values, add in (
        (name, extra[name], add) for name, add in (("time_s", moe_s + moe_comm_s), ("recompute_time_s", moe_s),
                                                   ("tp_comm_s", moe_comm_s), ("activation_bytes", -moe_bytes)))}}
    return dense, attn, extra


def _recompute_selective(costs, *, core: bool, time_s: float, comm_s: float, saved_bytes: float):
    """`costs` with its selective policy recomputing the attention core only where `core`, plus `time_s`
    of other recomputed forward (with `comm_s` of its communication) and `saved_bytes` fewer kept."""
    base = "selective" if core else "none"

    def rebuilt(name: str, add: float) -> dict[str, float]:
        values = getattr(costs, name)
        return {**values, "selective": max(0.0, values[base] + add)}

    return dataclasses.replace(costs, time_s=rebuilt("time_s", time_s + comm_s),
                               recompute_time_s=rebuilt("recompute_time_s", time_s),
                               tp_comm_s=rebuilt("tp_comm_s", comm_s), cp_comm_s=rebuilt("cp_comm_s", 0.0),
                               activation_bytes=rebuilt("activation_bytes", -saved_bytes))


def paired_share(plan) -> float:
    """Share of a rank's chunk passes that the combined 1F1B schedule pairs, one micro-batch's forward with
    another's backward, averaged over the pipeline's ranks: the warm-up forwards and the cool-down
    backwards run alone (rank r of pp warms up pp - 1 - r chunks under 1F1B, 2 (pp - 1 - r) + (v - 1) pp
    interleaved: Megatron-Core's schedules.py), and without a pipeline the first forward and the last
    backward (pp - 1 - r at least 1). The EP overlap hides a pass's dispatch and combine only when paired."""
    pp, v, m = plan.pp, plan.virtual_stages, plan.num_micro_batches
    if v > 1:
        warmup = [2 * (pp - 1 - r) + (v - 1) * pp for r in range(pp)]
    else:
        warmup = [pp - 1 - r for r in range(pp)]
    passes = m * v
    return sum(max(0.0, passes - min(passes, max(1, w))) for w in warmup) / (pp * passes)


def _overlapped_ep_comm(plan, comm: dict[str, float], *, a2a_s: float, attn: LayerCosts, moe,
                        cluster) -> dict[str, float]:
    """The layer's EP communication under Megatron-Core's EP overlap: the phased exposure
    (`_phased_ep_comm`) in the passes the schedule pairs (`paired_share`), all of it in the rest. The
    attention side's times include its TP collectives, which run on the compute stream."""
    attn_forward_s = attn.forward_time_s["none"]
    hidden = _phased_ep_comm(comm, a2a_s=a2a_s, attn_forward_s=attn_forward_s,
                             attn_backward_s=attn.time_s["none"] - attn_forward_s, moe=moe, cluster=cluster,
                             efficiency=0.5 * (attn.overlap_efficiency_forward + attn.overlap_efficiency_backward))
    steady = paired_share(plan)
    return {pol: c - steady * (c - hidden[pol]) for pol, c in comm.items()}


def _phased_ep_comm(comm: dict[str, float], *, a2a_s: float, attn_forward_s: float, attn_backward_s: float,
                    moe, cluster, efficiency: float) -> dict[str, float]:
    """The MoE layer's exposed dispatch and combine under Megatron-Core's EP overlap
    (--overlap-moe-expert-parallel-comm). The combined 1F1B schedule pairs one micro-batch's forward of a
    layer with another's backward of it and runs them as four phases, a communication stream beside a
    compute stream (megatron/core/models/common/model_chunk_schedule_plan.py,
    TransformerLayerSchedulePlan.run):
      1. combine backward   beside attention forward (and the previous layer's attention weight gradients,
                            which the schedule delays to here);
      2. dispatch forward   beside the experts' input-gradient backward;
      3. dispatch backward  beside the experts' weight gradients and their forward;
      4. combine forward    beside attention's input-gradient backward.
    Each phase waits for both of its predecessors (the next all-to-all needs the compute just done and the
    next compute the tokens just moved), so an all-to-all hides only behind its own phase's compute
    (`_overlap`: the SMs it holds slow that compute by `efficiency`), never behind the whole layer. A
    backward's input and weight gradients are taken as halves (the same GEMM FLOPs each). The recomputed
    forward pair of full recomputation (and of the "moe" recompute module) stays exposed."""
    phases = ((a2a_s, attn_forward_s + attn_backward_s / 2), (a2a_s, moe.backward_s / 2),
              (a2a_s, moe.backward_s / 2 + moe.forward_s), (a2a_s, attn_backward_s / 2))
    exposed = sum(_overlap(compute_s, comm_s, cluster, efficiency=efficiency) - compute_s
                  for comm_s, compute_s in phases)
    return {pol: exposed + (c - comm["none"]) for pol, c in comm.items()}


def _context_comm_s(plan, cluster, *, model, job, core_forward_s: float,
                    wait: tuple[float, float] = (0.0, 0.0)) -> tuple[float, float]:
    """Exposed CP communication of one layer per micro-batch, (forward, backward): the all-to-alls whole,
    each ring step's message less what its partial attention hides (`_overlap`; cost_models/context.py),
    plus `wait`, the all-to-all's (forward, backward) wait for its last ranks (`_sync_waits`)."""
    if plan.cp == 1:
        return 0.0, 0.0
    ctx = context_comm(plan, cluster, model=model, job=job, core_forward_s=core_forward_s,
                       core_backward_s=FUSED_BACKWARD_RATIO * core_forward_s, collective_time_s=collective_time_s)
    fwd = ctx.a2a_forward_s + sum(_overlap(c, m, cluster) - c for m, c in ctx.ring_forward)
    bwd = ctx.a2a_backward_s + sum(_overlap(c, m, cluster) - c for m, c in ctx.ring_backward)
    return fwd + wait[0], bwd + wait[1]


def _materialized_scores_bytes(model, *, micro_batch: int, seq_len: int, heads_split: int, precision: str,
                               dropout: bool) -> float:
    p = activation_bytes_per_element(precision)
    per_score = p + (1 if dropout and model.arch == "gpt2" else 0)
    return micro_batch * model.num_heads / heads_split * seq_len * seq_len * per_score


def _ring_working_bytes(model, *, plan, seq_len: int, ring: int, eng, hw) -> float:
    """This engine's written-out ring builds one step's fp32 scores and probabilities (step 0's full square of
    s / r tokens, for num_heads / (tp x cp / r) heads); a fused kernel keeps no square."""
    if ring == 1 or not ring_blocks_written_out(eng, hw.device_type):
        return 0.0
    heads = plan.micro_batch * model.num_heads // (plan.tp * plan.cp // ring)
    return 2 * 4.0 * heads * (seq_len // ring) ** 2


@dataclass
class _ChunkPrice:
    """One chunk's per-micro-batch seconds on its rank (internal to estimate)."""

    forward_s: float  # the F action, exposed communication included
    backward_s: float  # the B action
    compute_s: float  # forward + backward compute, no recomputation, no communication
    recompute_s: float
    tp_comm_s: float  # exposed in-layer communication, TP and CP
    dp_comm_s: float  # DP/ZeRO communication per micro-batch (gathers, reduce-scatters, host copies)
    reduce_s: float  # the step-end reduction of this chunk's gradients
    last_bucket_s: float
    num_params: float
    activation_bytes: float  # per micro-batch in flight
    cache_bytes: float  # MAZ3 device/secondary copies held while a micro-batch is in flight
    host_cache_bytes: float
    recompute_working_bytes: float  # one recomputed layer's activations, rebuilt during its backward
    # Commshift (Hosoki et al., CCGrid 2025): the last backward without its reduce-scatter, and the
    # chunk's whole last-micro-batch reduction (reduce-scatter + all-reduce) issued after its last send.
    shift_backward_s: float = 0.0
    shift_reduce_s: float = 0.0
    # Without commshift: the last backward with the SM share the boundary reduction's buckets take from
    # it while they run beside it (GPUs; estimate._overlap), and the wire seconds (inter-node bandwidth
    # terms, what shares a link with a send: linkshare.py) of the boundary reduction and of commshift's.
    beside_backward_s: float = 0.0
    reduce_wire_s: float = 0.0
    shift_reduce_wire_s: float = 0.0
    forward_compute_s: float = 0.0  # one micro-batch's forward compute (window for hiding the redistribution)
    forward_comm_s: float = 0.0  # its parameter gathers, which compete for that window
    backward_compute_s: float = 0.0  # one micro-batch's backward compute (recomputation and TP included)
    comm: _ShardingComm | None = None
    cp_comm_s: float = 0.0  # the CP part of tp_comm_s
    num_expert_params: float = 0.0  # routed-expert parameters (sharded over expert-DP, not in num_params)
    # The share of communication beside this chunk's forward / backward compute that hides (_overlap).
    overlap_efficiency: tuple[float, float] = (1.0, 1.0)


@dataclass(frozen=True)
class _ShardingComm:
    """Per micro-batch DP/ZeRO communication of one chunk, split by where it sits (seconds).

    Forward: the first layer's gather is exposed, the rest prefetch behind compute. Backward: the
    first layer's backward-side fetch (gather, host copy or secondary gather, by MAZ3 tier) is exposed,
    the others hide behind compute, and the gradient reduce-scatter (s_g > 1) hides too except its
    last bucket, which runs after the backward's compute. Commshift issues the last micro-batch's
    reduce-scatter after the stage's last send, so it is kept apart (`rs_hideable_s`, `rs_last_s`).
    """

    fwd_first_s: float = 0.0
    fwd_rest_s: float = 0.0
    bwd_first_s: float = 0.0
    bwd_rest_s: float = 0.0  # backward-side fetches of the other layers (no reduce-scatter)
    rs_hideable_s: float = 0.0
    rs_last_s: float = 0.0

    @property
    def total_s(self) -> float:
        return (self.fwd_first_s + self.fwd_rest_s + self.bwd_first_s + self.bwd_rest_s + self.rs_hideable_s
                + self.rs_last_s)

    @property
    def rs_s(self) -> float:
        return self.rs_hideable_s + self.rs_last_s


def _cache_fetch_s(plan, cluster, *, layer_bytes: float) -> dict[str, float]:
    """Backward-side cost of one layer's parameters under each MAZ3 tier (Liu et al., ICNP 2025): a
    second all-gather in the s_p group ("none"), nothing ("device": the forward's gathered copy stayed),
    a host-to-device copy ("host"), or an all-gather of the intra-node secondary shards ("secondary")."""
    tp, s_p = plan.tp, plan.param_shard
    gather_s = collective_time_s(cluster, collective="all_gather", size_bytes=layer_bytes, group_size=s_p, stride=tp)
    per_node = cluster.ranks_per_node_in_group(size=s_p, stride=tp)
    secondary_s = collective_time_s(cluster, collective="all_gather", size_bytes=layer_bytes,
                                    group_size=per_node, stride=tp)
    host_copy_s = layer_bytes / cluster.hardware.host_device_bandwidth_bytes_per_s
    host_copy_s *= cluster.hardware.calibration.get("comm_time_scale", 1.0)
    return {"none": gather_s, "device": 0.0, "host": host_copy_s, "secondary": secondary_s}


def _sharding_comm(plan, cluster, *, tiers: list[str], layer_bytes: float, grad_bytes: float,
                   end_bytes: float, num_end_units: int = 1, device_gather_fraction: float = 1.0,
                   reduce_scatter_once: bool = False) -> _ShardingComm:
    """Per micro-batch DP/ZeRO communication of one chunk whose layers use MAZ3 `tiers` (in layer
    order), following the plan's sharding degrees (see _ShardingComm). The chunk's `num_end_units`
    non-layer units (embedding, learned positions, final norm, head) each gather their own share of
    `end_bytes`: on a latency-bound link the count matters, not only the bytes."""
    tp, s_p, s_g = plan.tp, plan.param_shard, plan.grad_shard
    fwd_first = fwd_rest = bwd_first = bwd_rest = rs_hideable = rs_last = 0.0
    if s_p > 1:
        fetch = _cache_fetch_s(plan, cluster, layer_bytes=layer_bytes)
        gather_s = fetch["none"]
        end_s = num_end_units * collective_time_s(cluster, collective="all_gather",
                                                  size_bytes=end_bytes / max(1, num_end_units), group_size=s_p,
                                                  stride=tp) if end_bytes > 0 else 0.0
        # The first layer's gather cannot be prefetched behind compute; the rest are. A device-tier
        # layer stays gathered while any micro-batch of its chunk is in flight, so only the forwards
        # that find none in flight gather it (`device_gather_fraction` of them).
        forward_gather = [gather_s * (device_gather_fraction if t == "device" else 1.0) for t in tiers]
        fwd_first, fwd_rest = forward_gather[0], sum(forward_gather[1:]) + end_s
        fwd_rest += tiers.count("host") * fetch["host"]  # device-to-host copy of each host-tier layer
        # Backward runs the layers last to first: the last layer's fetch is the one that waits.
        bwd = [fetch[t] for t in reversed(tiers)]
        bwd_first, bwd_rest = (bwd[0] if bwd else 0.0), sum(bwd[1:]) + end_s
        if plan.prefetch_depth == 0:
            # Nothing is gathered ahead of use: every gather waits in line before its layer computes.
            fwd_first, fwd_rest, bwd_first, bwd_rest = fwd_first + fwd_rest, 0.0, bwd_first + bwd_rest, 0.0
    if s_g > 1 and not reduce_scatter_once:
        calls = bucket_calls(grad_bytes, bucket_bytes=plan.bucket_size_bytes, num_units=len(tiers) + num_end_units)
        rs_s = calls * collective_time_s(cluster, collective="reduce_scatter", size_bytes=grad_bytes / calls,
                                         group_size=s_g, stride=tp)
        rs_last = collective_time_s(cluster, collective="reduce_scatter",
                                    size_bytes=grad_bytes / calls, group_size=s_g, stride=tp)
        rs_last = min(rs_last, rs_s)
        rs_hideable = rs_s - rs_last
    return _ShardingComm(fwd_first, fwd_rest, bwd_first, bwd_rest, rs_hideable, rs_last)


def bucket_calls(total_bytes: float, *, bucket_bytes: float, num_units: int) -> int:
    """Reduce-scatter calls a chunk's per-micro-batch gradient reduction of `total_bytes` over
    `num_units` units makes: one per bucket, a bucket being whole units (layers, embedding, head) taken in
    backward order until it holds `bucket_bytes` (runners/sharding/buckets.py; PyTorch FSDP1 and FSDP2
    reduce-scatter each wrapped unit on its own, and llm-foundry and torchtitan wrap every block: a
    bucket of one unit). Each call pays the ring's latency, which over n ranks grows with n
    (cost_models/comm.ring_extra_intra_steps), so pricing the chunk's gradients as one call hid that
    growth. Units are taken as equal in size. (The distributed optimizer's and Lins' parameter
    all-gathers after the step stay one call: Megatron buckets by its own size, not this plan's.)"""
    num_units = max(1, num_units)
    if total_bytes <= 0:
        return 1
    units_per_bucket = max(1, math.ceil(bucket_bytes / (total_bytes / num_units)))
    return math.ceil(num_units / units_per_bucket)


def _reduce_bucket_plans(plan, eng, *, grad_bytes_per_param: float):
    """The plan as its per-micro-batch reduce-scatters and its boundary all-reduce see their bucket: both the
    plan itself, except for an engine with its own bucket of unsharded gradient (EngineModel.
    reduce_bucket_elements: DeepSpeed ZeRO-3 / MiCS), whose reduce-scatters take that bucket and whose
    boundary all-reduce takes its 1/s_g shard."""
    if not eng.reduce_bucket_elements:
        return plan, plan
    bucket = eng.reduce_bucket_elements * grad_bytes_per_param
    return (plan.replace(bucket_size_bytes=max(1, int(bucket))),
            plan.replace(bucket_size_bytes=max(1, int(bucket / plan.grad_shard))))


def _boundary_reduce(plan, cluster, *, grad_bytes: float, reduce_scatter_once: bool = False) -> tuple[float, float]:
    """(seconds, last bucket seconds) of the step-end gradient reduction of `grad_bytes` over DP:
    an all-reduce over dp when gradients are not sharded, else an all-reduce of the shard across the
    dp / grad_shard replicas (the reduce-scatters inside each shard group ran every micro-batch); an
    engine that keeps whole gradients until the boundary (reduce_scatter_once: Megatron's distributed
    optimizer) reduce-scatters them there over the grad_shard group instead, then all-reduces the shard
    across the replicas."""
    dp, s_g, tp = plan.dp_cp, plan.grad_shard, plan.tp  # CP ranks reduce with DP's
    if reduce_scatter_once and s_g > 1:
        rs = collective_time_s(cluster, collective="reduce_scatter", size_bytes=grad_bytes, group_size=s_g, stride=tp)
        rs_last = collective_time_s(cluster, collective="reduce_scatter", size_bytes=min(grad_bytes, plan.bucket_size_bytes),
                                    group_size=s_g, stride=tp)
        across, across_last = _boundary_reduce(plan, cluster, grad_bytes=grad_bytes)
        return rs + across, min(rs, rs_last) + across_last
    size, group, stride = (grad_bytes, dp, tp) if s_g == 1 else (grad_bytes / s_g, dp // s_g, tp * s_g)
    if group <= 1:
        return 0.0, 0.0
    total = collective_time_s(cluster, collective="all_reduce", size_bytes=size, group_size=group, stride=stride)
    last = collective_time_s(cluster, collective="all_reduce", size_bytes=min(size, plan.bucket_size_bytes),
                             group_size=group, stride=stride)
    return total, min(last, total)


@dataclass(frozen=True)
class _ChunkSums:
    """One chunk's per-micro-batch totals over its layers (and the embedding / head it holds)."""

    forward_s: float
    total_s: float
    recompute_s: float
    tp_comm_s: float
    cp_comm_s: float
    activation_bytes: float
    num_params: float


def _chunk_sums(costs: LayerCosts, policies: list[str], *, first: bool, last: bool, num_params: float,
                end_params: tuple[float, float]) -> _ChunkSums:
    forward = sum(costs.forward_time_s[p] for p in policies)
    total = sum(costs.time_s[p] for p in policies)
    tp_comm = sum(costs.tp_comm_s[p] for p in policies)
    activation = sum(costs.activation_bytes[p] for p in policies)
    if first:
        forward += costs.first_extra_forward_s
        total += costs.first_extra_time_s
        tp_comm += costs.first_extra_tp_comm_s
        activation += costs.first_extra_activation_bytes
        num_params += end_params[0]
    if last:
        forward += costs.last_extra_forward_s
        total += costs.last_extra_time_s
        tp_comm += costs.last_extra_tp_comm_s
        activation += costs.last_extra_activation_bytes
        num_params += end_params[1]
    return _ChunkSums(forward_s=forward, total_s=total, recompute_s=sum(costs.recompute_time_s[p] for p in policies),
                      tp_comm_s=tp_comm, cp_comm_s=sum(costs.cp_comm_s.get(p, 0.0) for p in policies),
                      activation_bytes=activation, num_params=num_params)


def _with_expert_comm(plan, cluster, comm, *, reduce_s: float, last_bucket_s: float, expert_params: float,
                      num_moe: int, param_bytes: float, grad_bytes: float, eng):
    """The chunk's sharding communication and boundary reduction with its experts' own, over expert-DP at
    its sharding (cost_models/moe.expert_plan_view)."""
    view = moe_cost.expert_plan_view(plan)
    expert_comm = _sharding_comm(view, cluster, tiers=["none"] * num_moe, layer_bytes=expert_params / num_moe * param_bytes,
                                 grad_bytes=expert_params * grad_bytes, end_bytes=0.0, num_end_units=0,
                                 reduce_scatter_once=eng.reduce_scatter_once)
    comm = _ShardingComm(*(a + b for a, b in zip(dataclasses.astuple(comm), dataclasses.astuple(expert_comm))))
    expert_reduce_s, expert_last_s = _boundary_reduce(view, cluster, grad_bytes=expert_params * grad_bytes,
                                                      reduce_scatter_once=eng.reduce_scatter_once)
    return comm, reduce_s + expert_reduce_s, max(last_bucket_s, expert_last_s)


def _chunk_wire_fractions(plan, cluster, *, layer_bytes: float, grad_bytes: float) -> tuple[float, float, float]:
    """The parts of a chunk's overlapped parameter gathers, gradient reduce-scatters and boundary
    all-reduce that wait on an inter-node wire (what may hide behind compute, and what shares a link)."""
    gather = _wire_fraction(cluster, collective="all_gather", size_bytes=layer_bytes,
                            group_size=plan.param_shard, stride=plan.tp)
    scatter = _wire_fraction(cluster, collective="reduce_scatter", size_bytes=grad_bytes,
                             group_size=plan.grad_shard, stride=plan.tp)
    dp_group = (plan.dp_cp, plan.tp) if plan.grad_shard == 1 else (plan.dp_cp // plan.grad_shard, plan.tp * plan.grad_shard)
    reduce = _wire_fraction(cluster, collective="all_reduce", size_bytes=grad_bytes / plan.grad_shard,
                            group_size=dp_group[0], stride=dp_group[1])
    return gather, scatter, reduce


def _maz3_tiers(plan, cluster, *, tiers: list[str], layer_bytes: float, chunk: int) -> tuple[float, float]:
    """(share of the chunk's forward gathers left under MAZ3's device tier, bytes the device and secondary
    tiers keep). One kept copy per layer (module doc of runners/sharding/): the full layer on the device
    tier, the node's 1/per_node slice of it on the secondary tier. With pp > 1 a device-tier layer gathers
    only on its fresh forwards (a micro-batch's first pass through the chunk since its last backward)."""
    fraction = 1.0
    if "device" in tiers and plan.pp > 1:
        fresh = _fresh_forwards(plan.schedule, plan.pp, plan.virtual_stages, plan.num_micro_batches)[chunk]
        fraction = fresh / plan.num_micro_batches
    per_node = cluster.ranks_per_node_in_group(size=plan.param_shard, stride=plan.tp)
    return fraction, layer_bytes * (tiers.count("device") + tiers.count("secondary") / per_node)


def _price_chunk(plan, costs: LayerCosts, cluster, *, model, job, chunk: int, layers: range,
                 end_params: tuple[float, float], eng) -> _ChunkPrice:
    policies = [plan.layer_recompute(i) for i in layers]
    tiers = [plan.layer_cache(i) for i in layers]
    first, last = chunk == 0, chunk == plan.num_chunks - 1
    layer_params = (moe_cost.nonexpert_layer_params_per_device(model, tp=plan.tp) if model.is_moe
                    else layer_params_per_device(model, tp=plan.tp))
    sums = _chunk_sums(costs, policies, first=first, last=last, num_params=len(layers) * layer_params,
                       end_params=end_params)
    forward, total, recompute, tp_comm = sums.forward_s, sums.total_s, sums.recompute_s, sums.tp_comm_s
    cp_comm, activation, num_params = sums.cp_comm_s, sums.activation_bytes, sums.num_params
    param_bytes = gathered_param_bytes(job.precision, eng)
    # Gradients reduce in their own dtype: fp32 under the reduce_fp32 knob or where the engine reduces
    # fp32 main gradients (Megatron, torchtitan): 4-byte reductions.
    grad_bytes = reduce_bytes_per_param(job.precision, eng, reduce_fp32=plan.reduce_fp32)
    layer_bytes = layer_params * param_bytes
    end_bytes = ((end_params[0] if first else 0.0) + (end_params[1] if last else 0.0)) * param_bytes
    fraction, cache = _maz3_tiers(plan, cluster, tiers=tiers, layer_bytes=layer_bytes, chunk=chunk)
    first_units, last_units = end_units(model)
    num_end_units = first_units * first + last_units * last
    rs_plan, boundary_plan = _reduce_bucket_plans(plan, eng, grad_bytes_per_param=grad_bytes)
    comm = _sharding_comm(rs_plan, cluster, tiers=tiers, layer_bytes=layer_bytes, grad_bytes=num_params * grad_bytes,
                          reduce_scatter_once=eng.reduce_scatter_once,
                          end_bytes=end_bytes, num_end_units=num_end_units, device_gather_fraction=fraction)
    backward = total - forward
    reduce_s, last_bucket_s = _boundary_reduce(boundary_plan, cluster, grad_bytes=num_params * grad_bytes,
                                               reduce_scatter_once=eng.reduce_scatter_once)
    num_moe = sum(model.is_moe_layer(i) for i in layers)
    expert_params = moe_cost.expert_params_per_device(model, num_moe_layers=num_moe, ep=plan.ep, etp=plan.etp)
    if num_moe:
        comm, reduce_s, last_bucket_s = _with_expert_comm(
            plan, cluster, comm, reduce_s=reduce_s, last_bucket_s=last_bucket_s, expert_params=expert_params,
            num_moe=num_moe, param_bytes=param_bytes, grad_bytes=grad_bytes, eng=eng)
    working = max((costs.activation_bytes["none"] - costs.activation_bytes[p] for p in policies), default=0.0)
    gather_wire, rs_wire, reduce_wire = _chunk_wire_fractions(plan, cluster, layer_bytes=layer_bytes,
                                                              grad_bytes=num_params * grad_bytes)
    e_f, e_b = costs.overlap_efficiency_forward, costs.overlap_efficiency_backward
    backward_s = comm.bwd_first_s + comm.rs_last_s + _overlap(
        backward, comm.bwd_rest_s + comm.rs_hideable_s, cluster,
        wire_s=gather_wire * comm.bwd_rest_s + rs_wire * comm.rs_hideable_s, efficiency=e_b)
    # The boundary buckets issued during the last backward (all but the last) run beside its compute.
    beside = min(backward, max(0.0, reduce_s - last_bucket_s))
    reduce_toll_s = _overlap(backward, beside, cluster, wire_s=reduce_wire * beside, efficiency=e_b) - backward
    return _ChunkPrice(
        forward_s=comm.fwd_first_s + _overlap(forward, comm.fwd_rest_s, cluster, wire_s=gather_wire * comm.fwd_rest_s,
                                              efficiency=e_f),
        backward_s=backward_s,
        compute_s=total - recompute - tp_comm, recompute_s=recompute, tp_comm_s=tp_comm, dp_comm_s=comm.total_s,
        reduce_s=reduce_s, last_bucket_s=last_bucket_s, num_params=num_params, activation_bytes=activation,
        # Commshift: the last micro-batch's reduce-scatter leaves the backward and joins the reduction.
        shift_backward_s=comm.bwd_first_s + _overlap(backward, comm.bwd_rest_s, cluster,
                                                     wire_s=gather_wire * comm.bwd_rest_s, efficiency=e_b),
        shift_reduce_s=comm.rs_s + reduce_s, forward_compute_s=forward, forward_comm_s=comm.fwd_first_s + comm.fwd_rest_s,
        beside_backward_s=backward_s + reduce_toll_s, reduce_wire_s=reduce_wire * reduce_s,
        shift_reduce_wire_s=rs_wire * comm.rs_s + reduce_wire * reduce_s,
        backward_compute_s=backward, comm=comm,
        cache_bytes=cache, host_cache_bytes=layer_bytes * tiers.count("host"),
        recompute_working_bytes=working + costs.cp_working_bytes, cp_comm_s=cp_comm, num_expert_params=expert_params,
        overlap_efficiency=(e_f, e_b))


@functools.lru_cache(maxsize=512)
def _fresh_forwards(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int) -> tuple[int, ...]:
    """Per chunk, the forwards that start with no micro-batch of the chunk in flight: where a MAZ3
    device-tier layer must gather (runners/sharding/ keeps it until the last in-flight backward).
    1F1B's last stage alternates forward and backward (every forward); earlier stages keep micro-batches
    in flight through the steady state (one per step)."""
    counts = [0] * (pp * virtual_stages)
    for actions in rank_actions(schedule=schedule, pp=pp, virtual_stages=virtual_stages,
                                num_micro_batches=num_micro_batches):
        live: dict[int, int] = {}
        for a in actions:
            if a.kind == "F":
                counts[a.chunk] += live.get(a.chunk, 0) == 0
                live[a.chunk] = live.get(a.chunk, 0) + 1
            else:
                live[a.chunk] -= 1
    return tuple(counts)


@functools.lru_cache(maxsize=512)
def _memory_profiles(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int):
    """Per rank, the in-flight profiles (memory.in_flight_profiles) of a 1F1B or interleaved schedule
    (GPipe holds every micro-batch at once and needs none). Action lists of 4 pp
    micro-batches reach every rank's steady-state peak (1F1B saturates after pp micro-batches,
    interleaving after 2 pp: its warm-up is at most (v + 1) pp virtual micro-batches), so they stand for
    any longer count (a unit test checks it)."""
    cap = 4 * pp
    m = min(num_micro_batches, cap)
    per_rank = rank_actions(schedule=schedule, pp=pp, virtual_stages=virtual_stages, num_micro_batches=m)
    return tuple(in_flight_profiles(actions) for actions in per_rank)


def _rank_state_bytes(plan, *, job, eng, num_params: float, expert_params: float) -> StateBytes:
    """Weights, gradients and optimizer states of a rank's `num_params` (+ `expert_params`) as `eng` holds them."""
    shards = dict(precision=job.precision, reduce_fp32=plan.reduce_fp32, fp8_params=eng.fp8_param_gather)
    states = model_state_bytes(num_params, param_shard=plan.param_shard, grad_shard=plan.grad_shard,
                               optim_shard=plan.optim_shard, **shards)
    if expert_params:  # the experts' states, sharded over expert-DP (Plan.expert_shard_degrees)
        e_p, e_g, e_o = plan.expert_shard_degrees
        experts = model_state_bytes(expert_params, param_shard=e_p, grad_shard=e_g, optim_shard=e_o, **shards)
        states = dataclasses.replace(states, weights_bytes=states.weights_bytes + experts.weights_bytes,
                                     grads_bytes=states.grads_bytes + experts.grads_bytes,
                                     optimizer_bytes=states.optimizer_bytes + experts.optimizer_bytes)
    if job.precision == "fp32" or not eng.reduce_scatter_once:
        return states
    if plan.param_shard > 1:
        # Megatron-FSDP shards its gradient buffer (fp32 main gradients where the engine keeps them) with the
        # parameters (megatron_fsdp/param_and_grad_buffer.py, _init_each_parameter_group_buffers:
        # is_grad_buffer_distributed under optim_grads and optim_grads_params) and copies nothing: the
        # optimizer reads that shard (distrib_optimizer.py, _copy_model_grads_to_main_grads returns early).
        if not eng.main_grads_fp32:
            return states
        return dataclasses.replace(states, grads_bytes=4.0 * (num_params / plan.grad_shard + (
            expert_params / plan.expert_shard_degrees[1] if expert_params else 0.0)))
    # Megatron's distributed optimizer keeps every local parameter's gradient in one buffer (fp32 main
    # gradients, or 16-bit under --grad-reduce-in-bf16) and reduce-scatters it in place at the accumulation
    # boundary (megatron/core/distributed/param_and_grad_buffer.py): the buffer is not sharded.
    grad_bytes = 4 if eng.main_grads_fp32 or plan.reduce_fp32 else 2
    states = dataclasses.replace(states, grads_bytes=grad_bytes * (num_params + expert_params))
    if grad_bytes == 4:
        return states
    # A 16-bit buffer: the optimizer gives each fp32 main parameter of its shard an fp32 copy of the reduced
    # gradient shard (_copy_model_grads_to_main_grads: shard_model_grad.float(); DeepSpeed ZeRO-1/2 the same,
    # deepspeed/runtime/zero/stage_1_and_2.py, step: single_grad_partition ... .to(fp32)), 4 bytes per
    # parameter over the optimizer's shard group beside the master and moments; an fp32 buffer is its own.
    copy_bytes = 4.0 * (num_params / plan.optim_shard + (expert_params / plan.expert_shard_degrees[2]
                                                          if expert_params else 0.0))
    return dataclasses.replace(states, optimizer_bytes=states.optimizer_bytes + copy_bytes)


def _rank_memory(plan, cluster, *, model, job, chunks: list[_ChunkPrice], rank: int, eng=None) -> dict[str, float]:
    """Bytes on one device of pipeline rank `rank`: model states, peak activations, buffers, reserve."""
    eng = eng or engine_model("ours")
    mine = [c for c in range(plan.num_chunks) if c % plan.pp == rank]
    num_params = sum(chunks[c].num_params for c in mine)
    expert_params = sum(chunks[c].num_expert_params for c in mine)
    states = _rank_state_bytes(plan, job=job, eng=eng, num_params=num_params, expert_params=expert_params)
    if plan.schedule == "gpipe":  # all forwards first: every micro-batch in flight at once
        activations = sum(plan.num_micro_batches * chunks[c].activation_bytes + chunks[c].cache_bytes for c in mine)
    else:
        profiles = _memory_profiles(plan.schedule, plan.pp, plan.virtual_stages, plan.num_micro_batches)[rank]
        activations = peak_from_profiles(profiles, chunk_bytes={c: chunks[c].activation_bytes for c in mine},
                                         chunk_cache_bytes={c: chunks[c].cache_bytes for c in mine})
    param_bytes = state_bytes_per_param(job.precision, fp8_params=eng.fp8_param_gather)[0]
    layer_bytes = (moe_cost.nonexpert_layer_params_per_device(model, tp=plan.tp) if model.is_moe
                   else layer_params_per_device(model, tp=plan.tp)) * param_bytes
    gathered = (plan.prefetch_depth + 1) * layer_bytes if plan.param_shard > 1 else 0.0
    if model.is_moe and plan.expert_shard_degrees[0] > 1:  # a gathered expert unit per prefetched layer
        one = moe_cost.expert_params_per_device(model, num_moe_layers=1, ep=plan.ep, etp=plan.etp) * param_bytes
        gathered += (plan.prefetch_depth + 1) * one
    # One bucket in flight, never more than the rank's gradients.
    grad_bytes = num_params * state_bytes_per_param(job.precision, reduce_fp32=plan.reduce_fp32)[1]
    bucket = float(min(plan.bucket_size_bytes, grad_bytes)) if plan.dp_cp > 1 else 0.0
    logits = (logits_bytes(model, micro_batch=plan.micro_batch, seq_len=job.seq_len // plan.cp, tp=plan.tp)
              if plan.num_chunks - 1 in mine else 0.0)
    working = max(chunks[c].recompute_working_bytes for c in mine)
    hw = cluster.hardware
    buffers = gathered + bucket + logits + working
    if "framework_reserve_bytes" in hw.calibration:
        reserve = hw.calibration["framework_reserve_bytes"]
    elif hw.device_type == "cuda":
        # The process groups a rank joins: the world, DP, TP, PP and, with HSDP-style sharding inside DP,
        # the shard and replica groups.
        groups = (1 + (plan.dp_cp > 1) + (plan.tp > 1) + (plan.pp > 1) + 2 * (1 < plan.param_shard < plan.dp_cp)
                  + 2 * (plan.cp > 1))  # CP: its all-to-all and ring groups
        reserve = gpu_runtime_bytes(num_communicators=groups, transient_bytes=activations + buffers)
    else:
        reserve = CPU_FRAMEWORK_RESERVE_BYTES
    return {"weights_bytes": states.weights_bytes, "grads_bytes": states.grads_bytes,
            "optimizer_bytes": states.optimizer_bytes, "activations_bytes": activations,
            "buffers_bytes": buffers, "framework_reserve_bytes": reserve, "gathered_params_bytes": gathered,
            "grad_bucket_bytes": bucket, "logits_bytes": logits, "recompute_working_bytes": working,
            "param_cache_bytes": sum(chunks[c].cache_bytes for c in mine),
            "host_cache_bytes": sum(chunks[c].host_cache_bytes for c in mine),
            "total_bytes": states.total_bytes + activations + buffers + reserve}


def _chunk_prices(plan, costs: LayerCosts, cluster, *, model, job, eng=None) -> list[_ChunkPrice]:
    eng = eng or engine_model("ours")
    end_params = end_params_per_device(model, tp=plan.tp, pp=plan.pp)
    chunks, priced = [], {}
    # Uniform plans (one policy and one tier for every layer) name a chunk's layer settings by its count.
    uniform = plan.recompute_layers is None and isinstance(plan.param_cache, str)
    for c, layers in enumerate(plan.chunk_layer_ranges(model.num_layers)):
        # Chunks with the same layer settings cost the same: price each kind once.
        if uniform:
            tiers, policies = (plan.param_cache,), (plan.recompute, len(layers))
        else:
            tiers = tuple(plan.layer_cache(i) for i in layers)
            policies = tuple(plan.layer_recompute(i) for i in layers)
        fresh = (_fresh_forwards(plan.schedule, plan.pp, plan.virtual_stages, plan.num_micro_batches)[c]
                 if plan.pp > 1 and "device" in tiers else 0)
        key = (c == 0, c == plan.num_chunks - 1, policies, tiers + ((len(layers),) if uniform else ()), fresh)
        if key not in priced:
            priced[key] = _price_chunk(plan, costs, cluster, model=model, job=job, chunk=c, layers=layers,
                                       end_params=end_params, eng=eng)
        chunks.append(priced[key])
    return chunks


def _p2p_bytes(plan, *, model, job) -> float:
    """One activation (b x s / cp x h, sequence-sharded under SP) between adjacent stages."""
    size = plan.micro_batch * (job.seq_len // plan.cp) * model.hidden_size * activation_bytes_per_element(job.precision)
    return size / (plan.tp if plan.sequence_parallel else 1)


def _p2p_time_s(plan, cluster, *, model, job) -> float:
    """One activation between adjacent stages, dp x cp x tp ranks apart."""
    if plan.pp == 1:
        return 0.0
    return collective_time_s(cluster, collective="p2p", size_bytes=_p2p_bytes(plan, model=model, job=job), group_size=2,
                             stride=plan.dp_cp * plan.tp)


def _p2p_wire_s(plan, cluster, *, model, job) -> float:
    """The part of one stage-to-stage transfer that is its inter-node bandwidth term (0 inside a node)."""
    if plan.pp == 1:
        return 0.0
    size = _p2p_bytes(plan, model=model, job=job)
    fraction = _wire_fraction(cluster, collective="p2p", size_bytes=size, group_size=2, stride=plan.dp_cp * plan.tp)
    return fraction * _p2p_time_s(plan, cluster, model=model, job=job)


def _redistribute_s(plan, cluster, *, num_params: float, param_bytes: int, first_chunk: _ChunkPrice) -> tuple[float, float]:
    """(exposed, total) seconds of Lins' redistribution: the updated parameter shards all-gathered from
    the optimizer-state owners inside each s_os / s_p group (ranks s_p DP positions apart).

    The engine issues it bucket by bucket after the optimizer step and waits for a unit's bucket only
    before that unit's first forward of the next step (Chen et al., IWQoS 2024: the redistribution
    overlaps the next step's forward), so only the first bucket, and whatever does not fit in the first
    micro-batch's forward compute beside its own parameter gathers, is exposed.
    """
    size = num_params * param_bytes / plan.param_shard
    group, stride = plan.optim_shard // plan.param_shard, plan.tp * plan.param_shard
    total_s = collective_time_s(cluster, collective="all_gather", size_bytes=size, group_size=group, stride=stride)
    if total_s <= 0.0:
        return 0.0, 0.0
    first_s = collective_time_s(cluster, collective="all_gather", size_bytes=min(size, plan.bucket_size_bytes),
                                group_size=group, stride=stride)
    window_s = max(0.0, first_chunk.forward_compute_s - first_chunk.forward_comm_s)
    rest_s = max(0.0, total_s - first_s)
    return min(total_s, first_s + max(0.0, rest_s - window_s)), total_s


def _rank_tails(plan, cluster, *, chunks: list[_ChunkPrice], job, model=None,
                totals: list[float] | None = None, eng=None) -> list[tuple[float, float]]:
    """Per pipeline rank: (optimizer step, exposed redistribution of updated shards when optim_shard >
    param_shard; see _redistribute_s), appending each rank's total redistribution seconds to `totals`. The optimizer step carries the calibrated per-step
    overhead and its ops' overhead (one flat unit per layer, embedding and head: ADAM_OPS_PER_UNIT each)."""
    eng = eng or engine_model("ours")
    param_bytes = gathered_param_bytes(job.precision, eng)
    optimizer_bytes = eng.optimizer_bytes_per_param
    calibration = cluster.hardware.calibration
    op_overhead_s, step_overhead_s = calibration.get("op_overhead_s", 0.0), calibration.get("step_overhead_s", 0.0)
    # Units are counted only where they cost something (0 x any count adds the same 0).
    counts = (plan.chunk_layer_counts(model.num_layers) if model is not None and op_overhead_s
              else (0,) * plan.num_chunks)
    expert_optim_shard = plan.expert_shard_degrees[2]
    tails = []
    for r in range(plan.pp):
        num_params = sum(c.num_params for c in chunks[r::plan.pp])
        num_units = (sum(counts[c] + (c == 0) + (c == plan.num_chunks - 1) for c in range(r, plan.num_chunks, plan.pp))
                     if op_overhead_s else 0)
        expert_params = sum(c.num_expert_params for c in chunks[r::plan.pp])
        optimizer_s = memory_time_s(cluster.hardware, (num_params / plan.optim_shard + expert_params
                                                       / expert_optim_shard) * optimizer_bytes)
        optimizer_s += step_overhead_s + op_overhead_s * ADAM_OPS_PER_UNIT * num_units
        post_exposed_s, post_s = _redistribute_s(plan, cluster, num_params=num_params, param_bytes=param_bytes,
                                                 first_chunk=chunks[r])
        tails.append((optimizer_s, post_exposed_s))
        if totals is not None:
            totals.append(post_s)
    return tails


def _time_breakdown(plan, *, chunks: list[_ChunkPrice], pipe, tails, post_total_s: list[float], p2p_s: float,
                    rank: int, step_time_s: float) -> dict[str, float]:
    """Seconds per step on the critical `rank`; compute + recompute + bubble + exposed comm + optimizer
    adds up to the step time (exposed comm: TP, unhidden DP/ZeRO and the wait for the reduction)."""
    m, mine = plan.num_micro_batches, chunks[rank::plan.pp]
    compute_s = m * sum(c.compute_s for c in mine)
    recompute_s = m * sum(c.recompute_s for c in mine)
    optimizer_s, post_s = tails[rank][0], post_total_s[rank]
    num_sends = sum((c < plan.num_chunks - 1) + (c > 0) for c in range(rank, plan.num_chunks, plan.pp))
    return {
        "compute_s": compute_s, "recompute_s": recompute_s,
        "tp_comm_s": m * sum(c.tp_comm_s - c.cp_comm_s for c in mine), "cp_comm_s": m * sum(c.cp_comm_s for c in mine),
        "pp_comm_s": m * num_sends * p2p_s,
        "dp_comm_s": m * sum(c.dp_comm_s for c in mine) + sum(c.reduce_s for c in mine) + post_s,
        "exposed_comm_s": (pipe.busy_s[rank] - compute_s - recompute_s)
        + (step_time_s - pipe.compute_end_s[rank] - optimizer_s),
        "bubble_s": pipe.compute_end_s[rank] - pipe.busy_s[rank], "optimizer_s": optimizer_s,
        "critical_rank": float(rank)}


def _send_toll(c: _ChunkPrice, cluster, *, p2p_s: float, p2p_wire_s: float) -> tuple[float, float]:
    """Seconds a stage-to-stage send adds to the sender's forward / backward action. The send is
    asynchronous, but its copies run on the sender's own resources beside its next compute (gloo's
    threads on the cores a CPU host's ranks share, NCCL's CTAs on a GPU's SMs): priced as any
    communication beside compute (_overlap), its inter-node wire time free. Measured on 2 CPU processes
    (tiny model, pp2, 16 micro-batches of 1): the interleaved schedule, 3x the sends of 1F1B, ran 15-30%
    slower than 1F1B where a free send had priced it 8% faster."""
    if p2p_s <= 0.0:
        return 0.0, 0.0
    def slowdown(compute_s: float, efficiency: float) -> float:
        # compute and send beside each other, less both alone, plus the shorter (which ran beside the
        # other): (1 - e) x min(compute, the send's non-wire seconds), what the compute loses to the send
        both = _overlap(compute_s, p2p_s, cluster, wire_s=p2p_wire_s, efficiency=efficiency)
        return both - compute_s - p2p_s + min(p2p_s, compute_s)

    (e_f, e_b), f, b = c.overlap_efficiency, c.forward_compute_s, c.backward_compute_s
    return slowdown(f, e_f), slowdown(b, e_b)


def _step_end_of_chunk(c: _ChunkPrice, *, commshift: bool, sends: bool, waits_for_send: bool, p2p_s: float,
                       p2p_wire_s: float) -> tuple[float, float, float, float]:
    """One chunk's (last backward, delay of its last send, step-end reduction, reduction start) for
    `_step_end_durations`."""
    if commshift:
        total_s, wire_s = c.shift_reduce_s, c.shift_reduce_wire_s
        last_backward_s = c.shift_backward_s
    else:
        # What is left of the reduction when the last backward ends (its last bucket at least).
        total_s = 0.0 if c.reduce_s <= 0.0 else max(c.backward_s, c.reduce_s - c.last_bucket_s) + c.last_bucket_s - c.backward_s
        wire_s = c.reduce_wire_s * (total_s / c.reduce_s) if c.reduce_s > 0.0 else 0.0
        last_backward_s = c.beside_backward_s
    delay_s = 0.0 if waits_for_send or not sends or total_s <= 0.0 else shared_send_delay_s(p2p_wire_s, other_wire_s=wire_s)
    reduce_s = 0.0 if total_s <= 0.0 else total_s + delay_s  # the reduction is slowed by as much
    return last_backward_s, delay_s, reduce_s, (p2p_s if waits_for_send else 0.0)


def _step_end_durations(plan, cluster, *, chunks: list[_ChunkPrice], model, job) -> ChunkDurations:
    """The chunks' action durations with each chunk's step-end reduction on the communication stream
    (the timeline's `commshift=True` mode, which every plan runs: see below).

    torch runs the DP reduction and the pipeline's sends on different process groups, each with its own
    communicator: gloo's own threads per group, NCCL's own stream per communicator (p2p pairs get
    theirs). So a send never queues behind the reduction, on CPUs or GPUs. What the two do share is the
    link, where both cross nodes from one rank (its NIC: a node's one NIC on the emulated cluster, the
    GPU's own rail on GPU nodes), and on GPUs the SMs, which a reduction's kernels hold while they run.

    Without commshift, the boundary reduction's buckets run beside the last backward (all but the last
    one; on GPUs they slow it by their SM share, `beside_backward_s`) and what is left of it when the
    backward ends leaves together with the input-gradient send: per-flow sharing delays the send by
    min(send wire, reduction wire) and the reduction by as much (linkshare.py).

    With commshift the engine issues the last micro-batch's reductions (reduce-scatters and all-reduce)
    only once the chunk's last send is done (on gloo, acknowledged by the receiver: a gloo send counts as
    done when its bytes are in the socket buffer), where that backward is the rank's last action (every chunk
    of 1F1B and GPipe; under interleaving the first virtual stage: after any other chunk more compute
    follows, which the wait would stall, so the reduction is issued right after the send and shares the
    link with it as above). The send then goes at the full rate; the reduction starts one send later
    and runs whole, none of it hidden behind the backward.
    """
    p2p_s = _p2p_time_s(plan, cluster, model=model, job=job)
    p2p_wire_s = _p2p_wire_s(plan, cluster, model=model, job=job)
    last = len(chunks) - 1
    toll = [_send_toll(c, cluster, p2p_s=p2p_s, p2p_wire_s=p2p_wire_s) for c in chunks]
    # Every forward but the last chunk's sends its output on; every backward but chunk 0's its input gradient.
    forward_s = tuple(c.forward_s + (toll[k][0] if k < last else 0.0) for k, c in enumerate(chunks))
    backward_s = tuple(c.backward_s + (toll[k][1] if k > 0 else 0.0) for k, c in enumerate(chunks))
    last_bucket_s = tuple(c.last_bucket_s for c in chunks)
    reduce_s, send_delay_s, start_s, last_backward_s = [], [], [], []
    seen: dict[tuple, tuple[float, float, float, float]] = {}  # chunks of one kind are one object
    for k, c in enumerate(chunks):
        sends = k > 0  # chunk 0's last backward sends nothing upstream
        waits_for_send = plan.commshift and sends and k < plan.pp
        key = (id(c), sends, waits_for_send)
        if key not in seen:
            seen[key] = _step_end_of_chunk(c, commshift=plan.commshift, sends=sends, waits_for_send=waits_for_send,
                                           p2p_s=p2p_s, p2p_wire_s=p2p_wire_s)
        last_backward, delay_s, reduce, start = seen[key]
        last_backward_s.append(last_backward + (toll[k][1] if sends else 0.0))
        send_delay_s.append(delay_s)
        reduce_s.append(reduce)
        start_s.append(start)
    return ChunkDurations(forward_s, backward_s, p2p_s, tuple(reduce_s), last_bucket_s, tuple(last_backward_s),
                          last_send_delay_s=tuple(send_delay_s), reduce_start_s=tuple(start_s))


def _pipeline_inputs(plan, *, model, cluster, job, eng, costs: LayerCosts | None, engine: str,
                     totals: list[float] | None = None):
    """What the step's timeline is built from: the chunks' prices, their action durations and each rank's
    tail after its last action, (optimizer + a reduction paid after the pipeline, exposed redistribution)."""
    if costs is None:
        costs = layer_costs(plan, model=model, cluster=cluster, job=job, engine=engine)
    chunks, after = _timeline_chunks(plan, model=model, cluster=cluster, job=job, eng=eng, costs=costs)
    return (chunks, *_durations_and_tails(plan, model=model, cluster=cluster, job=job, eng=eng, chunks=chunks,
                                          after=after, totals=totals))


def _timeline_chunks(plan, *, model, cluster, job, eng, costs: LayerCosts) -> tuple[list[_ChunkPrice], list[float]]:
    """The chunks' prices as the timeline runs them, and per rank the reduction paid after the pipeline."""
    pp = plan.pp
    chunks = _chunk_prices(plan, costs, cluster, model=model, job=job, eng=eng)
    if eng.reduce_after_pipeline:
        # The reduction waits until the pipeline drains (DeepSpeed's PipelineEngine): it leaves the
        # timeline and is paid whole at the step's end.
        after = [sum(c.reduce_s for c in chunks[r::pp]) for r in range(pp)]
        chunks = [dataclasses.replace(c, reduce_s=0.0, last_bucket_s=0.0, beside_backward_s=c.backward_s) for c in chunks]
    else:
        after = [0.0] * pp
    return chunks, after


def _durations_and_tails(plan, *, model, cluster, job, eng, chunks: list[_ChunkPrice], after: list[float],
                         totals: list[float] | None = None, durations: ChunkDurations | None = None):
    if durations is None:
        durations = _step_end_durations(plan, cluster, chunks=chunks, model=model, job=job)
    tails = _rank_tails(plan, cluster, chunks=chunks, job=job, model=model, totals=totals, eng=eng)
    tails = [(optimizer_s + after[r], post_s) for r, (optimizer_s, post_s) in enumerate(tails)]
    return durations, tails


def _check_priceable(plan, *, model, cluster, job) -> None:
    check_plan(plan, model=model, num_devices=cluster.num_devices, job=job)
    hw = cluster.hardware
    if job.precision == "fp8" and "fp8" not in hw.peak_flops_per_s:
        raise PlannerError(f"{hw.name} has no fp8 tensor cores; train in bf16 there")


def estimate(plan, *, model, cluster, job, engine: str = "ours", costs: LayerCosts | None = None) -> Estimate:
    """Price one training step of `plan` as `engine` runs it (cost_models/engines.py): the pipeline
    timeline of its chunks (compute.py, comm.py, timeline.py) and the worst rank's memory (memory.py).
    Raises PlannerError for a plan that does not fit the model, cluster or batch.

    `costs`: the plan's `layer_costs`, when the caller has them. The estimate reads only their times and
    activations, which depend on the layer's shape on one device (micro-batch, tp, sequence parallelism,
    cp and its kind, ep, etp; for MoE models also the schedule, whose paired passes hide the EP overlap),
    not on the sharding, so the search hands in the ones it computed once per shape (`planner/search.py`,
    `_Pricer.slot_costs`)."""
    _check_priceable(plan, model=model, cluster=cluster, job=job)
    hw, pp, eng = cluster.hardware, plan.pp, engine_model(engine)
    post_total_s: list[float] = []
    chunks, durations, tails = _pipeline_inputs(plan, model=model, cluster=cluster, job=job, eng=eng, costs=costs,
                                                engine=engine, totals=post_total_s)
    p2p_s = durations.p2p_s
    pipe = simulate(schedule=plan.schedule, pp=pp, virtual_stages=plan.virtual_stages,
                    num_micro_batches=plan.num_micro_batches, durations=durations, commshift=True)
    ends = [max(pipe.compute_end_s[r], pipe.comm_end_s[r]) + sum(tails[r]) for r in range(pp)]
    step_time_s = max(ends)
    breakdown = _time_breakdown(plan, chunks=chunks, pipe=pipe, tails=tails, post_total_s=post_total_s, p2p_s=p2p_s,
                                rank=ends.index(step_time_s), step_time_s=step_time_s)
    memory = [_rank_memory(plan, cluster, model=model, job=job, chunks=chunks, rank=r, eng=eng) for r in range(pp)]
    worst = max(memory, key=lambda d: d["total_bytes"])
    # activations_bytes is the peak of activations in flight plus the MAZ3 caches live at that moment.
    breakdown.update({k: v for k, v in worst.items() if k != "total_bytes"})
    breakdown["memory_worst_rank"] = float(memory.index(worst))
    policies = tuple(plan.layer_recompute(i) for i in range(model.num_layers))
    flops_no_rc = model_flops_per_step(model, global_batch=job.global_batch, seq_len=job.seq_len)
    flops_rc = model_flops_per_step(model, global_batch=job.global_batch, seq_len=job.seq_len,
                                    recompute_layers=policies)
    devices = cluster.num_devices
    return Estimate(
        step_time_s=step_time_s, tokens_per_s=job.tokens_per_step / step_time_s,
        mfu=flops_no_rc / (step_time_s * devices * hw.peak_flops("bf16" if job.precision == "fp8" else job.precision)),
        tflops_per_gpu=flops_rc / (step_time_s * devices) / 1e12,
        peak_memory_bytes=int(worst["total_bytes"]),
        memory_limit_bytes=int(hw.memory_bytes * (1.0 - job.headroom(hw.device_type))), breakdown=breakdown,
        host_memory_bytes=int(max(m["host_cache_bytes"] for m in memory)), host_memory_limit_bytes=int(hw.host_memory_bytes))


def step_time_lower_bound_s(plan, *, model, cluster, job, engine: str = "ours",
                            costs: LayerCosts | None = None) -> float:
    """A lower bound on `estimate(plan).step_time_s` that skips the timeline and the memory.

    It takes the same chunk action durations, tails and step-end rule as `estimate` (`_pipeline_inputs`)
    and replaces the simulation by two longest-path arguments that hold for any timeline that obeys the
    rules of cost_models/timeline.py (each rank runs its actions one at a time; an action starts no sooner
    than its dependency's end plus one transfer p; `estimate` simulates every plan in the commshift mode,
    so each chunk's last backward lasts `last_backward_s(True)` and its reduction runs on the
    communication stream, which only delays the rank's end). Write F_c, B_c, L_c for chunk c's forward,
    backward and last backward, m for the micro-batches and tail_r for rank r's optimizer step plus its
    exposed redistribution (paid after both its streams end: step >= compute_end_r + tail_r).

    * Rank r's first action is a forward of chunk r: a forward of its chunk c = r + k pp with k > 0
      needs the forward of chunk c - pp, on rank r too. Chunks r - 1, ..., 0 are on other ranks and
      must run that micro-batch forward first, so rank r starts no sooner than
      pre_r = sum_{c<r} (F_c + p). It is then busy for work_r = sum over its chunks of
      m F_c + (m - 1) B_c + L_c, hence compute_end_r >= pre_r + work_r.
    * Rank r's last action is a backward of chunk r, by the same argument backwards (a backward of
      chunk r + k pp is followed by that micro-batch's backward of chunk r + (k - 1) pp). The backwards
      of that micro-batch on chunks r - 1, ..., 0 follow it, one transfer apart, each lasting at least
      min(B_c, L_c), and the last of them ends on rank 0, so
      compute_end_0 >= pre_r + work_r + sum_{c<r} (min(B_c, L_c) + p).

    The step is the largest end over ranks, at least either of these plus the tail; the bound is their
    maximum over r. It is exact for a one-stage plan whose reduction does not outlast its compute, and
    within a few per cent of the estimate for most plans (the 175B search's: median 3%). The search skips
    plans whose bound cannot change its answer (`planner/search.py`); the tests against brute force
    and every priced plan's check against its bound (`SearchResult.bound_violations`) keep it honest.
    """
    return step_time_lower_bounds_s([plan], model=model, cluster=cluster, job=job, engine=engine, costs=costs)[0]


# Plan fields the chunk prices do not read: commshift only changes the step-end durations, and the
# optimizer-state degree only the tails (and, for MoE models, the experts' sharding: kept there).
_NOT_IN_CHUNK_PRICES = ("commshift", "optim_shard")


def _chunk_key(plan, *, moe: bool) -> tuple:
    skip = _NOT_IN_CHUNK_PRICES[:1] if moe else _NOT_IN_CHUNK_PRICES
    return tuple(getattr(plan, f.name) for f in dataclasses.fields(plan) if f.name not in skip)


def step_time_lower_bounds_s(plans, *, model, cluster, job, engine: str = "ours",
                             costs: LayerCosts | None = None) -> list[float]:
    """`step_time_lower_bound_s` of each plan, the chunk prices computed once for plans that differ only
    in commshift or (dense models) the optimizer-state degree, which the prices do not read. `costs`,
    if given, are the layer costs of every plan (the same layer shape: see `estimate`)."""
    eng = engine_model(engine)
    shared: dict[tuple, tuple] = {}
    out = []
    for plan in plans:
        _check_priceable(plan, model=model, cluster=cluster, job=job)
        key = _chunk_key(plan, moe=model.is_moe)
        if key not in shared:
            plan_costs = costs if costs is not None else layer_costs(plan, model=model, cluster=cluster, job=job,
                                                                     engine=engine)
            shared[key] = _timeline_chunks(plan, model=model, cluster=cluster, job=job, eng=eng, costs=plan_costs)
        chunks, after = shared[key]
        # The step-end durations read the chunks, the pipeline and commshift, not the optimizer-state degree.
        step_end = (key, plan.commshift)
        if step_end not in shared:
            shared[step_end] = _step_end_durations(plan, cluster, chunks=chunks, model=model, job=job)
        d, tails = _durations_and_tails(plan, model=model, cluster=cluster, job=job, eng=eng, chunks=chunks,
                                        after=after, durations=shared[step_end])
        out.append(_critical_path_bound_s(plan, d, tails))
    return out


def _critical_path_bound_s(plan, d: ChunkDurations, tails) -> float:
    """The bound of `step_time_lower_bound_s` from the durations and the tails."""
    pp, m, p2p = plan.pp, plan.num_micro_batches, d.p2p_s
    last = d.last_backward_s(True)
    best_s = pre_s = post_s = 0.0
    for r in range(pp):
        work_s = sum(m * d.forward_s[c] + (m - 1) * d.backward_s[c] + last[c] for c in range(r, plan.num_chunks, pp))
        best_s = max(best_s, pre_s + work_s + sum(tails[r]), pre_s + work_s + post_s + sum(tails[0]))
        pre_s += d.forward_s[r] + p2p
        post_s += min(d.backward_s[r], last[r]) + p2p
    return best_s


@dataclass(frozen=True)
class CacheCostInputs:
    """What the MAZ3 tier ILP (planner/ilp.py `choose_param_cache`) needs of one plan, per micro-batch
    and device: each tier's backward-side fetch and forward-side extra seconds and kept bytes for one
    layer (layers are identical), and per chunk the compute windows left after the communication the
    chunk carries whatever the tiers (forward gathers, the ends' gathers, the hideable reduce-scatter)."""

    fetch_s: dict[str, float]
    forward_extra_s: dict[str, float]
    device_bytes: dict[str, float]
    host_bytes: dict[str, float]
    chunk_layers: tuple[int, ...]
    backward_window_s: tuple[float, ...]
    forward_window_s: tuple[float, ...]


def cache_cost_inputs(plan, *, model, cluster, job, engine: str = "ours") -> CacheCostInputs:
    """The MAZ3 prices of `plan`'s layers as `engine` runs them (its own param_cache is ignored: priced
    as "none")."""
    base = plan.replace(param_cache="none")
    check_plan(base, model=model, num_devices=cluster.num_devices, job=job)
    costs = layer_costs(base, model=model, cluster=cluster, job=job, engine=engine)
    chunks = _chunk_prices(base, costs, cluster, model=model, job=job, eng=engine_model(engine))
    layer_bytes = layer_params_per_device(model, tp=plan.tp) * state_bytes_per_param(job.precision)[0]
    fetch = _cache_fetch_s(base, cluster, layer_bytes=layer_bytes) if plan.param_shard > 1 else {
        t: 0.0 for t in ("none", "device", "host", "secondary")}
    per_node = cluster.ranks_per_node_in_group(size=plan.param_shard, stride=plan.tp)
    grow = 1.0 + (ALLOCATOR_FRAGMENTATION if cluster.hardware.device_type == "cuda"
                  and "framework_reserve_bytes" not in cluster.hardware.calibration else 0.0)
    counts = plan.chunk_layer_counts(model.num_layers)
    backward_window, forward_window = [], []
    for c, n in zip(chunks, counts):
        comm = c.comm or _ShardingComm()
        # Without caching, bwd_rest is the other layers' gathers plus the ends' gather.
        stream_b = comm.bwd_rest_s - (n - 1) * fetch["none"] + comm.rs_hideable_s
        backward_window.append(c.backward_compute_s - stream_b)
        forward_window.append(c.forward_compute_s - comm.fwd_rest_s)
    return CacheCostInputs(
        fetch_s=fetch, forward_extra_s={"none": 0.0, "device": 0.0, "host": fetch["host"], "secondary": 0.0},
        # On GPUs the kept copies also carry the allocator's fragmentation share (_rank_memory).
        device_bytes={t: grow * b for t, b in (("none", 0.0), ("device", layer_bytes), ("host", 0.0),
                                               ("secondary", layer_bytes / per_node))},
        host_bytes={"none": 0.0, "device": 0.0, "host": layer_bytes, "secondary": 0.0},
        chunk_layers=tuple(counts), backward_window_s=tuple(backward_window), forward_window_s=tuple(forward_window))
