"""The same plan on torch's own parallel components, the baseline our engine is measured against.

    planner run --engine torch ...        (or RunConfig(engine="torch") under runners.train)

Same model code (runners/transformer.py, seeded by parameter name), same data, same loss (the head scales the
summed cross entropy by 1 / tokens in the global batch), same Adam (torch.optim.Adam, betas (0.9, 0.999),
eps 1e-8); only the engine differs. The mapping, and how each point differs from ours:

- ZeRO-0 (1, 1, 1): DistributedDataParallel; gradient accumulation under no_sync() until the last
  micro-batch, so one bucketed all-reduce per step, as ours.
- ZeRO-1 (1, 1, dp): DDP + ZeroRedundancyOptimizer. Torch partitions whole parameters greedily by size
  (ours cuts each unit's flat buffer evenly) and broadcasts every updated parameter from its owner after
  the step (ours all-gathers the shards): the same bytes, other collectives.
- ZeRO-2 (1, dp, dp): FSDP2 fully_shard per unit with reshard_after_forward=False, and the parameters
  kept unsharded between the micro-batches of a step (set_reshard_after_backward only on the last).
  Unlike ours, FSDP2 cannot keep full parameters across steps: it reshards after the last backward and
  all-gathers again before the next forward. That is the same all-gather volume as our post-step
  redistribution, but between the last backward and the next forward a rank holds only the shard.
- ZeRO-3 (dp, dp, dp): fully_shard per unit, resharding after forward and backward (all-gathers in
  forward and again in backward of every micro-batch, as ours).
- HSDP (g, g, g): fully_shard on a 2-D DeviceMesh (replicate dp/g, shard g), the shard groups consecutive
  DP ranks as in runners/mesh.py; the replica all-reduce is skipped until the last micro-batch
  (set_requires_all_reduce), as ours.
Under ZeRO-2/3 and HSDP the gradient is reduce-scattered after every micro-batch (gradient sync stays on)
so that a rank never holds a full unsharded gradient, as the plan's s_g promises and as ours does.
FSDP2 under bf16 uses MixedPrecisionPolicy(param_dtype=compute, reduce_dtype=fp32 under the plan's
reduce_fp32, else the compute dtype): fp32 master weights, gradients reduced as ours reduces them. fp16
is refused: torch's FSDP2 path here has no loss scaling, and fp16 gradients underflow without it.

ZeRO-0 with tp > 1 runs on torch's FSDP2-based DDP (torch.distributed._composable.replicate_with_fsdp.replicate,
the one PipelineStage also drives): DDP's reducer takes only plain tensors, and TP parameters are DTensors.

Tensor parallelism (tp > 1) is DTensor's (runners/torch_tp.py: torch's ColwiseParallel, RowwiseParallel,
PrepareModuleInput, SequenceParallel and loss_parallel over an nn.Linear twin of our units holding the
same seeded Parameters; that module says why a twin). Every TP collective is torch's. The mesh puts TP
innermost, as runners/mesh.py: (dp, tp), (replicate, shard, tp) for HSDP, (pp, dp, tp) with pipelines,
so each rank reads the data of the same DP position as under our engine. DP then wraps the TP model
over the DP sub-mesh: FSDP2 (ZeRO-2/3, HSDP) shards the TP DTensors a second time, 2-D, as torchtitan's
FSDP2 + TP. The TP ranks of a DP position compute one loss; only TP rank 0 reports it.

Pipelines (pp > 1) run on torch.distributed.pipelining (TorchPipelineTrainer below), with DP over a 2-D
(pp, dp) mesh as torchtitan composes them: each stage's module under replicate (ZeRO-0) or FSDP2 per
unit (ZeRO-2/3, HSDP), which PipelineStage drives itself (gradient sync once, after the step's last
micro-batch). DDP proper does not survive PipelineStage: its manual prepare_for_backward after no_sync
micro-batches trips the reducer's bucket rebuild (an internal assert on torch 2.13).

Gradient scale: the head already divides by the global token count, so gradients must be *summed* over
DP ranks (and summed over micro-batches: the pipeline schedules get scale_grads=False). DDP and FSDP
average by default. DDP gets a comm hook that all-reduces with SUM and no division; FSDP2 and replicate get
set_gradient_divide_factor(1.0) with set_force_sum_reduction_for_comms(True) (plain SUM collectives, and a
division by 1 that FSDP skips). Both are exact: no rescaling happens. Over TP, DTensor sums what must be
summed (the input gradients of column-parallel GEMMs, replicated norm weights under sequence parallelism).

Not expressible here, each rejected with a PlannerError naming the knob: sharding points other than
ZeRO-0..3 and HSDP; ZeRO-1 together with tp > 1 or pp > 1 (there DP runs on FSDP2 or replicate, whose
parameters are DTensors, which ZeroRedundancyOptimizer cannot broadcast); param_cache (MAZ3); commshift;
tied embeddings under pipelines (torch's schedules do not sum the two stages' copies); and bf16/fp16
without FSDP2 (DDP, ZeRO-1, replicate, TP alone, pipelines: no fp32-master mode; autocast's numerics differ
from ours). Recomputation (full, selective, per layer) lives in the model code and runs unchanged.

Mesh: torch's own init_device_mesh, not runners.mesh.build_mesh, so that the baseline shares no process
group code with the engine it checks; FSDP2 needs a DeviceMesh anyway. Collectives go through torch, not
runners.comm, so `comm`'s counters stay zero and the summary says comm_counted false.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from specs.errors import PlannerError
from specs.knobs import show_value
from runners.comm import Comm

ADAM_BETAS = (0.9, 0.999)
ADAM_EPS = 1e-8


@dataclass
class TorchMesh:
    """This rank's coordinates (train() reads dp_rank) and torch's DeviceMesh over the DP ranks."""

    rank: int
    dp: int
    dp_rank: int
    device_mesh: object
    tp_rank: int = 0
    pp_rank: int = 0
    dp_mesh: object = None  # the DP (sub-)mesh FSDP2 shards over
    tp_mesh: object = None  # the TP sub-mesh (tp > 1)


def dp_component(plan) -> str:
    """'ddp', 'zero1', 'zero2', 'zero3' or 'hsdp': torch's component for the plan's DP sharding degrees;
    PlannerError naming the degrees torch has no component for."""
    s_p, s_g, s_os = plan.shard_degrees
    dp = plan.dp
    table = {(1, 1, 1): "ddp", (1, 1, dp): "zero1", (1, dp, dp): "zero2", (dp, dp, dp): "zero3"}
    if (s_p, s_g, s_os) in table:
        return table[(s_p, s_g, s_os)]
    if s_p == s_g == s_os:
        return "hsdp"
    raise PlannerError(f"--engine torch cannot express sharding (param_shard, grad_shard, optim_shard) = "
                       f"({s_p}, {s_g}, {s_os}) over dp {dp}: torch has ZeRO-0..3 and HSDP (g, g, g) only")


def torch_strategy(plan) -> str:
    """'ddp', 'zero1', 'zero2', 'zero3', 'hsdp', 'tp' (DTensor tensor parallelism alone) or 'pipeline' for a
    plan torch can run (tp > 1 with dp > 1 names its FSDP2 component); PlannerError naming the knob
    otherwise."""
    if plan.param_cache != "none":
        raise PlannerError(f"--engine torch has no MAZ3 parameter cache (param_cache {show_value(plan.param_cache)}); "
                           "use param_cache none")
    if plan.cp > 1:
        # torch's context_parallel() (torch.distributed.tensor.experimental) runs its ring only on CUDA's
        # flash / efficient SDPA kernels, and this engine's checks run on gloo CPU ranks.
        raise PlannerError(f"--engine torch does not run context parallelism (cp {plan.cp}) yet; use --engine ours")
    if plan.commshift:
        raise PlannerError("--engine torch has no commshift (torch's schedules reduce gradients outside the "
                           "pipeline); drop commshift")
    if plan.pp > 1:
        if plan.dp > 1 and dp_component(plan) == "zero1":
            raise PlannerError(_ZERO1_DTENSOR.format(what=f"pipeline parallelism (pp {plan.pp})", dp=plan.dp))
        return "pipeline"
    if plan.tp > 1 and plan.dp == 1:
        return "tp"
    component = dp_component(plan)
    if plan.tp > 1 and component == "zero1":
        raise PlannerError(_ZERO1_DTENSOR.format(what=f"tensor parallelism (tp {plan.tp})", dp=plan.dp))
    return component


_ZERO1_DTENSOR = ("--engine torch cannot shard only the optimizer state (ZeRO-1: optim_shard {dp}, grad_shard 1) "
                  "together with {what}: there DP runs on FSDP2 or its replicate, whose parameters are DTensors, "
                  "and ZeroRedundancyOptimizer broadcasts plain tensors; use grad_shard {dp} (ZeRO-2) or optim_shard 1")


def _sum_all_reduce_hook(group, bucket):
    """DDP comm hook: all-reduce the bucket with SUM and no division (the loss is already globally scaled)."""
    work = dist.all_reduce(bucket.buffer(), group=group, async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


def _dp_axes(plan, component: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """The DP part of a DeviceMesh: sizes and names. HSDP is row-major (replicate, shard), so that shard
    groups are consecutive DP positions, runners/mesh.py's layout."""
    if component == "hsdp":
        return (plan.dp // plan.param_shard, plan.param_shard), ("replicate", "shard")
    return (plan.dp,), ("dp",)


def ddp_sum(module: nn.Module, *, plan, device: torch.device) -> nn.Module:
    """DDP over the world that sums gradients; the plan's bucket size, and gradients as views into the
    buckets (no second gradient copy, like our flat buffers)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(module, device_ids=[device.index] if device.type == "cuda" else None,
                bucket_cap_mb=plan.bucket_size_bytes / 2**20, gradient_as_bucket_view=True)
    model.register_comm_hook(state=None, hook=_sum_all_reduce_hook)
    return model


def replicate_sum(module: nn.Module, *, mesh) -> None:
    """torch's FSDP2-based DDP (replicate) in place, summing gradients."""
    from torch.distributed._composable.replicate_with_fsdp import replicate

    replicate(module, mesh=mesh)
    module.set_gradient_divide_factor(1.0)
    module.set_force_sum_reduction_for_comms(True)


def fully_shard_units(root: nn.Module, groups: list[list[nn.Module]], *, mesh, reshard: bool,
                      dtype: torch.dtype, reduce_fp32: bool = True) -> None:
    """FSDP2 in place: one group per unit (our engine's sharding granularity), then the root; gradients
    summed (module docstring, "Gradient scale"); bf16 compute over fp32 master weights, gradients reduced
    in fp32 (`reduce_fp32`, the plan's knob) or in the compute dtype."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp_policy = MixedPrecisionPolicy(param_dtype=None if dtype == torch.float32 else dtype,
                                     reduce_dtype=torch.float32 if reduce_fp32 or dtype == torch.float32 else dtype)
    for group in groups:
        fully_shard(group if len(group) > 1 else group[0], mesh=mesh, reshard_after_forward=reshard,
                    mp_policy=mp_policy)
    fully_shard(root, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp_policy)
    for module in root.modules():  # both setters act on one module's FSDP state only
        if hasattr(module, "set_gradient_divide_factor"):
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)


def make_torch_trainer(cfg, *, device: torch.device):
    """The trainer for `cfg.plan` on torch's components: a pipeline or a data-parallel one."""
    if cfg.model.is_moe:
        raise PlannerError(f"engine torch does not run mixture-of-experts models ({cfg.model.name}); use engine ours")
    if cfg.model.qk_norm and cfg.plan.tp > 1:
        raise PlannerError(f"engine torch does not run {cfg.model.name}'s query/key head norms (qk_norm) under tensor "
                           f"parallelism (tp {cfg.plan.tp}); use engine ours")
    if torch_strategy(cfg.plan) == "pipeline":
        return TorchPipelineTrainer(cfg, device=device)
    return TorchDataParallelTrainer(cfg, device=device)


class TorchDataParallelTrainer:
    """One rank of a plan run on torch's DDP / ZeroRedundancyOptimizer / FSDP2 (see the module docstring)."""

    comm_counted = False  # torch's collectives do not go through runners.comm

    def __init__(self, cfg, *, device: torch.device) -> None:
        from runners.tensor_parallel import TPContext
        from runners.transformer import build_local_chunks, compute_dtype

        self.cfg, self.plan, self.device = cfg, cfg.plan, device
        self.strategy = torch_strategy(self.plan)
        self.dtype = compute_dtype(cfg.job.precision)
        if self.dtype == torch.float16:
            raise PlannerError("--engine torch has no loss scaling, so fp16 gradients would underflow; "
                               "use --precision bf16, or --engine ours (dynamic loss scaling)")
        if self.strategy in ("ddp", "zero1", "tp") and self.dtype != torch.float32:
            raise PlannerError(f"--engine torch runs {cfg.job.precision} only with sharded parameters or gradients "
                               f"(FSDP2's mixed precision); {self.strategy} needs precision fp32")
        ranks_per_node = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.comm = Comm(ranks_per_node=ranks_per_node)
        self.mesh = self._build_mesh()
        # Full, unsharded chunk (tp 1): the one-process model; DTensor shards it below when tp > 1.
        _, (chunk,) = build_local_chunks(cfg, pp_rank=0, tp=TPContext.single(), device=device)
        self.tied = cfg.model.tied_embeddings
        if self.tied:  # one Parameter, as the one-process reference (build_chunk's share_tied) holds it
            chunk.units[-1].weight = chunk.units[0].weight
        if self.plan.tp > 1:
            from runners.torch_tp import torch_native_chunk

            chunk = torch_native_chunk(chunk)
        # DTensor and fully_shard swap parameters for new ones, dropping our attributes: take names first.
        self.names = {name: p.canonical_name for name, p in chunk.named_parameters()}
        if self.plan.tp > 1:
            from runners.torch_tp import parallelize_chunk

            parallelize_chunk(chunk, tp_mesh=self.mesh.tp_mesh, sequence_parallel=self.plan.sequence_parallel)
        self.chunk = chunk
        # pp 1: every rank computes its micro-batches' loss; the TP ranks of one DP rank share theirs.
        self.holds_loss = self.mesh.tp_rank == 0
        if self.strategy == "tp":
            self.model, self.optimizer = chunk, self._adam(chunk.parameters())
        elif self.strategy == "ddp" and self.plan.tp > 1:
            # DDP's reducer takes plain tensors; torch's FSDP2-based DDP (replicate) takes DTensor parameters.
            replicate_sum(chunk, mesh=self.mesh.dp_mesh)
            self.model, self.optimizer = chunk, self._adam(chunk.parameters())
        elif self.strategy in ("ddp", "zero1"):
            self.model, self.optimizer = self._wrap_ddp(chunk)
        else:
            self.model, self.optimizer = self._wrap_fsdp(chunk)

    def _build_mesh(self) -> TorchMesh:
        from torch.distributed.device_mesh import init_device_mesh

        plan = self.plan
        shape, names = _dp_axes(plan, self.strategy)
        if plan.tp > 1:  # TP innermost, as runners/mesh.py: rank = dp_rank * tp + tp_rank
            shape, names = shape + (plan.tp,), names + ("tp",)
        mesh = init_device_mesh(self.device.type, shape, mesh_dim_names=names)
        rank = dist.get_rank()
        dp_mesh = mesh[names[:-1]] if plan.tp > 1 else mesh
        return TorchMesh(rank=rank, dp=plan.dp, dp_rank=rank // plan.tp, device_mesh=mesh, tp_rank=rank % plan.tp,
                         dp_mesh=dp_mesh, tp_mesh=mesh["tp"] if plan.tp > 1 else None)

    def _adam(self, params):
        return torch.optim.Adam(params, lr=self.cfg.lr, betas=ADAM_BETAS, eps=ADAM_EPS)

    def _wrap_ddp(self, chunk: nn.Module):
        model = ddp_sum(chunk, plan=self.plan, device=self.device)
        if self.strategy == "ddp":
            return model, self._adam(chunk.parameters())
        from torch.distributed.optim import ZeroRedundancyOptimizer

        optimizer = ZeroRedundancyOptimizer(chunk.parameters(), optimizer_class=torch.optim.Adam, lr=self.cfg.lr,
                                            betas=ADAM_BETAS, eps=ADAM_EPS)
        return model, optimizer

    def _wrap_fsdp(self, chunk: nn.Module):
        # A tied embedding and head share one Parameter, which must live in one FSDP group.
        units = list(chunk.units)
        groups = [[units[0], units[-1]]] + [[u] for u in units[1:-1]] if self.tied else [[u] for u in units]
        # TP parameters are DTensors on the TP sub-mesh: FSDP2 on the DP sub-mesh shards them 2-D.
        fully_shard_units(chunk, groups, mesh=self.mesh.dp_mesh, reshard=self.strategy != "zero2", dtype=self.dtype,
                          reduce_fp32=self.plan.reduce_fp32)
        return chunk, self._adam(chunk.parameters())

    # --- the step ------------------------------------------------------------------------------
    def _micro_batch_context(self, index: int, count: int):
        last = index == count - 1
        if self.strategy == "ddp" and self.plan.tp > 1:  # replicate: one all-reduce after the last micro-batch
            self.model.set_requires_gradient_sync(last)
            return contextlib.nullcontext()
        if self.strategy in ("ddp", "zero1"):
            return contextlib.nullcontext() if last else self.model.no_sync()
        if self.strategy == "tp":
            return contextlib.nullcontext()
        if self.strategy == "hsdp":
            self.model.set_requires_all_reduce(last)
        if self.strategy == "zero2":
            self.model.set_reshard_after_backward(last)
        return contextlib.nullcontext()

    def forward_backward(self, micro_batches) -> float:
        """Accumulate the step's gradients (reduced over DP after the last micro-batch); the sum of the losses."""
        total = 0.0
        for i, (tokens, targets) in enumerate(micro_batches):
            with self._micro_batch_context(i, len(micro_batches)), _loss_parallel(self.plan):
                loss = self.model(tokens, targets)
                loss.backward()
            total += loss.item()
        return total

    def step(self, micro_batches) -> float:
        """One optimizer step; returns the sum of this rank's micro-batch losses (its share of the global mean)."""
        total = self.forward_backward(micro_batches)
        self.optimizer.step()
        self.chunk.zero_grad(set_to_none=True)
        return total if self.holds_loss else 0.0

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The reduced gradients after forward_backward, by one-process name (for tests: Adam hides scale errors)."""
        grads: dict[str, torch.Tensor] = {}
        for name, param in self.chunk.named_parameters():
            grad = param.grad
            full = grad.full_tensor() if hasattr(grad, "full_tensor") else grad
            grads.setdefault(self.names[name], full.detach().float().cpu().clone())
        return grads

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its one-process name (every rank participates: FSDP gathers its shards)."""
        merged: dict[str, torch.Tensor] = {}
        for name, param in self.chunk.named_parameters():
            full = param.full_tensor() if hasattr(param, "full_tensor") else param
            merged.setdefault(self.names[name], full.detach().float().cpu().clone())
        return merged


# --- pipeline parallelism ---------------------------------------------------------------------------------
class _Logits(nn.Module):
    """The head's projection alone (its loss is the schedule's loss_fn), as a module so that FSDP2's hooks
    gather its weight."""

    def __init__(self, head: nn.Module) -> None:
        super().__init__()
        self.weight = head.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.weight)  # tp 1: LMHead's enter_tp_region is the identity


class _Stage(nn.Module):
    """A model chunk as torch.distributed.pipelining wants it: plain tensors in, plain tensors out. The last
    chunk's head stops at the logits; the loss (the head's own cross_entropy_sum times loss_scale) is the
    schedule's loss_fn, so the arithmetic is the head's.

    Under tensor parallelism (a torch_native_chunk) the stages exchange local tensors: a DTensor leaving
    the stage (the Shard(0) residual stream under sequence parallelism, the Shard(-1) logits) is sent as
    its local shard, and a later stage re-wraps its input as Shard(0) under sequence parallelism."""

    def __init__(self, chunk: nn.Module, *, first: bool, tp_mesh=None, sequence_parallel: bool = False) -> None:
        from runners.transformer import LMHead
        from runners.torch_tp import TorchHead

        super().__init__()
        self.units = nn.ModuleList(_Logits(u) if isinstance(u, LMHead) else u.proj if isinstance(u, TorchHead) else u
                                   for u in chunk.units)
        self.tp_mesh = tp_mesh
        self.rewrap_input = sequence_parallel and not first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rewrap_input:
            from torch.distributed.tensor import DTensor, Shard

            x = DTensor.from_local(x, self.tp_mesh, [Shard(0)], run_check=False)
        for unit in self.units:
            x = unit(x)
        return x.to_local() if hasattr(x, "to_local") else x


class TorchPipelineTrainer:
    """pp > 1 on torch.distributed.pipelining: a PipelineStage per local chunk (chunk c on pipeline
    rank c % pp, torch's looped placement and ours) under ScheduleGPipe, Schedule1F1B or
    ScheduleInterleaved1F1B. scale_grads=False: the loss is already scaled by 1 / global tokens, so the
    micro-batch gradients are summed, as ours. torch's schedules order their actions themselves (e.g. its
    interleaved warm-up), so the step's work is the plan's but its order may differ from
    specs.schedule.rank_actions.

    dp > 1, as torchtitan composes them: a 2-D (pp, dp) DeviceMesh (3-D (pp, replicate, shard) for HSDP),
    rank = pp_rank * dp + dp_rank as runners/mesh.py, and each stage's module wrapped over the DP
    sub-mesh before it becomes a PipelineStage: torch's FSDP2-based DDP, replicate (ZeRO-0), or FSDP2 per
    unit (ZeRO-2/3, HSDP), both with sum reduction. torch's PipelineStage drives both itself, with gradient
    sync off until all micro-batches are done (perform_reduce_grad). So under the pipeline FSDP2
    reduce-scatters once per step and a rank holds its stage's full gradient meanwhile, unlike ours
    (and unlike FSDP2 without a pipeline here), whose s_g promise holds per micro-batch.

    tp > 1: TP innermost in the mesh ((pp, dp, tp), rank = (pp_rank * dp + dp_rank) * tp + tp_rank), each
    chunk a torch_native_chunk sharded by runners.torch_tp.parallelize_chunk before DP wraps it; the
    stages exchange local shards (see _Stage) and the loss is loss_parallel's on the re-wrapped Shard(-1)
    logits, the schedule's step running inside loss_parallel()."""

    comm_counted = False

    def __init__(self, cfg, *, device: torch.device) -> None:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

        from runners.tensor_parallel import TPContext
        from runners.transformer import build_local_chunks, compute_dtype

        self.cfg, self.plan, self.device = cfg, cfg.plan, device
        plan = self.plan
        if cfg.model.tied_embeddings:
            raise PlannerError("--engine torch cannot pipeline a model with tied embeddings (torch's schedules do "
                               "not sum the first and last stages' copies); use pp 1 or an untied model")
        if compute_dtype(cfg.job.precision) != torch.float32:
            raise PlannerError(f"--engine torch runs pipelines in fp32 only (no fp32 master weights without FSDP); "
                               f"got precision {cfg.job.precision}")
        ranks_per_node = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.comm = Comm(ranks_per_node=ranks_per_node)
        self.component = dp_component(plan) if plan.dp > 1 else None
        dp_shape, dp_names = _dp_axes(plan, self.component) if plan.dp > 1 else ((), ())
        tp_shape, tp_names = ((plan.tp,), ("tp",)) if plan.tp > 1 else ((), ())
        device_mesh = init_device_mesh(device.type, (plan.pp,) + dp_shape + tp_shape,
                                       mesh_dim_names=("pp",) + dp_names + tp_names)
        rank = dist.get_rank()
        self.mesh = TorchMesh(rank=rank, dp=plan.dp, dp_rank=(rank // plan.tp) % plan.dp, device_mesh=device_mesh,
                              tp_rank=rank % plan.tp, pp_rank=rank // (plan.tp * plan.dp),
                              dp_mesh=device_mesh[dp_names] if dp_names else None,
                              tp_mesh=device_mesh["tp"] if tp_names else None)
        self.chunk_ids, chunks = build_local_chunks(cfg, pp_rank=self.mesh.pp_rank, tp=TPContext.single(),
                                                    device=device)
        num_chunks = plan.num_chunks
        self.holds_first, self.holds_last = self.chunk_ids[0] == 0, self.chunk_ids[-1] == num_chunks - 1
        if plan.tp > 1:
            from runners.torch_tp import torch_native_chunk

            chunks = [torch_native_chunk(chunk) for chunk in chunks]
        self.modules = [_Stage(chunk, first=c == 0, tp_mesh=self.mesh.tp_mesh, sequence_parallel=plan.sequence_parallel)
                        for c, chunk in zip(self.chunk_ids, chunks)]
        # DTensor and FSDP2 swap parameters for new ones, dropping our attributes: take names first.
        self.names = [{name: p.canonical_name for name, p in m.named_parameters()} for m in self.modules]
        if plan.tp > 1:
            from runners.torch_tp import parallelize_chunk

            for chunk in chunks:  # in place: the stages hold the same unit modules
                parallelize_chunk(chunk, tp_mesh=self.mesh.tp_mesh, sequence_parallel=plan.sequence_parallel)
        group = device_mesh.get_group("pp")
        stages = [PipelineStage(self._wrap(m), c, num_chunks, device, group=group)
                  for c, m in zip(self.chunk_ids, self.modules)]
        loss_scale = 1.0 / (cfg.job.global_batch * cfg.job.seq_len)
        n = plan.num_micro_batches
        loss_fn = _loss_fn(loss_scale, tp_mesh=self.mesh.tp_mesh)
        if plan.schedule == "interleaved-1f1b":
            self.schedule = ScheduleInterleaved1F1B(stages, n, loss_fn=loss_fn, scale_grads=False)
        else:
            kind = ScheduleGPipe if plan.schedule == "gpipe" else Schedule1F1B
            self.schedule = kind(stages[0], n, loss_fn=loss_fn, scale_grads=False)
        params = [p for m in self.modules for p in m.parameters()]
        self.optimizer = torch.optim.Adam(params, lr=cfg.lr, betas=ADAM_BETAS, eps=ADAM_EPS)

    def _wrap(self, module: _Stage) -> nn.Module:
        """The stage's module under the plan's DP component (itself when dp is 1)."""
        if self.component is None:
            return module
        if self.component == "ddp":  # ZeRO-1 is refused by torch_strategy
            replicate_sum(module, mesh=self.mesh.dp_mesh)
            return module
        fully_shard_units(module, [[u] for u in module.units], mesh=self.mesh.dp_mesh,
                          reshard=self.component != "zero2", dtype=torch.float32)
        return module

    def forward_backward(self, micro_batches) -> float:
        """Run the schedule over the step's micro-batches; the sum of the losses on the last stage, else 0."""
        tokens = torch.cat([t for t, _ in micro_batches])
        targets = torch.cat([t for _, t in micro_batches])
        losses: list[torch.Tensor] = []
        args = (tokens,) if self.holds_first else ()
        with _loss_parallel(self.plan):
            self.schedule.step(*args, target=targets if self.holds_last else None, losses=losses, return_outputs=False)
        # The TP ranks of the last stage hold one loss between them.
        return float(sum(loss.item() for loss in losses)) if self.holds_last and self.mesh.tp_rank == 0 else 0.0

    def step(self, micro_batches) -> float:
        total = self.forward_backward(micro_batches)
        self.optimizer.step()
        for module in self.modules:
            module.zero_grad(set_to_none=True)
        return total

    def _gather_by_name(self, pick) -> dict[str, torch.Tensor]:
        local = {}
        for module, names in zip(self.modules, self.names):
            for name, param in module.named_parameters():
                tensor = pick(param)
                full = tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor  # FSDP2 shards
                local[names[name]] = full.detach().float().cpu().clone()
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            for name, tensor in part.items():
                merged.setdefault(name, tensor)
        return merged

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its one-process name, gathered over the pipeline (and DP) ranks."""
        return self._gather_by_name(lambda p: p)

    def full_gradients(self) -> dict[str, torch.Tensor]:
        return self._gather_by_name(lambda p: p.grad)


def _loss_parallel(plan):
    """torch's vocab-parallel cross entropy must enclose the loss's forward and backward (tp > 1)."""
    if plan.tp == 1:
        return contextlib.nullcontext()
    from torch.distributed.tensor.parallel import loss_parallel

    return loss_parallel()


def _loss_fn(loss_scale: float, *, tp_mesh=None):
    """The head's loss on the logits [s, b, V] (this TP rank's vocabulary shard [s, b, V / tp] under
    tp_mesh: torch's vocab-parallel cross entropy, inside loss_parallel()) and targets [b, s]."""
    from runners.tensor_parallel import TPContext, cross_entropy_sum

    single = TPContext.single()

    def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if tp_mesh is None:
            return cross_entropy_sum(logits, targets.t(), vocab_start=0, tp=single) * loss_scale
        from torch.distributed.tensor import DTensor, Shard

        sharded = DTensor.from_local(logits, tp_mesh, [Shard(2)], run_check=False)
        flat = sharded.float().reshape(-1, sharded.shape[-1])
        loss = torch.nn.functional.cross_entropy(flat, targets.t().reshape(-1), reduction="sum") * loss_scale
        return loss.to_local()

    return loss_fn
