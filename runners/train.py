"""One training process: build the plan's mesh, chunks and engine, and train; the one step loop.

    python -m torch.distributed.run --nproc-per-node 4 -m runners.train --work-dir DIR   (DIR/spec.json: a RunConfig)

`planner run` launches this through runners/launch.py; under an existing torchrun or scheduler,
`planner run` calls `train` in the process itself. Rank 0 emits one `step` event per step (the
launcher's progress bar reads them) and returns the RunMetrics the launcher reads back.
`timed_step` is the step every measurement reuses (this loop, runners/timing.py's batched timing).
"""

from __future__ import annotations

import datetime
import gc
import os
import statistics
import time
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from runners.config import RunConfig, RunMetrics, RunSummary, StepRecord
from runners.launch import pick_device, release_free_memory
from specs.errors import PlannerError
from specs.plan import check_plan


# --- memory ---------------------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    release_free_memory()  # a peak from here counts what is live, not what earlier steps or runs freed
    try:  # "5" resets the peak resident set size (VmHWM) to the current RSS.
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def proc_status_bytes(key: str) -> int:
    """A memory figure of this process from /proc/self/status (VmRSS: now, VmHWM: peak), in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) * 1024
    return 0


# On CPU a process's memory is its resident set less the file pages mapped into it (RssFile): those are
# the shared libraries' code, shared by every rank and reclaimable, and how many of them count depends on
# the page cache, not on the plan. Measured: the same run, same plan, 272 MiB resident in one venv and 347
# MiB in a fresh clone's, the same 176 MiB anonymous in both; libtorch_cpu.so alone mapped 50 against 98 MiB.
def memory_now_bytes(device: torch.device) -> int:
    """Memory this process holds now: allocated bytes on CUDA, anonymous and shared-memory pages on CPU."""
    if device.type == "cuda":
        return int(torch.cuda.memory_allocated(device))
    return proc_status_bytes("RssAnon") + proc_status_bytes("RssShmem")


def peak_memory_bytes(device: torch.device) -> int:
    """The peak since reset_peak_memory: the allocator's on CUDA; on CPU the resident set's peak (VmHWM)
    less the file pages mapped now (which only grow while a run touches more library code, so this never
    overstates the anonymous peak)."""
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    return proc_status_bytes("VmHWM") - proc_status_bytes("RssFile")


# --- the step loop ----------------------------------------------------------------------------------------
class Trainer:
    """Our engine: mesh, chunks, sharding engine, pipeline executor."""

    def __init__(self, cfg: RunConfig, *, device: torch.device, comm=None) -> None:
        """`comm`: the runners.comm.Comm every part communicates through (default a new one; the layer
        probe passes a stand-in, runners/probe.measure_sharding)."""
        from runners import mutations
        from runners.comm import Comm
        from runners.context_parallel import CPContext
        from runners.expert_parallel import EPContext
        from runners.mesh import build_mesh
        from runners.sharding.loss_scale import DynamicLossScale
        from runners.transformer import build_local_chunks, canonical_names, compute_dtype
        from runners.tensor_parallel import TPContext

        self.cfg, self.plan, self.device = cfg, cfg.plan, device
        ranks_per_node = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.comm = comm or Comm(ranks_per_node=ranks_per_node, device=device)
        moe = cfg.model.is_moe
        self.mesh = build_mesh(self.plan, ranks_per_node=ranks_per_node,
                               timeout=datetime.timedelta(seconds=cfg.timeout_s), moe=moe)
        mutation = mutations.active()  # a test's injected bug; None outside tests
        tp = TPContext(group=self.mesh.tp_group, rank=self.mesh.tp_rank, size=self.plan.tp, comm=self.comm,
                       sequence_parallel=self.plan.sequence_parallel,
                       replicated_grad_reductions=2 if mutation and mutation.kind == "sp_double_reduce" else 1)
        # Deferred: no rank ever holds a weight it does not own; the engine draws its shards. A tied head
        # on the embedding's rank shares its weight (one copy, as Megatron and the cost model hold it)
        # where that weight is never sharded away between the two uses (param_shard 1).
        share_tied = self.plan.pp == 1 and self.plan.param_shard == 1
        self.cp = CPContext.from_mesh(self.mesh, comm=self.comm)
        self.ep = EPContext.from_mesh(self.mesh, comm=self.comm)
        self.chunk_ids, self.chunks = build_local_chunks(cfg, pp_rank=self.mesh.pp_rank, tp=tp, device=device,
                                                         deferred=True, share_tied=share_tied, cp=self.cp, ep=self.ep)
        self.names = canonical_names(self.chunks, self.chunk_ids)
        dtype = compute_dtype(cfg.job.precision)
        # fp16 gradients of a loss averaged over the global batch's tokens underflow: scale the loss.
        self.loss_scale = DynamicLossScale() if dtype == torch.float16 else None
        self._build_engines(dtype=dtype, moe=moe)
        if mutation and mutation.kind == "scale_grad":
            mutations.scale_gradients(self.chunks, mutation)
        if mutation and mutation.kind == "skip_reduction":
            reducer = self.engine.reducer
            reducer.skip_unit, reducer.skip_micro_batch = self.engine.units_by_chunk[0][mutation.unit], mutation.micro_batch
        self._find_loss_heads()
        self.holds_loss = self.chunk_ids[-1] == self.plan.num_chunks - 1 and self.mesh.tp_rank == 0
        self.tied_units, self.tied_group = self._tied_embedding_units()

    def _build_engines(self, *, dtype: torch.dtype, moe: bool) -> None:
        """The sharding engine of the dense parameters and, for an MoE model, a second one of the experts
        over expert-DP (Megatron-Core's expert data-parallel group)."""
        from runners.sharding import ShardedDataParallel

        plan, cfg = self.plan, self.cfg
        engine_args = dict(num_micro_batches=plan.num_micro_batches, lr=cfg.lr,
                           defer_grad_sync=plan.commshift and plan.pp > 1,
                           param_dtype=dtype,  # bf16/fp16: 2-byte params (and grads, unless reduce_fp32)
                           grad_dtype=torch.float32 if plan.reduce_fp32 else None,
                           device=self.device, loss_scale=self.loss_scale, stream_ordered=cfg.stream_ordered)
        self.engine = ShardedDataParallel(self.chunks, plan=plan, mesh=self.mesh, comm=self.comm,
                                          experts=False if moe else None, **engine_args)
        self.expert_engine = ShardedDataParallel(self.chunks, plan=expert_plan(plan), mesh=self.mesh.expert_view(),
                                                 comm=self.comm, experts=True, **engine_args) if moe else None
        self.engines = [e for e in (self.engine, self.expert_engine) if e is not None]
        # Expert parameters' keys and the dim expert TP splits (runners/moe.GroupedExperts).
        self.expert_etp_dims = {key: p.etp_split_dim for c, chunk in zip(self.chunk_ids, self.chunks)
                                for key, p in ((f"{c}.{n}", p) for n, p in chunk.named_parameters())
                                if getattr(p, "is_expert", False)}

    def _find_loss_heads(self) -> None:
        """The modules whose loss the fp16 loss scale multiplies alike: the LM heads' loss and the MoE
        layers' auxiliary loss (whose routing counters go to this rank's Comm)."""
        from runners.moe import MoE
        from runners.transformer import LMHead

        self.heads = [u for chunk in self.chunks for u in chunk.units if isinstance(u, LMHead)]
        self.heads += [m for chunk in self.chunks for m in chunk.modules() if isinstance(m, MoE)]
        self.base_loss_scales = [h.loss_scale if isinstance(h, LMHead) else h.aux_scale for h in self.heads]
        for m in self.heads:
            if isinstance(m, MoE):
                m.counters = self.comm.counters

    def _tied_embedding_units(self):
        """The token embedding and LM head units this rank holds when the model ties them, and the group
        (first and last pipeline stage at the same DP/TP position) whose reduced gradients are summed, as
        Megatron's embedding group does. Every rank creates every such group, in the same order."""
        if not self.cfg.model.tied_embeddings:
            return [], None
        from runners.mesh import shared_group
        from runners.transformer import Embedding, LMHead

        units = [u for chunk in self.chunks for u in chunk.units if isinstance(u, (Embedding, LMHead))]
        if len(units) == 2 and units[0].weight is units[1].weight:
            return [], None  # one shared Parameter: autograd already sums its two gradients
        group = None
        if self.plan.pp > 1:
            for dp_rank in range(self.plan.dp):
                for cp_rank in range(self.plan.cp):
                    for tp_rank in range(self.plan.tp):
                        ends = [self.mesh.global_rank(pp_rank=p, dp_rank=dp_rank, tp_rank=tp_rank, cp_rank=cp_rank)
                                for p in (0, self.plan.pp - 1)]
                        handle = shared_group(tuple(ends), stream="tied",
                                              timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
                        if self.mesh.rank in ends:
                            group = handle
        return units, group

    def _sum_tied_grads(self) -> None:
        """Both copies of a tied weight get the sum of their reduced gradients (the shards line up), so
        identical Adam updates keep them equal: the gradient of one shared parameter."""
        grads = [self.engine.unit_grad(u) for u in self.tied_units]
        if self.tied_group is not None:
            self.comm.all_reduce(grads[0], self.tied_group)
        elif len(grads) == 2:
            grads[0].add_(grads[1])
            grads[1].copy_(grads[0])

    def run_micro_batches(self, micro_batches) -> list[torch.Tensor]:
        if self.plan.pp == 1:
            losses = []
            for tokens, targets in micro_batches:
                loss = self.chunks[0](tokens, targets)
                loss.backward()
                losses.append(loss.detach())
            return losses
        from specs.schedule import rank_actions
        from runners.pipeline import run_pipeline

        # Every rank's list, not only ours: NCCL matches sends to receives by order, not tag, so each
        # rank derives the order of its peers' messages from the whole table.
        table = rank_actions(schedule=self.plan.schedule, pp=self.plan.pp, virtual_stages=self.plan.virtual_stages,
                             num_micro_batches=self.plan.num_micro_batches)
        seq = self.cfg.job.seq_len // self.plan.cp // (self.plan.tp if self.plan.sequence_parallel else 1)
        return run_pipeline(actions=table[self.mesh.pp_rank], schedule_table=table,
                            chunks=dict(zip(self.chunk_ids, self.chunks)), micro_batches=micro_batches,
                            pp_ranks=self.mesh.pp_ranks, num_chunks=self.plan.num_chunks, comm=self.comm,
                            activation_shape=(seq, self.plan.micro_batch, self.cfg.model.hidden_size),
                            dtype=next(self.chunks[0].parameters()).dtype, device=self.device,
                            after_last_backward=self._start_grad_sync if self.plan.commshift else None)

    def _start_grad_sync(self, chunk: int) -> None:
        for engine in self.engines:
            engine.start_grad_sync(chunk)

    def step(self, micro_batches, *, before_update: Callable[[], None] | None = None) -> float:
        """One optimizer step; returns this rank's contribution to the global mean loss (unscaled).
        `before_update` runs once the gradients are final (reduced, tied copies summed; still multiplied
        by the fp16 loss scale), before Adam reads them."""
        scale = self.loss_scale.scale if self.loss_scale is not None else 1.0
        for head, base in zip(self.heads, self.base_loss_scales):
            setattr(head, "aux_scale" if hasattr(head, "aux_scale") else "loss_scale", base * scale)
        losses = self.run_micro_batches(micro_batches)

        from runners.sharding.engine import decide_overflow

        # One overflow decision and one loss-scale update for the dense and the expert engine together;
        # `before_update` once both engines' gradients are final (the experts' too).
        self.engine.finish_gradients(before_update=self._sum_tied_grads if self.tied_units else None)
        if self.expert_engine is not None:
            self.expert_engine.finish_gradients()
        if before_update is not None:
            before_update()
        decision = decide_overflow(self.engines, self.loss_scale)
        for engine in self.engines:
            engine.apply_update(decision)
        return float(sum(l.item() for l in losses)) / scale if self.holds_loss else 0.0

    def _one_process_view(self, tensors: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
        """Engine tensors ('<chunk>.<name>' keys) as (one-process name, tensor on CPU), TP shards joined."""
        out = []
        for key, tensor in tensors.items():
            name, split = self.names[key]
            if key in self.expert_etp_dims:  # experts split over ETP along their FFN dim, over EP along dim 0
                for group, size, dim in ((self.ep.etp_group, self.ep.etp_size, self.expert_etp_dims[key]),
                                         (self.ep.group, self.ep.size, 0)):
                    if size > 1:
                        parts = [torch.empty_like(tensor) for _ in range(size)]
                        dist.all_gather(parts, tensor.contiguous(), group=group)
                        tensor = torch.cat(parts, dim=dim)
            if split is not None and self.plan.tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(self.plan.tp)]
                dist.all_gather(parts, tensor.contiguous(), group=self.mesh.tp_group)
                tensor = torch.cat(parts, dim=split)
            out.append((name, tensor.detach().cpu()))
        return out

    def full_gradients(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's reduced gradients of the step, each whole (over DP shards and TP) under its
        one-process name, one entry per copy (a tied embedding and head the engine keeps apart are two);
        call from `step`'s before_update. Per rank, not merged, so that every replica can be checked
        (for tests)."""
        return self._one_process_view({k: v for e in self.engines for k, v in e.full_gradients().items()})

    def local_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters this rank holds, each whole (over DP shards and TP) under its one-process name,
        one entry per copy; per rank, like full_gradients (for tests)."""
        return self._one_process_view({k: v for e in self.engines for k, v in e.full_state_dict().items()})

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its one-process name, assembled over DP, TP and PP (for tests; small models)."""
        local = dict(self.local_parameters())
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged


def expert_plan(plan):
    """The plan as the expert parameters' sharding engine sees it: expert-DP as its data parallelism (no CP),
    the plan's sharding degrees cut to expert-DP (Plan.expert_shard_degrees), no MAZ3 tiers."""
    import warnings

    s_p, s_g, s_os = plan.expert_shard_degrees
    with warnings.catch_warnings():  # knobs the view leaves without effect are the real plan's business
        warnings.simplefilter("ignore")
        return plan.replace(dp=plan.expert_dp, cp=1, ep=1, etp=1, param_shard=s_p, grad_shard=s_g, optim_shard=s_os,
                            param_cache="none")


def timed_step(trainer, sequences: torch.Tensor, *, device: torch.device, barrier: bool = False) -> StepRecord:
    """One optimizer step on this rank's share of the global batch `sequences` [B, S + 1]: the summed loss
    over ranks and the slowest rank's wall time (every rank gets the same record; step index 0)."""
    from runners.data import rank_micro_batches

    plan = trainer.plan
    micro_batches = rank_micro_batches(sequences, dp=plan.dp, dp_rank=trainer.mesh.dp_rank,
                                       micro_batch=plan.micro_batch, device=device)
    if plan.cp > 1:  # this CP rank's two chunks of every sequence, inputs and targets alike
        micro_batches = [(trainer.cp.local_tokens(x), trainer.cp.local_tokens(y)) for x, y in micro_batches]
    if barrier:  # start every rank together, so the slowest rank's time is the step's own
        dist.barrier()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    contribution = trainer.step(micro_batches)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - start
    trainer.comm.settle()  # the device stalls behind collectives, timed with events (runners/comm.py)
    # On the device: an NCCL-only group has no CPU backend.
    loss = torch.tensor([contribution], dtype=torch.float64, device=device)
    seconds = torch.tensor([elapsed], dtype=torch.float64, device=device)
    dist.all_reduce(loss)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    return StepRecord(step=0, loss=loss.item(), step_time_s=seconds.item())


def make_trainer(cfg: RunConfig, *, device: torch.device):
    """Our engine's Trainer, or torch's (runners/torch_engine.py) for engine "torch"."""
    if cfg.engine == "ours":
        return Trainer(cfg, device=device)
    from runners.torch_engine import make_torch_trainer

    return make_torch_trainer(cfg, device=device)


def train(cfg: RunConfig, *, device: torch.device, on_step=None, on_start=None) -> tuple[RunMetrics, object]:
    """Train `cfg.steps` steps in the current process group; returns (metrics, trainer), the metrics the
    same on every rank. `on_start(step, records)` runs once the trainer is built and any checkpoint
    restored, with the records the checkpoint kept of the steps it trained since the one before it."""
    from runners.data import make_data
    from runners.faults import post_progress

    set_matmul_precision(device, allow_tf32=cfg.allow_tf32)
    trainer = make_trainer(cfg, device=device)
    data = make_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.job.seq_len, seed=cfg.seed)
    start_step, replayed = 0, ()
    if cfg.checkpoint_dir:
        from runners import checkpoint

        start_step, replayed = checkpoint.maybe_restore(trainer, cfg)
    if on_start is not None:
        on_start(start_step, replayed)
    records: list[StepRecord] = []
    since_save: list[StepRecord] = []
    for step in range(start_step, cfg.steps):
        post_progress(step)  # lets a rank whose collective times out name the rank that stopped
        if step == start_step + 1 or start_step == cfg.steps - 1:
            reset_peak_memory(device)  # the first step allocates lazily; measure the steady state
            trainer.comm.counters.reset()
        record = timed_step(trainer, data.global_batch(step, cfg.job.global_batch), device=device)
        record = StepRecord(step=step, loss=record.loss, step_time_s=record.step_time_s)
        records.append(record)
        since_save.append(record)
        if cfg.checkpoint_dir and checkpoint.save_due(cfg, step=step + 1):
            # Before the step is reported: a launcher that has seen step k knows checkpoint k is complete.
            # A worker stopped between the two has trained steps it never reported: the checkpoint keeps
            # their records and the resume replays them.
            checkpoint.save_checkpoint(trainer, cfg, step=step + 1, keep=cfg.checkpoint_keep, records=tuple(since_save))
            since_save = []
        if on_step is not None:
            on_step(record)
    return RunMetrics(plan=cfg.plan, steps=tuple(records), summary=_summary(cfg, trainer, records, device),
                      predicted=cfg.predicted), trainer


def _summary(cfg: RunConfig, trainer, records: list[StepRecord], device) -> RunSummary:
    scale = getattr(trainer, "loss_scale", None)
    step_times = [r.step_time_s for r in records]
    measured = step_times[1:] if len(step_times) > 1 else step_times
    median = statistics.median(measured)
    counters = trainer.comm.counters
    keys = list(counters.snapshot().keys())
    totals = torch.tensor([float(v) for v in counters.snapshot().values()] + [counters.wait_s],
                          dtype=torch.float64, device=device)
    peak = torch.tensor([float(peak_memory_bytes(device))], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    totals_list = totals.tolist()
    num_measured = len(measured)
    moe = _moe_summary(cfg, counters, device=device, num_measured=num_measured)
    return RunSummary(
        **moe, median_step_time_s=median, tokens_per_s=cfg.job.global_batch * cfg.job.seq_len / median,
        peak_memory_bytes=int(peak.item()),
        comm_bytes={k: int(totals_list[i] / num_measured) for i, k in enumerate(keys)},
        comm_wait_s=totals_list[len(keys)] / num_measured / world, world_size=world, device=device.type,
        engine=cfg.engine, comm_counted=getattr(trainer, "comm_counted", True), precision=cfg.job.precision,
        skipped_steps=scale.num_skipped if scale is not None else 0, loss_scale=scale.scale if scale is not None else 1.0)


def _moe_summary(cfg: RunConfig, counters, *, device, num_measured: int) -> dict:
    """RunSummary's MoE fields: the routing counters summed over ranks (a collective: every rank calls it)."""
    model = cfg.model
    if not model.is_moe:
        return {}
    rows = torch.zeros(model.num_layers, model.num_experts, dtype=torch.float64, device=device)
    for layer, counts in counters.expert_rows.items():
        rows[layer] = torch.tensor(counts, dtype=torch.float64)
    off = torch.tensor([float(counters.moe_rows_off_rank)], dtype=torch.float64, device=device)
    dist.all_reduce(rows)
    dist.all_reduce(off)
    used = rows[rows.sum(1) > 0]
    imbalance = (used.max(1).values / used.mean(1)).mean().item() if len(used) else 0.0
    return {"moe_rows_routed": rows.sum().item() / num_measured, "moe_rows_off_rank": off.item() / num_measured,
            "moe_imbalance": imbalance}


# --- process entry ----------------------------------------------------------------------------------------
def set_matmul_precision(device: torch.device, *, allow_tf32: bool) -> None:
    """TF32 for fp32 GEMMs and convolutions on CUDA (the presets' fp32 peak is the TF32 figure); no
    effect on CPU."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow_tf32
        torch.backends.cudnn.allow_tf32 = allow_tf32


def run_task(spec: dict) -> RunMetrics | dict | None:
    """The worker task (runners.launch.worker_main): train the RunConfig `spec` on this rank, or each of
    `spec["runs"]` in turn in one process group (benchmarks that interleave plans); rank 0 returns the
    RunMetrics, or {"runs": [RunMetrics, ...]}."""
    from runners.faults import init_distributed
    from runners.launch import emit_event

    series = "runs" in spec if isinstance(spec, dict) else False
    cfgs = [RunConfig.from_dict(c, what=f"run config {i}") for i, c in enumerate(spec["runs"])] if series else \
        [RunConfig.from_dict(spec)]
    world = int(os.environ.get("WORLD_SIZE", 1))
    cfgs = [cfg.for_world(world) for cfg in cfgs]  # an elastic run: the plan for the world it was given
    for cfg in cfgs:
        if world != cfg.plan.world_size:
            raise PlannerError(f"the plan needs {cfg.plan.degrees_text()} processes, but {world} were launched")
        check_plan(cfg.plan, model=cfg.model, num_devices=world, job=cfg.job)
    device, backend = pick_device()
    init_distributed(backend, timeout_s=max(c.timeout_s for c in cfgs))
    rank = dist.get_rank()
    if rank == 0 and cfgs[0].elastic_plans:
        emit_event("plan", world_size=world, plan=cfgs[0].plan.describe(),
                   restart=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")))

    def on_step(record: StepRecord) -> None:
        if rank == 0:
            emit_event("step", step=record.step, loss=record.loss, step_time_s=record.step_time_s)

    def on_start(step: int, replayed) -> None:
        if rank == 0:
            emit_event("resumed", step=step, world_size=world)
            for record in replayed:  # the checkpoint's steps, which the attempt that saved it may not have reported
                emit_event("step", step=record.step, loss=record.loss, step_time_s=record.step_time_s, replayed=True)

    results = []
    for cfg in cfgs:
        torch.manual_seed(cfg.seed)
        metrics, trainer = train(cfg, device=device, on_step=on_step, on_start=on_start)
        # The engine's hooks and modules reference each other: free the cycle before the next run, so
        # its peak memory is its own.
        del trainer
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
        results.append(metrics)
    dist.destroy_process_group()
    if rank != 0:
        return None
    return {"runs": [m.to_dict() for m in results]} if series else results[0]


if __name__ == "__main__":
    from runners.launch import exit_worker, worker_main

    exit_worker(worker_main(run_task))
