"""Layer probe: time the engine's own transformer layer on every rank at once, and an all-gather beside it.

    python -m torch.distributed.run --nproc-per-node 4 -m runners.probe --work-dir DIR   (DIR/spec.json: ProbeSpec)

Aceso and Galvatron profile each layer's forward and backward on the device; `planner profile` does
the same through this worker (launched by runners.launch like every other), with the exact Block the
runner executes (runners/transformer.py), at a few (micro-batch, sequence) shapes, on all ranks
simultaneously, so that what a training step pays on this host is in the numbers: eager dispatch and
autograd bookkeeping per op, and processes sharing cores (4 ranks on 2 cores each get half a core,
which a single-process GEMM sweep never sees). Two more points run the middle shape under full and under
selective recomputation (torch.utils.checkpoint's own cost, which differs by region: 3.1 ms per tiny layer
under full, 1.5 under selective, in one process). On CPU the attention probe times the context-parallel ring's
attention steps and the fused attention kernel the same way, every rank at once, in the same rounds
(`measure_attention_blocks`). The overlap probe then times a
chunk's micro-step with each unit's parameter all-gather blocking, and prefetched one unit ahead the way
ZeRO-3 does. On CPU the sharding probe then times the sharding engine's own bookkeeping (hooks, buffers,
gradient copies) per unit and micro-batch, its collectives replaced by local copies (`measure_sharding`),
the context-parallel probe the engine's CP attention with and without its exchanges (`measure_context`),
and the sync-wait probe what a blocking collective waits for its last ranks after a segment of compute
(`measure_sync_wait`). The attention and sync-wait probes time their calls as the group's wall
(`_group_seconds`), not each rank's own mean.

What the points mean for the cost model (the fit of op_overhead_s, compute_time_scale,
recompute_overhead_s and comm_overlap_efficiency) is the application's business: planner/profiling.py.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist

from runners.comm import Comm
from specs.hardware import AttentionPoint, LayerProbePoint, RingBlockPoint
from specs.jsonio import dataclass_from_dict
from specs.model import ModelSpec

# (micro-batch, sequence length) points; the sequence is capped at the model's max_seq_len. The first is
# nearly compute-free (it isolates the per-op cost), the others scale the GEMMs up. On a GPU the shapes
# are those training steps run, where kernels, not the host's dispatch, set the time.
PROBE_SHAPES = ((1, 8), (1, 64), (4, 64))
CUDA_PROBE_SHAPES = ((1, 1024), (2, 2048), (4, 2048))
# On CPU one more point where the GEMMs and attention, not the dispatch, set the time (`long_probe_shape`):
# up to LONG_PROBE_TOKENS tokens at the model's longest sequence up to LONG_PROBE_SEQ, within
# LONG_PROBE_FLOPS of forward work per layer (a 1B model's layer is compute-bound at 64 tokens already and
# gets no extra point). Without it a small model's points are all dispatch-bound (its kernels run ~10 us),
# the per-op cost o and the compute scale c of the fit (planner/profiling.py) trade off, and a c fitted
# there multiplied the GEMMs of long sequences: on benchmarks/context_parallel.py's 4-layer h128 model, 4
# ranks on 2 cores, c came out 5.2 from its <= 256-token points, where a 2048-token layer runs at ~2.7.
LONG_PROBE_TOKENS = 2048
LONG_PROBE_SEQ = 1024
LONG_PROBE_FLOPS = 2e9
# Layers per probed chunk; times are per layer. One backward call has a fixed cost (autograd's graph
# walk setup, the loss) that a training chunk of many layers spreads thin; a one-layer probe would
# charge all of it to the layer.
PROBE_LAYERS = 4
PROBE_ROUNDS = 3
# The overlap probe's rounds (each times every mode once; medians kept).
OVERLAP_ROUNDS = 5

# Query heads per measurement (at most), the ring's and the fused attention's: the per-head cost is what is
# priced, and at one thread per process the kernels run heads one after another.
RING_MAX_HEADS = 4
# The attention probe's seconds per call over all rounds: the probe's budget per point over this (0.25 s at
# the default 4 s), the single-process sweeps' budget before they moved here.
RING_BUDGET_SHARE = 16
# Each timed window of the attention probe runs at least this long: the window holds a barrier (~5 ms on 4 ranks
# of a 2-core host), which a handful of short calls cannot spread thin. The 64-token SDPA of 4 heads of 8
# (forward and backward) read 1.88 ms a call in windows of 5 calls, 1.10 in 100 and 1.07 in 400.
ATTENTION_MIN_WINDOW_S = 0.05
# Empty windows timed at the start of each of the attention probe's rounds: their median is the window's own
# cost, taken off each window of the round (`_window_overhead_s`).
WINDOW_OVERHEAD_SAMPLES = 5
# The worker's progress steps: layer, attention, overlap, sharding, context-parallel and sync-wait probes.
PROBE_STEPS = 6


@dataclass(frozen=True)
class ProbeSpec:
    model: ModelSpec
    budget_s: float  # seconds per probe point (over all rounds)
    overlap_repeats: int = 12
    timeout_s: float = 300.0
    ring_sides: tuple[int, ...] = ()  # measure_attention_blocks's (CPU; profilers/profile.RING_SIDES)
    attention_rounds: int = PROBE_ROUNDS  # its rounds (profilers/profile.attention_rounds)
    # The fused attention's points beside them (CPU; profilers/profile.ATTENTION_SEQ_LENS, attention_head_dims).
    attention_seq_lens: tuple[int, ...] = ()
    attention_head_dims: tuple[int, ...] = ()
    sync_share: float = 1.0  # of the sync-wait probe's loop length and rounds (profilers/profile.budget_share)


@dataclass(frozen=True)
class ProbeResult:
    points: tuple[LayerProbePoint, ...]
    overlap: dict[str, float]  # compute_s, comm_s, both_s, efficiency ({} on one rank)
    sharding: dict[str, float] = field(default_factory=dict)  # measure_sharding's ({} on one rank or a GPU)
    context: dict[str, float] = field(default_factory=dict)  # measure_context's ({} on one rank or a GPU)
    sync: dict[str, float] = field(default_factory=dict)  # measure_sync_wait's ({} on one rank or a GPU)
    ring: tuple[RingBlockPoint, ...] = ()  # measure_attention_blocks's (() on a GPU)
    attention: tuple[AttentionPoint, ...] = ()  # measure_attention_blocks's (() on a GPU)

    def to_dict(self) -> dict:
        return {"points": [asdict(p) for p in self.points], "overlap": dict(self.overlap),
                "sharding": dict(self.sharding), "context": dict(self.context), "sync": dict(self.sync),
                "ring": [asdict(p) for p in self.ring], "attention": [asdict(p) for p in self.attention]}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "probe result") -> "ProbeResult":
        return dataclass_from_dict(cls, data, what=what)


def probe_shapes(model: ModelSpec, *, device: torch.device | None = None) -> list[tuple[int, int]]:
    if device is not None and device.type == "cuda":
        return [(b, min(s, model.max_seq_len)) for b, s in CUDA_PROBE_SHAPES]
    shapes = [(b, min(s, model.max_seq_len)) for b, s in PROBE_SHAPES]
    long = long_probe_shape(model)
    if long is not None and long[0] * long[1] > max(b * s for b, s in shapes):
        shapes.append(long)
    return shapes


def long_probe_shape(model: ModelSpec) -> tuple[int, int] | None:
    """(micro-batch, sequence) of the CPU probe's compute-bound point (LONG_PROBE_TOKENS above), or None
    where even one sequence of 64 tokens would exceed LONG_PROBE_FLOPS."""
    per_token = 2 * (model.attention_params() + model.mlp_params())  # forward FLOPs of the GEMMs
    seq = min(LONG_PROBE_SEQ, model.max_seq_len)
    tokens = LONG_PROBE_TOKENS
    # Causal attention scores and values: 2 s h FLOPs per token at sequence s.
    while tokens >= 64 and tokens * (per_token + 2 * min(seq, tokens) * model.hidden_size) > LONG_PROBE_FLOPS:
        tokens //= 2
    if tokens < 64:
        return None
    seq = min(seq, tokens)
    return tokens // seq, seq


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _mean_seconds(body, *, device: torch.device, budget_s: float, min_repeats: int = 3, max_repeats: int = 200,
                  warm_up: bool = True) -> float:
    """Mean seconds of `body` over as many back-to-back repeats as fit in `budget_s`, after one warm-up
    (unless `warm_up` is False: the body ran just before).

    The mean, not the median: with more processes than cores the scheduler slices time in milliseconds,
    so most short repeats run unpreempted and a median would hide the shared core a whole step pays."""
    if warm_up:
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
    each probe shape, and the middle shape again under full and under selective recomputation. `barrier` runs before each
    measurement so that every rank measures the same shape at the same time. The shapes are measured in
    `rounds` interleaved rounds and each point keeps the median round, so a burst of foreign load spoils
    one round, not the point."""
    num_layers = min(PROBE_LAYERS, model.num_layers)
    chunks = {policy: _probe_chunk(model, num_layers=num_layers, recompute=policy, device=device, dtype=dtype)
              for policy in ("none", "full", "selective")}
    shapes = probe_shapes(model, device=device)
    # The recomputation points at the middle of the three base shapes (not the CPU long point).
    keys = [(shape, "none") for shape in shapes] + [(shapes[1], "full"), (shapes[1], "selective")]
    # The Block's layout is [s, b, h] (runners/transformer.py), so shape (b, s) is fed as (s, b, h).
    inputs = {(b, s): torch.randn(s, b, model.hidden_size, device=device, dtype=dtype, requires_grad=True)
              for b, s in shapes}
    samples: dict[tuple, tuple[list[float], list[float]]] = {key: ([], []) for key in keys}
    for round_ in range(rounds):
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
                # Warmed up in the first round; later rounds measure bodies that already ran.
                out.append(_mean_seconds(body, device=device, budget_s=budget_s / rounds, warm_up=round_ == 0)
                           / num_layers)
    name = str(dtype).split(".")[-1]
    return [LayerProbePoint(micro_batch=b, seq_len=s, dtype=name, forward_s=statistics.median(samples[key][0]),
                            forward_backward_s=statistics.median(samples[key][1]), recompute=policy)
            for key in keys for (b, s), policy in [key]]


def _ring_heads(model: ModelSpec) -> tuple[int, int]:
    """(query heads, K/V heads) the ring probe times: at most RING_MAX_HEADS query heads, the model's ratio."""
    heads = min(model.num_heads, RING_MAX_HEADS)
    return heads, max(1, heads * model.num_kv_heads // model.num_heads)


def _ring_block_calls(model: ModelSpec, *, side: int, device: torch.device) -> list:
    """The four timed calls of a ring rank holding `side` tokens: step 0's causal square forward and
    backward, then a half block's (every other step: side x side / 2 unmasked scores), in fp32 (CPU runs'
    dtype), with the model's head width and query / K-V head ratio."""
    from runners.context_parallel import ring_backward_step, ring_forward_step

    heads, kv_heads = _ring_heads(model)
    d, scale = model.head_dim, model.head_dim ** -0.5
    q, dout = (torch.randn(1, heads, side, d, device=device) for _ in range(2))
    k, v = (torch.randn(1, kv_heads, side, d, device=device) for _ in range(2))
    whole = slice(None)
    calls = []
    for cols, causal in ((whole, True), (slice(0, side // 2), False)):
        out = torch.zeros(1, heads, side, d, device=device)
        lse = torch.full((1, heads, side), float("-inf"), device=device)
        ring_forward_step(q, k, v, out, lse, rows=whole, cols=cols, causal=causal, scale=scale)
        delta, dq = (dout * out).sum(-1), torch.zeros_like(q)

        def forward(cols=cols, causal=causal) -> None:
            o = torch.zeros(1, heads, side, d, device=device)
            running = torch.full((1, heads, side), float("-inf"), device=device)
            ring_forward_step(q, k, v, o, running, rows=whole, cols=cols, causal=causal, scale=scale)

        def backward(cols=cols, causal=causal, out=out, lse=lse, delta=delta, dq=dq) -> None:
            ring_backward_step(q, k, v, dout, out, lse, delta, dq, rows=whole, cols=cols, causal=causal,
                               scale=scale)

        calls += [forward, backward]
    return calls


def _group_seconds(body, *, repeats: int, device: torch.device) -> float:
    """Seconds per call of `body` run `repeats` times on every rank between two barriers: the wall time of
    the whole group. Each rank's own mean would not do for calls of ~100 ms on a host with fewer cores than
    ranks: a rank whose calls end first waits in the barrier and leaves its core to the others, whose last
    calls then run faster than they would in a step, where every rank works until the step's end."""
    dist.barrier()
    _synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        body()
    _synchronize(device)
    dist.barrier()
    return (time.perf_counter() - start) / repeats


def _window_overhead_s(device: torch.device) -> float:
    """What a timed window (`_group_seconds`) adds to its calls: the median of WINDOW_OVERHEAD_SAMPLES empty
    windows, the closing barrier and the ranks' skew in leaving the opening one. Left in, it priced the ring's
    steps 10-25% over their time in a step: the attention probe's windows (ATTENTION_MIN_WINDOW_S) hold one or
    two 20-70 ms steps of a 1024-token side, and 4 ranks of a 2-core host read cp4's four steps at 4096 tokens
    283-309 ms a layer and micro-batch where windows of 0.2 s read 224-281 (and with the empty window taken
    off, 211-276); the fused kernel's 4096-token points (0.25-1.1 s a call) moved 1-3%."""
    return statistics.median(_group_seconds(lambda: None, repeats=1, device=device)
                             for _ in range(WINDOW_OVERHEAD_SAMPLES))


def _sdpa_calls(*, heads: int, seq_len: int, head_dim: int, device: torch.device) -> list:
    """Causal scaled_dot_product_attention (the engine's attention core) of `heads` heads over `seq_len` tokens,
    micro-batch 1, fp32: [forward, forward + backward]."""
    q, k, v = (torch.randn(1, heads, seq_len, head_dim, device=device, requires_grad=True) for _ in range(3))
    grad = torch.randn(1, heads, seq_len, head_dim, device=device)

    def forward() -> None:
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward_backward() -> None:
        torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True).backward(grad)

    return [forward, forward_backward]


def measure_attention_blocks(model: ModelSpec, *, device: torch.device, budget_s: float, sides: tuple[int, ...],
                             seq_lens: tuple[int, ...] = (), head_dims: tuple[int, ...] = (),
                             rounds: int = PROBE_ROUNDS) -> tuple[tuple[RingBlockPoint, ...],
                                                                  tuple[AttentionPoint, ...]]:
    """This engine's ring attention steps (runners/context_parallel.ring_forward_step / ring_backward_step)
    at each side of `sides`, and the fused causal attention (`_sdpa_calls`) at each of `seq_lens` x
    `head_dims`, timed on every rank at once (CPU) in the same interleaved rounds: per call the group's wall
    seconds (`_group_seconds`) over as many calls as fit in budget_s / rounds (at least ATTENTION_MIN_WINDOW_S)
    by the second warm-up call's slowest rank (at least one), less the window's own cost spread over its calls
    (`_window_overhead_s`, at most half the window), the median of `rounds` rounds. A step runs while
    its peers run theirs on the same host, each at its share of the cores and of the memory bandwidth these
    memory-bound kernels lean on.
    Timed in one process with the other cores idle, the 1024-token half block's backward read 46, 19 and
    17.5 ms in three profiles of one 2-core host while the ring's measured step stayed within 8%, and the
    fused attention over 4096 tokens (dp4's kernel) was priced 906 ms a layer where a 4-rank step ran it in
    681-800. Timed in one set of rounds, the two also see the same host speed: cp4 against dp4 turns on their
    ratio, which separate sweeps minutes apart moved by more than the target's 10%. So the points carry
    `concurrent` and are priced as they are (cost_models/compute.py)."""
    heads, kv_heads = _ring_heads(model)
    calls = {("ring", side): _ring_block_calls(model, side=side, device=device) for side in sides}
    calls.update({("sdpa", s, d): _sdpa_calls(heads=heads, seq_len=s, head_dim=d, device=device)
                  for d in head_dims for s in seq_lens})
    keys = [(name, i) for name, group in calls.items() for i in range(len(group))]
    warm = []
    for name, i in keys:
        calls[name][i]()  # the first call allocates; the second says how long one takes
        start = time.perf_counter()
        calls[name][i]()
        warm.append(time.perf_counter() - start)
    one = torch.tensor(warm, dtype=torch.float64, device=device)
    dist.all_reduce(one, op=dist.ReduceOp.MAX)
    window = max(budget_s / rounds, ATTENTION_MIN_WINDOW_S)
    repeats = {key: max(1, min(1000, round(window / max(t, 1e-6)))) for key, t in zip(keys, one.tolist())}
    samples: dict[tuple, list[float]] = {key: [] for key in keys}
    for _ in range(rounds):
        overhead = _window_overhead_s(device)
        for name, i in keys:
            seconds = _group_seconds(calls[name][i], repeats=repeats[name, i], device=device)
            samples[name, i].append(max(seconds - overhead / repeats[name, i], seconds / 2))
    medians = torch.tensor([statistics.median(samples[key]) for key in keys], dtype=torch.float64, device=device)
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    med = dict(zip(keys, medians.tolist()))
    ring = tuple(RingBlockPoint(side=side, num_heads=heads, num_kv_heads=kv_heads, head_dim=model.head_dim,
                                square_forward_s=med[("ring", side), 0], square_backward_s=med[("ring", side), 1],
                                half_forward_s=med[("ring", side), 2], half_backward_s=med[("ring", side), 3],
                                concurrent=True) for side in sides)
    attention = tuple(AttentionPoint(seq_len=s, num_heads=heads, head_dim=d, dtype="fp32",
                                     forward_s=med[("sdpa", s, d), 0], concurrent=True,
                                     backward_s=max(med[("sdpa", s, d), 1] - med[("sdpa", s, d), 0],
                                                    med[("sdpa", s, d), 0]))
                      for d in head_dims for s in seq_lens)
    return ring, attention


def _micro_step(units, x, gather, mode: str) -> None:
    """One forward and backward of the chunk `units` on input `x`, each unit's parameters fetched by
    `gather(i, async_op=)`: mode "compute" (no gathers), "forward" (forward only), "serial" or "prefetch"."""
    pending = gather(0, async_op=True) if mode == "prefetch" else None
    ins, outs = [], []  # each unit's input is a leaf, so its backward runs alone, as under the hooks
    for i, unit in enumerate(units):
        if mode == "serial":
            gather(i, async_op=False)
        elif mode == "prefetch":
            pending.wait()
            pending = gather(i + 1, async_op=True) if i + 1 < len(units) else None
        ins.append(x if i == 0 else outs[-1].detach().requires_grad_())
        outs.append(unit(ins[-1]))
    if mode == "forward":
        return
    grad, last = torch.ones_like(outs[-1]), len(units) - 1
    pending = gather(last, async_op=True) if mode == "prefetch" else None
    for i in range(last, -1, -1):
        if mode == "serial":
            gather(i, async_op=False)
        elif mode == "prefetch":
            pending.wait()
            pending = gather(i - 1, async_op=True) if i > 0 else None
        outs[i].backward(grad)  # weight gradients too, as in training
        grad, ins[i].grad = ins[i].grad, None


def measure_overlap(model: ModelSpec, *, device: torch.device, dtype: torch.dtype, group, repeats: int,
                    rounds: int = OVERLAP_ROUNDS) -> dict[str, float]:
    """How much of the parameter gathers that ZeRO-3 prefetches hides behind compute, measured the way
    the engine overlaps them (runners/sharding/gather.py, prefetch depth 1) and in the terms the cost
    model prices them (cost_models/estimate._overlap).

    A chunk of PROBE_LAYERS one-layer units, each with its parameters' all-gather, runs a micro-step
    four ways, `repeats` times each, interleaved in `rounds` rounds: compute alone and its forward alone, "serial" (every gather blocking just before its unit, forward and backward) and
    "prefetch" (unit i+1's gather issued before unit i computes and waited for just before unit i+1;
    backward runs unit by unit, last to first, each next gather issued before the current unit's
    backward). The medians over rounds give the forward F and backward B compute, the gathers' time
    G = serial - compute, and the efficiency e that the cost model's overlap formula needs to reproduce
    the prefetch step: prefetch = serial - e x (min(F, G_f) + min(B, G_b)), where G_f = G_b = (n - 1)
    gathers of the 2n are the ones issued beside compute; clipped to [-1, 1]. Each time is the slowest
    rank's. The earlier probe timed one gather beside a whole forward+backward for a few milliseconds:
    on a 2-core host it read -1 (worse than serial) while prefetch in the engine saved 12-15% of a ZeRO-3
    step (303 -> 267 ms at 8 micro-batches of 1), which the cost model prices as e ~ 0.4."""
    from runners.comm import all_gather_single

    n = dist.get_world_size(group)
    units = [_probe_chunk(model, num_layers=1, recompute="none", device=device, dtype=dtype)
             for _ in range(min(PROBE_LAYERS, model.num_layers))]
    numel = -(-sum(p.numel() for p in units[0].parameters()) // n) * n
    shard = torch.ones(numel // n, dtype=dtype, device=device)
    full = [torch.empty(numel, dtype=dtype, device=device) for _ in units]
    x = torch.randn(min(64, model.max_seq_len), 1, model.hidden_size, device=device, dtype=dtype, requires_grad=True)  # [s, b, h]

    def gather(i: int, *, async_op: bool):
        return all_gather_single(full[i], shard, group=group, async_op=async_op)

    def timed(mode: str) -> float:
        _micro_step(units, x, gather, mode)  # warm-up
        dist.barrier(group=group)
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            _micro_step(units, x, gather, mode)
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX, group=group)
        return float(elapsed.item())

    modes = ("compute", "forward", "serial", "prefetch")
    samples: dict[str, list[float]] = {m: [] for m in modes}
    for r in range(rounds):
        for mode in modes[r % 2:] + modes[:r % 2]:  # alternate the order so drift lands on all
            samples[mode].append(timed(mode))
    return _overlap_result({m: statistics.median(v) for m, v in samples.items()}, num_units=len(units))


# The sharding probe (measure_sharding): steps of SHARDING_MICRO_BATCHES micro-batches of one sequence of
# SHARDING_SEQ tokens (dispatch-bound, as the layer probe's first point), through a model of PROBE_LAYERS layers.
SHARDING_MICRO_BATCHES = 4
SHARDING_SEQ = 8
SHARDING_ROUNDS = 7


class LocalComm(Comm):
    """runners.comm.Comm whose data-parallel collectives stay on the rank: an all-gather fills the output
    with copies of the shard, a reduce-scatter keeps the input's first chunk, an all-reduce leaves its
    tensor. Everything the engine does around them (its hooks, buffers, copies, this class's counting)
    runs as in training; what the collectives themselves cost is the collective curves' business."""

    @staticmethod
    def _c10d_all_reduce(tensor: torch.Tensor, *, op, group, async_op: bool):
        return None

    @staticmethod
    def _c10d_all_gather(output: torch.Tensor, shard: torch.Tensor, *, group, async_op: bool):
        output.view(-1, shard.numel()).copy_(shard.reshape(1, -1).expand(output.numel() // shard.numel(), -1))
        return None

    @staticmethod
    def _c10d_reduce_scatter(output: torch.Tensor, full: torch.Tensor, *, group, async_op: bool):
        output.copy_(full.view(-1, output.numel())[0].view_as(output))
        return None

    # Context parallelism's exchanges (runners/context_parallel.py): a ring step receives what it sends, an
    # all-to-all returns its input; the attention around them runs as in training.
    def exchange(self, send: torch.Tensor, recv: torch.Tensor, *, dst: int, src: int, group, tag: int = 0) -> list:
        recv.copy_(send)
        return []

    def all_to_all(self, output: torch.Tensor, input: torch.Tensor, group):
        output.copy_(input)


def measure_sharding(model: ModelSpec, *, device: torch.device, repeats: int,
                     rounds: int = SHARDING_ROUNDS) -> dict[str, float]:
    """The sharding engine's own seconds per unit and micro-batch (runners/sharding/): with gradients
    sharded (`grad_unit_s`: each parameter's gradient copied into its bucket's send buffer, the bucket's
    reduce-scatter and shard update) and, on top, with parameters sharded (`param_unit_s`: the gather and
    free around each use, the backward pre-hook's autograd nodes). Every rank trains data-parallel over the
    whole world at once (so the processes share the host's cores as in training) with LocalComm: three
    plans (nothing sharded but the optimizer; gradients too; parameters too), `repeats` steps each,
    interleaved in `rounds` rounds; each plan's fastest round of the slowest rank's mean step; the differences per unit
    (embedding, layers, final norm, head) and micro-batch, floored at 0. On a 2-core host with 2 ranks
    the ZeRO-3 plan's steps ran ~0.9 ms a unit and micro-batch beyond ZeRO-1's, which no collective's
    measured time holds."""
    import dataclasses

    from runners.config import RunConfig
    from runners.train import Trainer
    from specs.job import Job
    from specs.plan import Plan

    world = dist.get_world_size()
    small = dataclasses.replace(model, num_layers=min(PROBE_LAYERS, model.num_layers))
    seq, m = min(SHARDING_SEQ, model.max_seq_len), SHARDING_MICRO_BATCHES
    job = Job(global_batch=world * m, seq_len=seq, precision="fp32" if device.type == "cpu" else "bf16")
    trainers = {}
    for name, shards in (("replicated", (1, 1)), ("grads", (1, world)), ("params", (world, world))):
        plan = Plan(dp=world, micro_batch=1, num_micro_batches=m, param_shard=shards[0], grad_shard=shards[1],
                    optim_shard=world)
        trainers[name] = Trainer(RunConfig(plan=plan, model=small, job=job), device=device,
                                 comm=LocalComm(ranks_per_node=world, device=device))
    g = torch.Generator().manual_seed(0)
    batch = [tuple(torch.randint(0, model.vocab_size, (1, seq), generator=g).to(device) for _ in range(2))
             for _ in range(m)]

    def timed(trainer) -> float:
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            trainer.step(batch)
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    for trainer in trainers.values():
        trainer.step(batch)  # warm-up
    samples: dict[str, list[float]] = {name: [] for name in trainers}
    names = list(trainers)
    for r in range(rounds):
        for name in names[r % 3:] + names[:r % 3]:  # rotate the order so drift lands on all
            samples[name].append(timed(trainers[name]))
    # Host work that other load only slows: each plan's fastest round (its median moved the gradient
    # figure 0.12 -> 0.46 ms between two profiles of one quiet 2-core host; the fastest, 0.07-0.15 in six).
    fastest = {name: min(v) for name, v in samples.items()}
    per = m * len(trainers["params"].engine.units)
    return {"step_s": fastest["replicated"], "units": float(len(trainers["params"].engine.units)),
            "micro_batches": float(m), "grad_unit_s": max(0.0, fastest["grads"] - fastest["replicated"]) / per,
            "param_unit_s": max(0.0, fastest["params"] - fastest["grads"]) / per}


# The context-parallel probe (measure_context): one sequence of CONTEXT_SEQ tokens (at most the model's
# longest, a multiple of 2 x world), CONTEXT_ROUNDS interleaved rounds.
CONTEXT_SEQ = 64
CONTEXT_ROUNDS = 5
CONTEXT_KINDS = {"ring": "ring", "a2a": "all-to-all"}  # probe key -> Plan.cp_kind


def context_probe_sizes(world: int) -> list[int]:
    """The CP group sizes the context probe times on `world` ranks: 2, 4, ... up to world, each dividing it."""
    return [c for c in (2 ** i for i in range(1, world.bit_length())) if world % c == 0]


def _context_groups(world: int, rank: int) -> dict[int, object]:
    """{c: this rank's group} for every size c of `context_probe_sizes`: groups of c consecutive ranks (the
    mesh's CP order without TP); every rank creates every group, in one order."""
    out = {}
    for c in context_probe_sizes(world):
        groups = [dist.new_group(list(range(start, start + c))) for start in range(0, world, c)]
        out[c] = groups[rank // c]
    return out


def _context_cases(model: ModelSpec, groups: dict[int, object], rank: int, comm: Comm) -> dict:
    """{(probe kind, c): CPContext} of this rank over `groups` (`_context_groups`) talking through `comm`:
    the ring at every size, the all-to-all only where c divides the heads and the K/V heads
    (specs/plan.check_context_parallel)."""
    from runners.context_parallel import CPContext

    contexts = {}
    for c, group in groups.items():
        me = rank % c
        ranks = tuple(range(rank - me, rank - me + c))
        contexts[("ring", c)] = CPContext(size=c, rank=me, comm=comm, group=group, ring_group=group, ring_ranks=ranks,
                                          ring_rank=me)
        if model.num_heads % c == 0 and model.num_kv_heads % c == 0:
            contexts[("a2a", c)] = CPContext(size=c, rank=me, comm=comm, group=group, a2a_group=group, a2a_size=c,
                                             a2a_rank=me, ring_ranks=(rank,))
    return contexts


def measure_context(model: ModelSpec, *, device: torch.device, dtype: torch.dtype, repeats: int,
                    rounds: int = CONTEXT_ROUNDS) -> dict[str, float]:
    """What the engine's context-parallel exchanges cost inside its attention (runners/context_parallel.py):
    every rank runs context_attention's forward and backward at once, in CP groups of c consecutive ranks
    for each c of `context_probe_sizes`, ring and all-to-all (`_context_cases`), with the real Comm and with
    LocalComm (no communication), `rounds` interleaved rounds of `repeats` calls each (per round the slowest
    rank's mean). `{kind}{c}_comm_s` is the difference of the two medians, `{kind}{c}_local_s` the local one;
    `seq_len` and `world` say where. The difference holds what the collective curves, timed with every rank
    in the same call, do not: ranks reaching a ring step at different times (4 processes on 2 cores: the peer
    is descheduled), the sends' posting beside the attention's own ops. Measured on this project's 2-core
    host: a cp4 ring's exchange 1.5 ms in the engine against 0.66 ms priced from the ring_step curve."""
    from runners.context_parallel import context_attention

    world, rank = dist.get_world_size(), dist.get_rank()
    seq = min(CONTEXT_SEQ, model.max_seq_len) // (2 * world) * (2 * world)
    if seq == 0:
        return {}
    groups = _context_groups(world, rank)
    if not groups:  # no power of 2 divides the world (3 ranks): no CP group to time
        return {}
    real = _context_cases(model, groups, rank, Comm(ranks_per_node=world, device=device))
    local = _context_cases(model, groups, rank, LocalComm(ranks_per_node=world, device=device))
    g = torch.Generator().manual_seed(rank)

    def inputs(c: int, heads: int) -> torch.Tensor:
        return torch.randn(seq // c, 1, heads, model.head_dim, generator=g).to(device, dtype).requires_grad_()

    def timed(cp, q, k, v, grad) -> float:
        dist.barrier()
        _synchronize(device)
        start = time.perf_counter()
        for _ in range(repeats):
            torch.autograd.grad(context_attention(q, k, v, cp), (q, k, v), grad)
        _synchronize(device)
        elapsed = torch.tensor([(time.perf_counter() - start) / repeats], dtype=torch.float64, device=device)
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
        return float(elapsed.item())

    cases = {}
    for kind, c in real:
        q, k, v = inputs(c, model.num_heads), inputs(c, model.num_kv_heads), inputs(c, model.num_kv_heads)
        cases[f"{kind}{c}"] = (real[kind, c], local[kind, c], (q, k, v, torch.ones_like(q)))
    samples: dict[str, list[float]] = {f"{name}_{mode}": [] for name in cases for mode in ("real", "local")}
    for cp_real, cp_local, tensors in cases.values():  # warm-up
        timed(cp_real, *tensors)
        timed(cp_local, *tensors)
    names = list(cases)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            cp_real, cp_local, tensors = cases[name]
            samples[f"{name}_real"].append(timed(cp_real, *tensors))
            samples[f"{name}_local"].append(timed(cp_local, *tensors))
    med = {key: statistics.median(v) for key, v in samples.items()}
    out = {"seq_len": float(seq), "world": float(world)}
    for name in cases:
        out[f"{name}_local_s"] = med[f"{name}_local"]
        out[f"{name}_comm_s"] = max(0.0, med[f"{name}_real"] - med[f"{name}_local"])
    return out


# The sync-wait probe (measure_sync_wait): segments of compute between two meetings of a group, in wall seconds
# as every rank computing at once gets them (the cost model's layer times on this host are the same), each
# timed loop about SYNC_LOOP_S long, SYNC_ROUNDS interleaved rounds.
SYNC_SEGMENTS_S = (0.5e-3, 2e-3, 8e-3, 32e-3)
# And at the default budgets (share 1) one as long as a long-context layer's pass between two of its all-to-alls
# (cp4 at 4096 tokens on this project's host: 47 ms forward, 108 backward), which the cost model would otherwise
# hold at 32 ms's wait: 4 ranks of the 2-core host waited 2.7-2.9 ms after 32 ms and 5.5-9.0 after 128 (two
# probes). Its loops take ~1 s each (8 segments at least), 20 s of a 4-process profile.
SYNC_LONG_SEGMENT_S = 128e-3
SYNC_LOOP_S = 0.3
SYNC_ROUNDS = 5
SYNC_LATENCY_CALLS = 40


def sync_segments(share: float) -> tuple[float, ...]:
    """The sync-wait probe's segments: SYNC_SEGMENTS_S, and SYNC_LONG_SEGMENT_S at the default budgets."""
    return SYNC_SEGMENTS_S + ((SYNC_LONG_SEGMENT_S,) if share >= 1 else ())


def _spin(calls: int, a: torch.Tensor) -> None:
    """`calls` small matmuls: CPU work of a known length."""
    for _ in range(calls):
        torch.mm(a, a)


def measure_sync_wait(*, device: torch.device, share: float = 1.0) -> dict[str, float]:
    """What a blocking collective waits for its last ranks after a segment of compute (CPU; the cost model's
    cost_models/comm.sync_wait_s): for every group size c of `context_probe_sizes` (every rank in a group of c
    consecutive ranks at once) and segment w of `sync_segments`, loops of w of work each followed by a
    one-element all-reduce in the group, less the same loops without the all-reduce, less the all-reduce called
    back to back, each loop timed as the whole group's wall (`_group_seconds`); `sync{c}_{w in microseconds}_s`,
    the ranks' mean of the median over SYNC_ROUNDS interleaved rounds (never below 0), with `world`; `share`
    (at most 1) of the rounds (at least 3) and of each loop's length asks for a quicker, noisier probe. Each rank's
    compute runs longer or shorter by a little (and on a host with fewer cores than ranks, by the scheduler's
    time slices), so the group waits for its slowest arrival; the collective curves, timed back to back, hold
    none of it. Each loop's own rank-local time would not do for the loop without the all-reduce: its ranks
    drift apart and the first to finish leave their cores to the rest, so the loop read short by the drift,
    which then counted as waiting; so timed (profiler version 7), 4 ranks of this project's 2-core host read
    7-14 ms of waiting after a 32 ms segment, as the group's wall 1-3 ms."""
    world, rank = dist.get_world_size(), dist.get_rank()
    groups = _context_groups(world, rank)
    a, x = torch.randn(48, 48, device=device), torch.zeros(1, device=device)
    dist.barrier()
    start = time.perf_counter()
    _spin(1000, a)
    per_call_s = (time.perf_counter() - start) / 1000  # with every rank working at once

    def loop(calls: int, iterations: int, group) -> float:
        def body() -> None:
            _spin(calls, a)
            if group is not None:
                dist.all_reduce(x, group=group)

        return _group_seconds(body, repeats=iterations, device=device)

    share = min(1.0, share)
    rounds, loop_s = max(3, round(SYNC_ROUNDS * share)), SYNC_LOOP_S * share
    cases = [(c, w) for c in groups for w in sync_segments(share)]
    samples: dict[tuple[int, float], list[float]] = {case: [] for case in cases}
    for r in range(rounds):
        for c, w in cases[r % len(cases):] + cases[:r % len(cases)]:
            calls, iterations = max(1, round(w / per_call_s)), max(8, round(loop_s / w))
            alone = loop(calls, iterations, None)
            met = loop(calls, iterations, groups[c])
            samples[c, w].append(met - alone - loop(0, SYNC_LATENCY_CALLS, groups[c]))
    medians = torch.tensor([statistics.median(samples[case]) for case in cases], dtype=torch.float64, device=device)
    dist.all_reduce(medians)
    out = {"world": float(world)}
    for (c, w), wait in zip(cases, (medians / world).tolist()):
        out[f"sync{c}_{round(w * 1e6)}_s"] = max(0.0, wait)
    return out


def _overlap_result(med: dict[str, float], *, num_units: int) -> dict[str, float]:
    """measure_overlap's figures from the median seconds of each micro-step mode."""
    compute_s, forward_s = med["compute"], min(med["forward"], med["compute"])
    comm_s = max(0.0, med["serial"] - compute_s)
    beside = (num_units - 1) * comm_s / (2 * num_units)  # gathers beside the forward; as many beside the backward
    hideable = min(forward_s, beside) + min(compute_s - forward_s, beside)
    efficiency = (med["serial"] - med["prefetch"]) / max(hideable, 1e-12)
    return {"compute_s": compute_s, "comm_s": comm_s, "both_s": med["prefetch"], "serial_s": med["serial"],
            "forward_s": forward_s, "efficiency": min(1.0, max(-1.0, efficiency))}


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
        emit_event("progress", done=0, total=PROBE_STEPS, label="layer probe")
    points = measure_layer(spec.model, device=device, dtype=dtype, budget_s=spec.budget_s, barrier=dist.barrier)
    times = torch.tensor([[p.forward_s, p.forward_backward_s] for p in points], dtype=torch.float64, device=device)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)
    slowest = tuple(LayerProbePoint(**{**asdict(p), "forward_s": float(f), "forward_backward_s": float(fb)})
                    for p, (f, fb) in zip(points, times.tolist()))
    ring: tuple[RingBlockPoint, ...] = ()
    attention: tuple[AttentionPoint, ...] = ()
    if device.type == "cpu" and (spec.ring_sides or spec.attention_seq_lens):  # GPUs: published efficiencies
        if rank == 0:
            emit_event("progress", done=1, total=PROBE_STEPS, label="attention and ring steps")
        ring, attention = measure_attention_blocks(
            spec.model, device=device, budget_s=spec.budget_s / RING_BUDGET_SHARE, sides=spec.ring_sides,
            seq_lens=spec.attention_seq_lens, head_dims=spec.attention_head_dims, rounds=spec.attention_rounds)
    overlap: dict[str, float] = {}
    sharding: dict[str, float] = {}
    context: dict[str, float] = {}
    sync: dict[str, float] = {}
    if dist.get_world_size() > 1:
        if rank == 0:
            emit_event("progress", done=2, total=PROBE_STEPS, label="overlap probe")
        overlap = measure_overlap(spec.model, device=device, dtype=dtype, group=dist.group.WORLD,
                                  repeats=spec.overlap_repeats)
        # On a GPU the kernel queue hides the host's bookkeeping as it hides per-op dispatch (planner/profiling.py).
        if device.type == "cpu":
            if rank == 0:
                emit_event("progress", done=3, total=PROBE_STEPS, label="sharding probe")
            sharding = measure_sharding(spec.model, device=device, repeats=spec.overlap_repeats)
            if rank == 0:
                emit_event("progress", done=4, total=PROBE_STEPS, label="context-parallel probe")
            context = measure_context(spec.model, device=device, dtype=dtype, repeats=spec.overlap_repeats)
            if rank == 0:
                emit_event("progress", done=5, total=PROBE_STEPS, label="sync-wait probe")
            sync = measure_sync_wait(device=device, share=spec.sync_share)
    dist.destroy_process_group()
    return ProbeResult(points=slowest, overlap=overlap, sharding=sharding, context=context,
                       sync=sync, ring=ring, attention=attention) if rank == 0 else None

if __name__ == "__main__":
    from runners.launch import exit_worker, worker_main

    exit_worker(worker_main(run_task))
