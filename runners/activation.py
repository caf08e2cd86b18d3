"""Memory of a run as the engine can see it on any device: the activation bytes one micro-batch's
forward keeps for its backward, and the resident set's peak above the idle process.

    python -m torch.distributed.run --nproc-per-node 4 -m runners.activation --work-dir DIR   (DIR/spec.json: {"runs": [RunConfig, ...]})

A CPU has no allocator peak counter (torch.cuda.max_memory_allocated's), and the resident set mixes
activations with the allocator's cached pages and gloo's buffers, so the activations are counted where
autograd keeps them: saved-tensor hooks see every tensor a forward saves for its backward (custom
Functions' save_for_backward included, e.g. the ring's q, k, v, output and log-sum-exp). Each storage
counts once (q, k and v viewed out of one projection are one buffer) and the parameters' storages not at
all (model state, not activations). Bytes are summed per chunk forward, i.e. per micro-batch, and the
largest micro-batch of the largest rank is reported: with pp 1 the step runs each micro-batch's forward
and backward before the next, so that is the step's activation peak. Not counted: transient working
buffers freed within the forward (the ring's fp32 score blocks), and under recomputation what
torch.utils.checkpoint keeps by itself (its region's inputs), since its own hooks take over inside the
region; compare plans under the same recomputation policy.

Each run trains `cfg.steps` steps with the one step loop (runners.train.train, whose summary reports the
peak resident set from step 1 on), then one more step under the hooks.
"""

from __future__ import annotations

import gc
from dataclasses import dataclass

import torch
import torch.distributed as dist

from specs.jsonio import dataclass_from_dict


@dataclass(frozen=True)
class MemoryProbe:
    """One run's memory per rank (each figure the largest over ranks)."""

    saved_activation_bytes: int  # bytes one micro-batch's forward keeps for backward
    peak_resident_bytes: int  # runners.train.peak_memory_bytes from step 1 on
    idle_resident_bytes: int  # runners.train.memory_now_bytes before the run's trainer was built
    # Seconds per step a rank spent blocked on communication (runners/comm.py), mean over ranks and steps
    # after the first: the ring's messages where they did not hide behind the partial attention.
    comm_wait_s: float = 0.0

    def to_dict(self) -> dict:
        return {"saved_activation_bytes": self.saved_activation_bytes, "peak_resident_bytes": self.peak_resident_bytes,
                "idle_resident_bytes": self.idle_resident_bytes, "comm_wait_s": self.comm_wait_s}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "memory probe") -> "MemoryProbe":
        return dataclass_from_dict(cls, data, what=what)


class SavedBytes:
    """Saved-tensor hooks around every forward of `module`: bytes of the distinct non-parameter storages
    each forward saves for backward; `per_forward` holds one total per forward."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.excluded = {p.untyped_storage().data_ptr() for p in module.parameters()}
        self.per_forward: list[int] = []
        self._seen: set[int] = set()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._handles = [module.register_forward_pre_hook(self._start), module.register_forward_hook(self._stop)]

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key not in self.excluded and key not in self._seen:
            self._seen.add(key)
            self.per_forward[-1] += storage.nbytes()
        return tensor

    def _start(self, module, args) -> None:
        self._seen = set()
        self.per_forward.append(0)
        self._hooks.__enter__()

    def _stop(self, module, args, output) -> None:
        self._hooks.__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def probe(cfg, *, device: torch.device) -> MemoryProbe:
    """Train `cfg` (a RunConfig of one pipeline stage) and count one more step's saved activations."""
    from runners.data import make_data
    from runners.launch import release_free_memory
    from runners.train import memory_now_bytes, timed_step, train

    if cfg.plan.pp != 1:
        raise ValueError(f"the activation probe counts one chunk's forward per micro-batch: pp must be 1, got {cfg.plan.pp}")
    release_free_memory()  # what earlier runs in this process freed is not this run's idle memory
    idle = memory_now_bytes(device)
    metrics, trainer = train(cfg, device=device)
    counter = SavedBytes(trainer.chunks[0])
    data = make_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.job.seq_len, seed=cfg.seed)
    timed_step(trainer, data.global_batch(cfg.steps, cfg.job.global_batch), device=device)
    counter.remove()
    figures = torch.tensor([float(max(counter.per_forward)), float(idle)], dtype=torch.float64, device=device)
    dist.all_reduce(figures, op=dist.ReduceOp.MAX)
    del trainer
    gc.collect()
    return MemoryProbe(saved_activation_bytes=int(figures[0].item()),
                       peak_resident_bytes=metrics.summary.peak_memory_bytes, idle_resident_bytes=int(figures[1].item()),
                       comm_wait_s=metrics.summary.comm_wait_s)


def run_task(spec: dict) -> dict | None:
    """The worker task (runners.launch.worker_main): probe each of `spec["runs"]` in turn in one process
    group; rank 0 returns {"runs": [MemoryProbe, ...]}. For a clean resident-set peak, give one run per launch."""
    from runners.config import RunConfig
    from runners.faults import init_distributed
    from runners.launch import pick_device

    cfgs = [RunConfig.from_dict(c, what=f"run config {i}") for i, c in enumerate(spec["runs"])]
    device, backend = pick_device()
    init_distributed(backend, timeout_s=max(c.timeout_s for c in cfgs))
    results = []
    for cfg in cfgs:
        torch.manual_seed(cfg.seed)
        results.append(probe(cfg, device=device).to_dict())
    rank = dist.get_rank()
    dist.destroy_process_group()
    return {"runs": results} if rank == 0 else None


if __name__ == "__main__":
    from runners.launch import exit_worker, worker_main

    exit_worker(worker_main(run_task))
