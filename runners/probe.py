"""Layer probe: time the engine's own transformer layer on every rank at once, and an all-gather beside it.

    python -m torch.distributed.run --nproc-per-node 4 -m runners.probe --work-dir DIR   (DIR/spec.json: ProbeSpec)

Aceso and Galvatron profile each layer's forward and backward on the device; `planner profile` does
the same through this worker (launched by runners.launch like every other), with the exact Block the
runner executes (runners/transformer.py), at a few (micro-batch, sequence) shapes, on all ranks
simultaneously, so that what a training step pays on this host is in the numbers: eager dispatch and
autograd bookkeeping per op, and processes sharing cores (4 ranks on 2 cores each get half a core,
which a single-process GEMM sweep never sees). One more point runs the middle shape under full
recomputation (torch.utils.checkpoint's own cost). The overlap probe then times a layer's
forward+backward beside an asynchronous all-gather of its parameters, the way ZeRO-3 prefetches.

What the points mean for the cost model (the fit of op_overhead_s, compute_time_scale,
recompute_overhead_s and comm_overlap_efficiency) is the application's business: planner/profiling.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from specs.hardware import LayerProbePoint
from specs.jsonio import dataclass_from_dict
from specs.model import ModelSpec

# (micro-batch, sequence length) points; the sequence is capped at the model's max_seq_len. The first is
# nearly compute-free (it isolates the per-op cost), the others scale the GEMMs up. On a GPU the shapes
# are those training steps run, where kernels, not the host's dispatch, set the time.
PROBE_SHAPES = ((1, 8), (1, 64), (4, 64))
CUDA_PROBE_SHAPES = ((1, 1024), (2, 2048), (4, 2048))
# Layers per probed chunk; times are per layer. One backward call has a fixed cost (autograd's graph
# walk setup, the loss) that a training chunk of many layers spreads thin; a one-layer probe would
# charge all of it to the layer.
PROBE_LAYERS = 4
PROBE_ROUNDS = 3


@dataclass(frozen=True)
class ProbeSpec:
    model: ModelSpec
    budget_s: float  # seconds per probe point (over all rounds)
    overlap_repeats: int = 10
    timeout_s: float = 300.0


@dataclass(frozen=True)
class ProbeResult:
    points: tuple[LayerProbePoint, ...]
    overlap: dict[str, float]  # compute_s, comm_s, both_s, efficiency ({} on one rank)

    def to_dict(self) -> dict:
        return {"points": [asdict(p) for p in self.points], "overlap": dict(self.overlap)}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "probe result") -> "ProbeResult":
        return dataclass_from_dict(cls, data, what=what)


def probe_shapes(model: ModelSpec, *, device: torch.device | None = None) -> list[tuple[int, int]]:
    shapes = CUDA_PROBE_SHAPES if device is not None and device.type == "cuda" else PROBE_SHAPES
    return [(b, min(s, model.max_seq_len)) for b, s in shapes]


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_seconds(body, *, device: torch.device, budget_s: float, min_repeats: int = 3, max_repeats: int = 200) -> float:
    """Mean seconds of `body` over as many back-to-back repeats as fit in `budget_s`, after one warm-up.

    The mean, not the median: with more processes than cores the scheduler slices time in milliseconds,
    so most short repeats run unpreempted and a median would hide the shared core a whole step pays."""
    body()
    _synchronize(device)
    count, start = 0, time.perf_counter()
    deadline = start + budget_s
    while count < max_repeats and (count < min_repeats or time.perf_counter() < deadline):
        body()
        count += 1
    _synchronize(device)
    return (time.perf_counter() - start) / count


def _probe_chunk(model: ModelSpec, *, num_layers: int, recompute: str, device: torch.device, dtype: torch.dtype):
    """`num_layers` Blocks of the runner's own code, unsharded, as one chunk."""
    from runners.transformer import build_chunk
    from runners.tensor_parallel import TPContext

    return build_chunk(model, layers=range(num_layers), first=False, last=False, seed=0, tp=TPContext.single(),
                       recompute=recompute, loss_scale=1.0).to(device=device, dtype=dtype)


def measure_layer(model: ModelSpec, *, device: torch.device, dtype: torch.dtype, budget_s: float,
                  barrier=lambda: None, rounds: int = PROBE_ROUNDS) -> list[LayerProbePoint]:
    """Forward and forward+backward seconds per Block (a chunk of PROBE_LAYERS of them, timed whole) at
    each probe shape, and the middle shape again under full recomputation. `barrier` runs before each
    measurement so that every rank measures the same shape at the same time. The shapes are measured in
    `rounds` interleaved rounds and each point keeps the median round, so a burst of foreign load spoils
    one round, not the point."""
    num_layers = min(PROBE_LAYERS, model.num_layers)
    chunks = {policy: _probe_chunk(model, num_layers=num_layers, recompute=policy, device=device, dtype=dtype)
              for policy in ("none", "full")}
    shapes = probe_shapes(model, device=device)
    keys = [(shape, "none") for shape in shapes] + [(shapes[len(shapes) // 2], "full")]
    inputs = {shape: torch.randn(*shape, model.hidden_size, device=device, dtype=dtype, requires_grad=True)
              for shape in shapes}
    samples: dict[tuple, tuple[list[float], list[float]]] = {key: ([], []) for key in keys}
    for _ in range(rounds):
        for key in keys:
            shape, policy = key
            x, chunk = inputs[shape], chunks[policy]

            def forward() -> None:
                chunk(x)

            def forward_backward() -> None:
                # Gradients accumulate into the buffers the first call allocated, as the engine's do.
                chunk(x).sum().backward()

            for body, out in ((forward, samples[key][0]), (forward_backward, samples[key][1])):
                barrier()
                out.append(_mean_seconds(body, device=device, budget_s=budget_s / rounds) / num_layers)
    name = str(dtype).split(".")[-1]
    return [LayerProbePoint(micro_batch=b, seq_len=s, dtype=name, forward_s=statistics.median(samples[key][0]),
                            forward_backward_s=statistics.median(samples[key][1]), recompute=policy)
            for key in keys for (b, s), policy in [key]]


def measure_overlap(model: ModelSpec, *, device: torch.device, dtype: torch.dtype, group, repeats: int,
                    rounds: int = PROBE_ROUNDS) -> dict[str, float]:
    """How much of a collective issued beside compute actually hides, the way the engine overlaps a
    ZeRO-3 prefetch with a layer: every rank times `repeats` layer forward+backward passes alone
    (compute_s), `repeats` all-gathers of one layer's parameters alone (comm_s), and both with each
    all-gather issued asynchronously before a pass and waited for after it (both_s); efficiency =
    (compute_s + comm_s - both_s) / min(compute_s, comm_s), clipped to [-1, 1]. Each time is the slowest
    rank's; `rounds` rounds, the median one kept. On a host with fewer cores than ranks the collective's
    thread competes with compute, and a peer that is computing answers late, so little hides, and the pair
    can even take longer than the two one after the other (a negative efficiency)."""
    from runners.comm import all_gather_single

    chunk = _probe_chunk(model, num_layers=1, recompute="none", device=device, dtype=dtype)
    n = dist.get_world_size(group)
    numel = -(-sum(p.numel() for p in chunk.parameters()) // n) * n
    shard = torch.ones(numel // n, dtype=dtype, device=device)
    full = torch.empty(numel, dtype=dtype, device=device)
    x = torch.randn(1, min(64, model.max_seq_len), model.hidden_size, device=device, dtype=dtype, requires_grad=True)

    def compute() -> None:
        chunk(x).sum().backward()

    def timed(body) -> float:
        body()  # warm-up
        dist.barrier(group=group)
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            body()
        _synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        return float(elapsed.item())

    def both() -> None:
        work = all_gather_single(full, shard, group=group, async_op=True)
        compute()
        work.wait()

    rows = []
    for _ in range(rounds):
        compute_s = timed(compute)
        comm_s = timed(lambda: all_gather_single(full, shard, group=group))
        both_s = timed(both)
        efficiency = (compute_s + comm_s - both_s) / max(min(compute_s, comm_s), 1e-12)
        rows.append({"compute_s": compute_s, "comm_s": comm_s, "both_s": both_s,
                     "efficiency": min(1.0, max(-1.0, efficiency))})
    return sorted(rows, key=lambda r: r["efficiency"])[len(rows) // 2]


def run_task(spec_dict: dict) -> ProbeResult | None:
    """The worker task (runners.launch.worker_main): every rank probes at once; each point keeps the
    slowest rank's means, since a synchronous step waits for its slowest rank."""
    from runners.faults import init_distributed
    from runners.launch import emit_event
    from runners.launch import pick_device

    spec = dataclass_from_dict(ProbeSpec, spec_dict, what="probe spec")
    device, backend = pick_device()
    init_distributed(backend, timeout_s=spec.timeout_s)
    rank = dist.get_rank()
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if rank == 0:
        emit_event("progress", done=0, total=2, label="layer probe")
    points = measure_layer(spec.model, device=device, dtype=dtype, budget_s=spec.budget_s, barrier=dist.barrier)
    times = torch.tensor([[p.forward_s, p.forward_backward_s] for p in points], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    slowest = tuple(LayerProbePoint(**{**asdict(p), "forward_s": float(f), "forward_backward_s": float(fb)})
                    for p, (f, fb) in zip(points, times.tolist()))
    overlap: dict[str, float] = {}
    if dist.get_world_size() > 1:
        if rank == 0:
            emit_event("progress", done=1, total=2, label="overlap probe")
        overlap = measure_overlap(spec.model, device=device, dtype=dtype, group=dist.group.WORLD,
                                  repeats=spec.overlap_repeats)
    dist.destroy_process_group()
    return ProbeResult(points=slowest, overlap=overlap) if rank == 0 else None


if __name__ == "__main__":
    import sys

    from runners.launch import worker_main

    sys.exit(worker_main(run_task))
