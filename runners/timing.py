"""Batched timing: several plans' trainers in one set of processes, taking turns, so that process
start-up (most of a short run on a loaded host) is paid once and every plan is sampled across the whole
measurement window: a burst of load from other processes spreads over all plans instead of landing on
one plan's run.

    python -m torch.distributed.run --nproc-per-node 4 -m runners.timing --work-dir DIR   (DIR/spec.json: a TimingSpec)

Each plan runs `steps_per_round` steps per round with the training loop's own step (runners.train.
timed_step, ranks started together by a barrier); its first step ever allocates its buffers and is run
untimed. Beside each step's wall time (the slowest rank's) it records the step's CPU seconds summed over
the ranks. Memory is not measured here (every trainer lives in the same processes).
"""

from __future__ import annotations

import gc
import resource

import torch
import torch.distributed as dist

from runners.config import TimingResult, TimingSpec


def run_task(spec_dict: dict) -> TimingResult | None:
    """The worker task (runners.launch.worker_main)."""
    from runners.data import make_data
    from runners.faults import init_distributed
    from runners.launch import emit_event
    from runners.launch import pick_device
    from runners.train import make_trainer, timed_step

    spec = TimingSpec.from_dict(spec_dict)
    device, backend = pick_device()
    init_distributed(backend, timeout_s=max(c.timeout_s for c in spec.configs))
    rank = dist.get_rank()
    trainers: dict[int, tuple] = {}
    times: list[list[float]] = [[] for _ in spec.configs]
    cpu: list[list[float]] = [[] for _ in spec.configs]  # this rank's CPU seconds per timed step
    step_of = [0] * len(spec.configs)
    total = spec.rounds * len(spec.configs)
    for r in range(spec.rounds):
        for i, cfg in enumerate(spec.configs):
            if rank == 0:
                emit_event("progress", done=r * len(spec.configs) + i + 1, total=total,
                           label=f"round {r + 1}: {spec.labels[i]}")
            if i not in trainers:
                torch.manual_seed(cfg.seed)
                trainers[i] = (make_trainer(cfg, device=device),
                               make_data(cfg.data, vocab_size=cfg.model.vocab_size, seq_len=cfg.job.seq_len, seed=cfg.seed))
            trainer, data = trainers[i]
            for timed in ([False] if step_of[i] == 0 else []) + [True] * spec.steps_per_round:
                cpu_before = cpu_seconds()
                record = timed_step(trainer, data.global_batch(step_of[i], cfg.job.global_batch), device=device,
                                    barrier=True)
                step_of[i] += 1
                if not timed:
                    _freeze_long_lived()
                if timed:
                    times[i].append(record.step_time_s)
                    cpu[i].append(cpu_seconds() - cpu_before)
    # Summed over ranks once at the end: a collective per step would be timed work of its own.
    cpu_total = torch.tensor([t for per_plan in cpu for t in per_plan], dtype=torch.float64, device=device)
    dist.all_reduce(cpu_total)
    dist.barrier()
    dist.destroy_process_group()
    flat, cpu_s = iter(cpu_total.tolist()), []
    for per_plan in cpu:
        cpu_s.append(tuple(next(flat) for _ in per_plan))
    return TimingResult(step_times_s=tuple(tuple(t) for t in times), cpu_times_s=tuple(cpu_s)) if rank == 0 else None


def _freeze_long_lived() -> None:
    """Move every object alive now (the trainers built so far, their modules, buffers and optimizer
    state) out of the cyclic garbage collector's reach. With many trainers in one process each step's
    allocations trigger collections that traverse all of them, so a plan's step grew with the number of
    plans beside it, most for plans of many small ops: dp2 at 8 micro-batches of 1 measured 111.6 ms among
    24 trainers against 82.0 ms in a run of its own (`planner run`), at 1 micro-batch of 8 54.5 against
    51.4 ms. A run of its own holds one trainer, which its collections traverse too, so the freeze leaves
    each plan's step closer to that run's, not to a step without a collector."""
    gc.collect()
    gc.freeze()


def cpu_seconds() -> float:
    """User + system CPU seconds of this process, all its threads (gloo's included): on a shared host the
    work a step costs, which other jobs' load barely moves (their time slices do not count here)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


if __name__ == "__main__":
    from runners.launch import exit_worker, worker_main

    exit_worker(worker_main(run_task))
