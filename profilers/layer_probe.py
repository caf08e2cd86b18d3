"""Layer probe: time the engine's own transformer layer on every rank at once, and fit the CPU costs
the GEMM and bandwidth sweeps cannot see.

Aceso and Galvatron profile each layer's forward and backward on the device; we do the same with the
exact Block the runner executes (runners/model.py), at a few (micro-batch, sequence) shapes, on all
ranks of the profile's torchrun simultaneously, so that what a training step pays on this host is in
the numbers: eager dispatch and autograd bookkeeping per op, and processes sharing cores (4 ranks on 2
cores each get half a core, which a single-process GEMM sweep never sees).

Model of a probe point (the cost model's, cost_models/estimate.py): with F and B the layer's forward and
backward compute time predicted from the profile's own GEMM and bandwidth fits (no calibration),

    forward          = c * F       + n * o
    forward+backward = c * (F + B) + (1 + k) * n * o

where n is the ops of one layer forward (`_num_ops`), k the backward ops per forward op, o the seconds
each op pays (`op_overhead_s`) and c the factor by which real compute is slower than the sweep predicts
(`compute_time_scale`). Smallest relative squared error over all points (rows divided by the measured
time, as planner/calibrate.py weighs plans), c > 0 and o >= 0 (`fit_overheads`).

One more point runs the middle shape under full recomputation: what it takes beyond the plain layer's
forward+backward plus a second forward is torch.utils.checkpoint's own cost (`recompute_overhead_s`).
The overlap probe (`measure_overlap`) then times a layer's forward+backward beside an asynchronous
all-gather of its parameters, the way ZeRO-3 prefetches, and gives comm_overlap_efficiency.

On CUDA the kernel queue hides per-op dispatch behind the kernels of earlier ops, so the probe is
recorded (raw points in the profile) but not fitted into the calibration: the cost model keeps o = 0,
c = 1 and full overlap there, as its docstring says (the CUDA path of the probes has not run on a GPU
yet).
"""

from __future__ import annotations

import dataclasses
import math
import statistics
import time

import torch

from specs.model import ModelSpec
from profilers.compute import repeat_times, synchronize
from specs.hardware import LayerProbePoint as ProbePoint

# (micro-batch, sequence length) points; the sequence is capped at the model's max_seq_len. The first is
# nearly compute-free (it isolates the per-op cost), the others scale the GEMMs up.
PROBE_SHAPES = ((1, 8), (1, 64), (4, 64))
# Layers per probed chunk; times are per layer. One backward call has a fixed cost (autograd's graph
# walk setup, the loss) that a training chunk of many layers spreads thin; a one-layer probe would
# charge all of it to the layer.
PROBE_LAYERS = 4
PROBE_ROUNDS = 3


def probe_shapes(model: ModelSpec) -> list[tuple[int, int]]:
    return [(b, min(s, model.max_seq_len)) for b, s in PROBE_SHAPES]


def _probe_chunk(model: ModelSpec, *, num_layers: int, recompute: str, device: torch.device, dtype: torch.dtype):
    """`num_layers` Blocks of the runner's own code, unsharded, as one chunk."""
    from runners.model import build_chunk
    from runners.tensor_parallel import TPContext

    return build_chunk(model, layers=range(num_layers), first=False, last=False, seed=0, tp=TPContext.single(),
                       recompute=recompute, loss_scale=1.0).to(device=device, dtype=dtype)


def measure_layer(model: ModelSpec, *, device: torch.device, dtype: torch.dtype, budget_s: float,
                  barrier=lambda: None, rounds: int = PROBE_ROUNDS) -> list[ProbePoint]:
    """Forward and forward+backward seconds per Block (a chunk of PROBE_LAYERS of them, timed whole) at
    each probe shape. `barrier` runs before each measurement so that every rank measures the same shape
    at the same time. Each measurement is the mean over `budget_s / rounds` seconds, not the median:
    with more processes than cores the scheduler slices time in milliseconds, so most short repeats run
    unpreempted and a median would hide the shared core that a whole step does pay. The shapes are
    measured in `rounds` interleaved rounds and each point keeps the median round, so a burst of
    foreign load spoils one round, not the point."""
    num_layers = min(PROBE_LAYERS, model.num_layers)
    chunks = {policy: _probe_chunk(model, num_layers=num_layers, recompute=policy, device=device, dtype=dtype)
              for policy in ("none", "full")}
    # Every shape without recomputation, and the middle one again under full recomputation (its extra
    # cost over a second forward is torch.utils.checkpoint's own: recompute_overhead_s).
    shapes = probe_shapes(model)
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
                times = repeat_times(body, device=device, budget_s=budget_s / rounds, max_repeats=200)
                out.append(statistics.fmean(times) / num_layers)
    name = str(dtype).split(".")[-1]
    return [ProbePoint(micro_batch=b, seq_len=s, dtype=name, forward_s=statistics.median(samples[key][0]),
                       forward_backward_s=statistics.median(samples[key][1]), recompute=policy)
            for key in keys for (b, s), policy in [key]]


def measure_overlap(model: ModelSpec, *, device: torch.device, dtype: torch.dtype, group, repeats: int,
                    all_gather, rounds: int = PROBE_ROUNDS) -> dict[str, float]:
    """How much of a collective issued beside compute actually hides (comm_overlap_efficiency), the way
    the engine overlaps a ZeRO-3 prefetch with a layer: every rank times `repeats` layer forward+backward
    passes alone (compute_s), `repeats` all-gathers of one layer's parameters alone (comm_s), and both
    with each all-gather issued asynchronously before a pass and waited for after it (both_s);
    efficiency = (compute_s + comm_s - both_s) / min(compute_s, comm_s), clipped to [-1, 1]. Each time is
    the slowest rank's; `rounds` rounds, the median one kept. On a host with fewer cores than ranks the collective's thread competes with
    compute, and a peer that is computing answers late, so little hides, and the pair can even take
    longer than the two run one after the other (a negative efficiency)."""
    import torch.distributed as dist

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
        synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            body()
        synchronize(device)
        elapsed = torch.tensor([time.perf_counter() - start], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        return float(elapsed.item())

    def both() -> None:
        work = all_gather(full, shard, group=group, async_op=True)
        compute()
        work.wait()

    rows = []
    for _ in range(rounds):  # interleaved rounds; the median round (by efficiency) is kept
        compute_s = timed(compute)
        comm_s = timed(lambda: all_gather(full, shard, group=group))
        both_s = timed(both)
        efficiency = (compute_s + comm_s - both_s) / max(min(compute_s, comm_s), 1e-12)
        rows.append({"compute_s": compute_s, "comm_s": comm_s, "both_s": both_s,
                     "efficiency": min(1.0, max(-1.0, efficiency))})
    return sorted(rows, key=lambda r: r["efficiency"])[len(rows) // 2]


def fit_overheads(model: ModelSpec, hardware, points: list[ProbePoint]) -> dict[str, float]:
    """{'op_overhead_s', 'compute_time_scale'} fitted to the probe points without recomputation (module
    docstring), and 'recompute_overhead_s' from a point under full recomputation if there is one.

    The predicted compute is not linear in c (each kernel's time is floored at the kernel overhead,
    cost_models/compute.py), so c is searched on a log grid, refined by golden-section search, and for each
    c the best non-negative o is closed form (one-variable least squares)."""
    from cost_models.compute import layer_compute_times
    from cost_models.estimate import BACKWARD_OPS_PER_FORWARD_OP, _num_ops

    n = _num_ops(model)["layer"]
    k = BACKWARD_OPS_PER_FORWARD_OP
    plain = [p for p in points if p.recompute == "none"]
    # torch.utils.checkpoint's own cost per layer and micro-batch: what a fully recomputed layer's
    # forward+backward takes beyond the plain layer's forward+backward plus its re-run forward.
    by_shape = {(p.micro_batch, p.seq_len): p for p in plain}
    extra = [p.forward_backward_s - by_shape[(p.micro_batch, p.seq_len)].forward_backward_s
             - by_shape[(p.micro_batch, p.seq_len)].forward_s
             for p in points if p.recompute == "full" and (p.micro_batch, p.seq_len) in by_shape]
    points = plain

    def predicted(c: float) -> list[tuple[float, float, float]]:
        """(compute seconds, ops, measured seconds) per equation at compute_time_scale c."""
        hw = dataclasses.replace(hardware, calibration={"compute_time_scale": c})
        rows = []
        for p in points:
            t = layer_compute_times(model, hw, micro_batch=p.micro_batch, seq_len=p.seq_len, tp=1,
                                    sequence_parallel=False, precision="fp32")
            rows.append((t.forward_s, n, p.forward_s))
            rows.append((t.forward_s + t.backward_s, (1 + k) * n, p.forward_backward_s))
        return rows

    def solve(c: float) -> tuple[float, float]:
        """(relative squared error, o) at c."""
        rows = predicted(c)
        # minimise sum ((f + ops * o) / m - 1)^2 over o >= 0
        num = sum((ops / m) * (1 - f / m) for f, ops, m in rows)
        den = sum((ops / m) ** 2 for _, ops, m in rows)
        o = max(0.0, num / den)
        return sum(((f + ops * o) / m - 1) ** 2 for f, ops, m in rows), o

    grid = [10 ** (i / 20) for i in range(-40, 61)]  # 0.01 .. 1000
    best = min(grid, key=lambda c: solve(c)[0])
    # Golden-section search on log c between the grid neighbours of the best point.
    lo, hi = math.log(best) - math.log(10) / 20, math.log(best) + math.log(10) / 20
    ratio = (math.sqrt(5) - 1) / 2
    for _ in range(60):
        a, b = hi - ratio * (hi - lo), lo + ratio * (hi - lo)
        if solve(math.exp(a))[0] <= solve(math.exp(b))[0]:
            hi = b
        else:
            lo = a
    candidates = [best, math.exp((lo + hi) / 2)]
    best = min(candidates, key=lambda c: solve(c)[0])
    fitted = {"compute_time_scale": best, "op_overhead_s": solve(best)[1]}
    if extra:
        fitted["recompute_overhead_s"] = max(0.0, statistics.median(extra))
    return fitted
