"""One training process: build the plan's mesh, chunks and engine, and train.

    python -m torch.distributed.run --nproc-per-node 4 -m runners.train --config run.json

`planner run` writes run.json and launches this under torchrun (runners/launch.py); under an existing
torchrun or scheduler, run the module directly. Rank 0 prints one `PLANNER_STEP {json}` line per step
(the launcher's progress bar reads them) and writes the metrics JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import os
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from specs.errors import PlannerError
from specs.job import Job
from specs.jsonio import dataclass_from_dict, read_json_file, write_json_atomic
from specs.model import ModelSpec
from specs.plan import Plan, check_plan

STEP_PREFIX = "PLANNER_STEP "


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs besides the processes: the plan and inputs, and how long to train."""

    plan: Plan
    model: ModelSpec
    job: Job
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None
    ranks_per_node: int = 0  # 0: all local ranks form one node
    engine: str = "ours"
    hardware: str = "cpu"
    timeout_s: float = 300.0
    # Checkpoints (runners/checkpoint.py): every N steps (0: only at the end) into checkpoint_dir, keeping
    # the newest checkpoint_keep; resume continues from the newest (as does any torchrun restart).
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    resume: bool = False

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.engine not in ("ours", "torch"):
            raise ValueError(f"engine must be ours or torch, got {self.engine!r}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.ranks_per_node < 0 or self.seed < 0:
            raise ValueError(f"ranks_per_node and seed must be non-negative, got {self.ranks_per_node} and {self.seed}")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s}")
        if self.checkpoint_every < 0 or self.checkpoint_keep < 1:
            raise ValueError(f"checkpoint_every must be >= 0 and checkpoint_keep >= 1, got {self.checkpoint_every} "
                             f"and {self.checkpoint_keep}")
        if (self.checkpoint_dir or self.resume) and self.engine != "ours":
            raise ValueError("checkpoints are implemented for --engine ours only")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(plan=self.plan.to_dict(), model=self.model.to_dict(), job=self.job.to_dict())
        return out

    @classmethod
    def from_dict(cls, data: object, *, what: str = "run config") -> "RunConfig":
        """Any JSON value gives a RunConfig or a PlannerError naming the bad key (types checked)."""
        return dataclass_from_dict(cls, data, what=what)


# --- memory ---------------------------------------------------------------------------------------------
def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:  # "5" resets the peak resident set size (VmHWM) to the current RSS.
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass


def peak_memory_bytes(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return 0


# --- model assembly ---------------------------------------------------------------------------------------
def build_local_chunks(cfg: RunConfig, *, pp_rank: int, tp, device: torch.device):
    """The chunks this pipeline rank holds, in local order (chunk c = j * pp + pp_rank)."""
    from runners.model import build_chunk, check_tp_shapes

    plan, spec = cfg.plan, cfg.model
    check_tp_shapes(spec, plan.tp)
    ranges = plan.chunk_layer_ranges(spec.num_layers)
    recompute = list(plan.recompute_layers) if plan.recompute_layers is not None else plan.recompute
    loss_scale = 1.0 / (cfg.job.global_batch * cfg.job.seq_len)
    chunk_ids = [j * plan.pp + pp_rank for j in range(plan.virtual_stages)]
    chunks = [build_chunk(spec, layers=ranges[c], first=c == 0, last=c == plan.num_chunks - 1, seed=cfg.seed,
                          tp=tp, recompute=recompute, loss_scale=loss_scale).to(device) for c in chunk_ids]
    return chunk_ids, chunks


def compute_dtype(cfg: RunConfig) -> torch.dtype:
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[cfg.job.precision]


# --- the step loop ----------------------------------------------------------------------------------------
class Trainer:
    """Our engine: mesh, chunks, sharding engine, pipeline executor."""

    def __init__(self, cfg: RunConfig, *, device: torch.device) -> None:
        from runners.comm import Comm
        from runners.mesh import build_mesh
        from runners.sharding import ShardedDataParallel
        from runners.tensor_parallel import TPContext

        self.cfg, self.plan, self.device = cfg, cfg.plan, device
        ranks_per_node = cfg.ranks_per_node or int(os.environ.get("LOCAL_WORLD_SIZE", dist.get_world_size()))
        self.comm = Comm(ranks_per_node=ranks_per_node)
        self.mesh = build_mesh(self.plan, ranks_per_node=ranks_per_node,
                               timeout=datetime.timedelta(seconds=cfg.timeout_s))
        tp = TPContext(group=self.mesh.tp_group, rank=self.mesh.tp_rank, size=self.plan.tp, comm=self.comm,
                       sequence_parallel=self.plan.sequence_parallel)
        self.chunk_ids, self.chunks = build_local_chunks(cfg, pp_rank=self.mesh.pp_rank, tp=tp, device=device)
        from runners.model import canonical_names
        self.names = canonical_names(self.chunks, self.chunk_ids)
        self.engine = ShardedDataParallel(self.chunks, plan=self.plan, mesh=self.mesh, comm=self.comm,
                                          num_micro_batches=self.plan.num_micro_batches, lr=cfg.lr,
                                          defer_grad_sync=self.plan.commshift and self.plan.pp > 1,
                                          param_dtype=compute_dtype(cfg))  # bf16/fp16: 2-byte params and grads
        self.holds_loss = self.chunk_ids[-1] == self.plan.num_chunks - 1 and self.mesh.tp_rank == 0
        self.tied_units, self.tied_group = self._tied_embedding_units()

    def _tied_embedding_units(self):
        """The token embedding and LM head units this rank holds when the model ties them, and the group
        (first and last pipeline stage at the same DP/TP position) whose reduced gradients are summed, as
        Megatron's embedding group does. Every rank creates every such group, in the same order."""
        if not self.cfg.model.tied_embeddings:
            return [], None
        from runners.model import Embedding, LMHead

        units = [u for chunk in self.chunks for u in chunk.units if isinstance(u, (Embedding, LMHead))]
        group = None
        if self.plan.pp > 1:
            for dp_rank in range(self.plan.dp):
                for tp_rank in range(self.plan.tp):
                    ends = [self.mesh.global_rank(pp_rank=p, dp_rank=dp_rank, tp_rank=tp_rank) for p in (0, self.plan.pp - 1)]
                    handle = dist.new_group(ends, timeout=datetime.timedelta(seconds=self.cfg.timeout_s))
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
        seq = self.cfg.job.seq_len // (self.plan.tp if self.plan.sequence_parallel else 1)
        return run_pipeline(actions=table[self.mesh.pp_rank], schedule_table=table,
                            chunks=dict(zip(self.chunk_ids, self.chunks)), micro_batches=micro_batches,
                            pp_ranks=self.mesh.pp_ranks, num_chunks=self.plan.num_chunks, comm=self.comm,
                            activation_shape=(seq, self.plan.micro_batch, self.cfg.model.hidden_size),
                            dtype=next(self.chunks[0].parameters()).dtype, device=self.device,
                            after_last_backward=self.engine.start_grad_sync if self.plan.commshift else None)

    def step(self, micro_batches) -> float:
        """One optimizer step; returns this rank's contribution to the global mean loss."""
        losses = self.run_micro_batches(micro_batches)
        self.engine.optimizer_step(before_update=self._sum_tied_grads if self.tied_units else None)
        return float(sum(l.item() for l in losses)) if self.holds_loss else 0.0

    def full_parameters(self) -> dict[str, torch.Tensor]:
        """Every parameter under its one-process name, assembled over DP, TP and PP (for tests; small models)."""
        local = {}
        for key, tensor in self.engine.full_state_dict().items():
            name, split = self.names[key]
            if split is not None and self.plan.tp > 1:
                parts = [torch.empty_like(tensor) for _ in range(self.plan.tp)]
                dist.all_gather(parts, tensor.contiguous(), group=self.mesh.tp_group)
                tensor = torch.cat(parts, dim=split)
            local[name] = tensor.detach().cpu()
        gathered: list[dict] = [None] * dist.get_world_size()  # type: ignore[list-item]
        dist.all_gather_object(gathered, local)
        merged: dict[str, torch.Tensor] = {}
        for part in gathered:
            merged.update(part)
        return merged


def train(cfg: RunConfig, *, device: torch.device, on_step=None):
    """Train `cfg.steps` steps in the current process group; returns (metrics, trainer), the metrics the
    same on every rank."""
    from runners.data import make_data, rank_micro_batches
    from runners.faults import post_progress

    plan, job = cfg.plan, cfg.job
    trainer = Trainer(cfg, device=device) if cfg.engine == "ours" else _torch_trainer(cfg, device)
    data = make_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=job.seq_len, seed=cfg.seed)
    start_step = 0
    if cfg.checkpoint_dir:
        from runners import checkpoint

        start_step = checkpoint.maybe_restore(trainer, cfg)
    steps, step_times = [], []
    for step in range(start_step, cfg.steps):
        post_progress(step)  # lets a rank whose collective times out name the rank that stopped
        if step == start_step + 1 or start_step == cfg.steps - 1:
            reset_peak_memory(device)  # the first step allocates lazily; measure the steady state
            trainer.comm.counters.reset()
        micro_batches = rank_micro_batches(data.global_batch(step, job.global_batch), dp=plan.dp,
                                           dp_rank=trainer.mesh.dp_rank, micro_batch=plan.micro_batch, device=device)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        contribution = trainer.step(micro_batches)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        stats = torch.tensor([contribution, elapsed], dtype=torch.float64)
        dist.all_reduce(stats[:1])
        dist.all_reduce(stats[1:], op=dist.ReduceOp.MAX)
        record = {"step": step, "loss": stats[0].item(), "step_time_s": stats[1].item()}
        steps.append(record)
        step_times.append(record["step_time_s"])
        if cfg.checkpoint_dir and checkpoint.save_due(cfg, step=step + 1):
            # Before the step is reported: a launcher that has seen step k knows checkpoint k is complete.
            checkpoint.save_checkpoint(trainer, cfg, step=step + 1, keep=cfg.checkpoint_keep)
        if on_step is not None:
            on_step(record)
    return _summary(cfg, trainer, steps, step_times, device), trainer


def _summary(cfg: RunConfig, trainer, steps: list[dict], step_times: list[float], device) -> dict:
    measured = step_times[1:] if len(step_times) > 1 else step_times
    median = statistics.median(measured)
    counters = trainer.comm.counters
    totals = torch.tensor([float(v) for v in counters.snapshot().values()] + [counters.wait_s, peak_memory_bytes(device)],
                          dtype=torch.float64)
    peak = totals[-1:].clone()
    dist.all_reduce(totals[:-1])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    world = dist.get_world_size()
    keys = list(counters.snapshot().keys())
    num_measured = len(measured)
    summary = {
        "median_step_time_s": median,
        "tokens_per_s": cfg.job.global_batch * cfg.job.seq_len / median,
        "peak_memory_bytes": int(peak.item()),
        # Bytes per step summed over all ranks, and seconds per step blocked on communication per rank.
        "comm_bytes": {k: int(totals[i].item() / num_measured) for i, k in enumerate(keys)},
        "comm_wait_s": totals[len(keys)].item() / num_measured / world,
        "world_size": world,
        "device": device.type,
        "engine": cfg.engine,
        # False under --engine torch: torch's collectives bypass runners.comm, so comm_bytes stay zero.
        "comm_counted": getattr(trainer, "comm_counted", True),
    }
    return {"plan": cfg.plan.to_dict(), "steps": steps, "summary": summary, "predicted": predicted(cfg, world)}


def predicted(cfg: RunConfig, world: int) -> dict | None:
    """The cost model's estimate of the same plan on the hardware named in the config."""
    try:
        from cost_models.estimate import estimate
        from specs.cluster import make_cluster
        from specs.hardware import resolve_hardware
    except ImportError:
        return None
    hardware = resolve_hardware(cfg.hardware)
    per_node = cfg.ranks_per_node or world
    cluster = make_cluster(hardware=hardware, num_devices=world, devices_per_node=per_node)
    return estimate(cfg.plan, model=cfg.model, cluster=cluster, job=cfg.job).to_dict()


def _torch_trainer(cfg: RunConfig, device):
    from runners.torch_engine import TorchTrainer

    return TorchTrainer(cfg, device=device)


# --- process entry ----------------------------------------------------------------------------------------
def pick_device() -> tuple[torch.device, str]:
    if torch.cuda.is_available():
        local = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local)
        return torch.device("cuda", local), "nccl"
    return torch.device("cpu"), "gloo"


def _write_error(error_dir: str | None, rank: int, message: str, *, bad_input: bool) -> None:
    if error_dir:
        write_json_atomic(Path(error_dir) / f"rank{rank}.json", {"rank": rank, "error": message, "bad_input": bad_input})


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runners.train")
    parser.add_argument("--config", required=True)
    parser.add_argument("--metrics-out")
    parser.add_argument("--error-dir")
    args = parser.parse_args(argv)
    rank = int(os.environ.get("RANK", 0))
    try:
        cfg = RunConfig.from_dict(read_json_file(args.config, what="run config"))
        world = int(os.environ.get("WORLD_SIZE", 1))
        if world != cfg.plan.world_size:
            raise PlannerError(f"the plan needs dp x tp x pp = {cfg.plan.world_size} processes, but {world} were launched")
        check_plan(cfg.plan, model=cfg.model, num_devices=world, job=cfg.job)
        device, backend = pick_device()
        torch.manual_seed(cfg.seed)
        from runners.faults import die_with_parent, init_distributed

        die_with_parent()
        init_distributed(backend, timeout_s=cfg.timeout_s)

        def on_step(record: dict) -> None:
            if rank == 0:
                print(STEP_PREFIX + json.dumps(record), flush=True)

        metrics, _ = train(cfg, device=device, on_step=on_step)
        if rank == 0 and args.metrics_out:
            write_json_atomic(args.metrics_out, metrics)
        dist.destroy_process_group()
        return 0
    except (PlannerError, ValueError) as exc:
        _write_error(args.error_dir, rank, str(exc), bad_input=True)
        print(f"rank {rank}: error: {exc}", file=sys.stderr, flush=True)
        return 2
    except Exception as exc:  # reported by the launcher with the rank's name
        from runners.faults import describe_failure

        _write_error(args.error_dir, rank, describe_failure(exc), bad_input=False)
        traceback.print_exc()
        return 1


if __name__ == "__main__":
    sys.exit(main())
