"""python benchmarks/engine_vs_torch.py [--repeats 3] [--steps 4] [--no-memory]

Our engine against torch's own components (runners/torch_engine.py) on the same plan: the same model code
and seeded weights, data, loss and Adam, on 4 local gloo CPU processes (one intra-op thread each). For
DDP, ZeRO-1, ZeRO-2 and ZeRO-3 it prints the median step time of each engine and the ratio ours / torch
(target <= 1.05; "paired" is the median over repeats of the ratio within a repeat), then the measured
peak memory per rank beside the cost model's prediction.

Timing: one set of processes runs every (plan, engine) pair `--repeats` times, plans and engines
interleaved (ours, torch, torch, ours, ...) so that drift in a shared machine's load hits both engines
alike; each run's first step is dropped (lazy allocation) and the median over all kept steps is reported.
Beside wall time, the CPU seconds per step summed over the 4 ranks (getrusage, all threads): on a shared
machine whose load swings, that measures each engine's work (compute plus its own overheads) far more
steadily than wall time, though it does not see time spent blocked on a peer.

Memory: each (plan, engine) runs again in fresh processes, so no earlier run's freed pages inflate the
resident set. train() reports the peak memory (resident set less mapped library files) of the worst rank
from step 1 on; we subtract that rank's memory just before the model was built (interpreter, torch, gloo), leaving what the
plan's state, activations and buffers cost — the quantity the cost model's peak_memory_bytes prices
(hardware preset "cpu").
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import os
import resource
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

from specs.job import Job  # noqa: E402
from specs.model import PRESETS  # noqa: E402
from specs.plan import Plan, zero_degrees  # noqa: E402
from runners.transformer import build_chunk  # noqa: E402
from runners.tensor_parallel import TPContext  # noqa: E402
from runners.config import RunConfig  # noqa: E402

WORLD = 4
SEQ_LEN = 128
MICRO_BATCH = 1
NUM_MICRO_BATCHES = 4
ENGINES = ("ours", "torch")
# Big enough that gradient and parameter collectives (~13 MB of fp32 parameters) and GEMMs both matter.
MODEL = dataclasses.replace(PRESETS["tiny"], name="tiny-h256-l4", hidden_size=256, num_layers=4,
                            ffn_hidden_size=704, max_seq_len=SEQ_LEN)
LEVELS = {"DDP": 0, "ZeRO-1": 1, "ZeRO-2": 2, "ZeRO-3": 3}


def make_config(level: int, engine: str, *, steps: int) -> RunConfig:
    s_p, s_g, s_os = zero_degrees(level, WORLD)
    plan = Plan(dp=WORLD, param_shard=s_p, grad_shard=s_g, optim_shard=s_os, micro_batch=MICRO_BATCH,
                num_micro_batches=NUM_MICRO_BATCHES)
    from cost_models.estimate import estimate
    from specs.cluster import make_cluster
    from specs.hardware import PRESETS as HARDWARE

    job = Job(global_batch=plan.global_batch, seq_len=SEQ_LEN, precision="fp32")
    cluster = make_cluster(hardware=HARDWARE["cpu"], num_devices=WORLD, devices_per_node=WORLD)
    predicted = estimate(plan, model=MODEL, cluster=cluster, job=job).to_dict()
    return RunConfig(plan=plan, model=MODEL, job=job, steps=steps, seed=0, engine=engine, timeout_s=600,
                     predicted=predicted)


def cpu_seconds() -> float:
    """User + system CPU time of this process, all threads (gloo's included)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _worker(rank: int, port: int, jobs: list[tuple[str, RunConfig]], queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    try:
        from runners.train import memory_now_bytes, train

        dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600))
        for label, cfg in jobs:
            idle = torch.tensor([float(memory_now_bytes(torch.device("cpu")))], dtype=torch.float64)
            marks: list[float] = []  # CPU time at the end of each step (on_step runs on every rank)
            metrics, trainer = train(cfg, device=torch.device("cpu"), on_step=lambda record: marks.append(cpu_seconds()))
            del trainer
            dist.all_reduce(idle, op=dist.ReduceOp.MAX)
            # CPU seconds of steps 1.. summed over ranks: unlike wall time, barely moved by other jobs' load.
            cpu = torch.tensor([b - a for a, b in zip(marks, marks[1:])], dtype=torch.float64)
            dist.all_reduce(cpu)
            metrics = {**metrics.to_dict(), "cpu_s_per_step": cpu.tolist()}
            if rank == 0:
                queue.put(("ok", label, metrics, int(idle.item())))
        dist.destroy_process_group()
    except Exception:
        queue.put(("error", f"rank {rank}: {traceback.format_exc()}", None, 0))
        raise


def run_jobs(jobs: list[tuple[str, RunConfig]]) -> list[tuple[str, dict, int]]:
    """Run the (label, config) jobs in order on one set of WORLD processes; (label, metrics, idle RSS) each."""
    from tests.distributed.harness import free_port

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, jobs, queue)) for r in range(WORLD)]
    for p in procs:
        p.start()
    out = []
    try:
        for _ in jobs:
            status, label, metrics, idle = queue.get(timeout=1800)
            if status != "ok":
                raise RuntimeError(label)
            out.append((label, metrics, idle))
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.kill()
    return out


def timing_jobs(*, repeats: int, steps: int) -> list[tuple[str, RunConfig]]:
    jobs = []
    for r in range(repeats):
        for i, (name, level) in enumerate(LEVELS.items()):
            # Alternate which engine goes first so neither always follows the other's warm caches.
            order = ENGINES if (r + i) % 2 == 0 else ENGINES[::-1]
            jobs.extend((f"{name}|{engine}", make_config(level, engine, steps=steps)) for engine in order)
    return jobs


def measure_times(*, repeats: int, steps: int) -> tuple[dict[str, list[list[float]]], dict[str, list[list[float]]]]:
    """label -> per repeat, the run's step times after the first; and their CPU seconds (all ranks)."""
    step_times: dict[str, list[list[float]]] = {}
    cpu_times: dict[str, list[list[float]]] = {}
    for label, metrics, _ in run_jobs(timing_jobs(repeats=repeats, steps=steps)):
        step_times.setdefault(label, []).append([s["step_time_s"] for s in metrics["steps"][1:]])
        cpu_times.setdefault(label, []).append(metrics["cpu_s_per_step"])
    return step_times, cpu_times


def paired_ratio(ours: list[list[float]], theirs: list[list[float]]) -> float:
    """Median over repeats of ours / torch within a repeat: the two runs of a repeat are adjacent in time,
    so load that drifts over minutes cancels."""
    return statistics.median(statistics.median(a) / statistics.median(b) for a, b in zip(ours, theirs))


def measure_memory(*, steps: int) -> dict[str, tuple[int, int, tuple[int, int] | None]]:
    """label -> (peak RSS of the worst rank, that minus the idle RSS, predicted (peak, peak - framework
    reserve) bytes)."""
    out = {}
    for name, level in LEVELS.items():
        for engine in ENGINES:
            label = f"{name}|{engine}"
            (_, metrics, idle), = run_jobs([(label, make_config(level, engine, steps=steps))])
            peak = metrics["summary"]["peak_memory_bytes"]
            predicted = metrics.get("predicted")
            if predicted is not None:  # the model's share, without its reserve for the framework itself
                reserve = predicted["breakdown"].get("framework_reserve_bytes", 0)
                predicted = (predicted["peak_memory_bytes"], predicted["peak_memory_bytes"] - reserve)
            out[label] = (peak, peak - idle, predicted)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(prog="engine_vs_torch")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=4, help="steps per run; the first is dropped")
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--no-timing", action="store_true")
    args = parser.parse_args()
    if not args.no_timing:
        print_times(*measure_times(repeats=args.repeats, steps=args.steps), args=args)
    if not args.no_memory:
        print_memory(measure_memory(steps=3))


def print_times(times: dict, cpu_times: dict, *, args) -> None:
    params = sum(p.numel() for p in build_chunk(MODEL, layers=range(MODEL.num_layers), first=True, last=True, seed=0,
                                                tp=TPContext.single(), recompute="none", loss_scale=1.0).parameters())
    print(f"{MODEL.name}: {params / 1e6:.2f} M params, seq {SEQ_LEN}, {WORLD} gloo CPU processes, "
          f"micro-batch {MICRO_BATCH} x {NUM_MICRO_BATCHES}, {args.repeats} interleaved repeats x {args.steps - 1} timed steps")
    print(f"{'plan':<8} {'ours s':>8} {'torch s':>8} {'ours/torch':>10} {'paired':>7} {'n':>4}   "
          f"{'ours cpu-s':>10} {'torch cpu-s':>11} {'cpu ratio':>9}")
    for name in LEVELS:
        ours, theirs = times[f"{name}|ours"], times[f"{name}|torch"]
        mo, mt = (statistics.median(t for run in runs for t in run) for runs in (ours, theirs))
        co, ct = (statistics.median(t for run in cpu_times[f"{name}|{e}"] for t in run) for e in ENGINES)
        n = sum(len(run) for run in ours)
        print(f"{name:<8} {mo:>8.3f} {mt:>8.3f} {mo / mt:>10.3f} {paired_ratio(ours, theirs):>7.3f} {n:>4}   "
              f"{co:>10.3f} {ct:>11.3f} {co / ct:>9.3f}")


def print_memory(memory: dict) -> None:
    mib = 2**20
    print(f"\n{'plan':<8} {'engine':<6} {'peak RSS MiB':>12} {'predicted':>9} {'above idle MiB':>14} "
          f"{'predicted w/o reserve':>21}")
    for label, (peak, above, predicted) in memory.items():
        name, engine = label.split("|")
        total, model = (f"{predicted[0] / mib:.1f}", f"{predicted[1] / mib:.1f}") if predicted else ("n/a", "n/a")
        print(f"{name:<8} {engine:<6} {peak / mib:>12.1f} {total:>9} {above / mib:>14.1f} {model:>21}")


if __name__ == "__main__":
    main()
