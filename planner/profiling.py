"""Profiling for the cost model: measure this node (profilers/) and fit what the engine's layer probe
says about it into the profile's calibration.

    hardware = measure_profile(ProfileOptions(nproc=2, quick=True))

Model of a layer probe point (runners/probe.py; the cost model's, cost_models/estimate.py): with F and
B the layer's forward and backward compute time predicted from the profile's own GEMM and bandwidth fits
(no calibration),

    forward          = c * F       + n * o
    forward+backward = c * (F + B) + (1 + k) * n * o

where n is the ops of one layer forward (`num_ops`), k the backward ops per forward op, o the seconds
each op pays (`op_overhead_s`) and c the factor by which real compute is slower than the sweep predicts
(`compute_time_scale`). Smallest relative squared error over all points (rows divided by the measured
time, as planner/calibrate.py weighs plans), c > 0 and o >= 0 (`fit_overheads`). The points under full and
selective recomputation give torch.utils.checkpoint's own cost per region (`recompute_overhead_s`, the layer;
`selective_recompute_overhead_s`, the attention core): what the layer's forward+backward takes beyond the
plain one's and the recomputed forward's. They differ (its saved-tensor hooks and re-entry scale with the
region: one process, tiny, 3.1 ms a layer, 1.5 a core), so one price for both put the 4-process selective
plan of `planner validate` 50% over its measured time. The overlap probe gives comm_overlap_efficiency,
and on CPU the sharding probe the engine's own seconds per unit and micro-batch with sharded gradients and
parameters (shard_grad_unit_s, shard_param_unit_s: taken as measured, not fitted), and the context-parallel
probe's exchanges beyond what cost_models/context.py prices for them at its shape, per message
(engine_ring_extra_s_{c}, engine_a2a_extra_s_{c} per group size c: `context_message_extras`), and the
sync-wait probe's waits at blocking collectives by segment of compute (sync_wait_s_{c}_{microseconds}:
`sync_wait_keys`).

On CUDA the kernel queue hides per-op dispatch behind the kernels of earlier ops (the probe runs the
shapes training steps run, where kernels set the time), so o stays 0 and only c is fitted: how much
slower the engine's real layer (attention, norms, activations, launch gaps) runs than the GEMM sweep
predicts; the recomputation point and the overlap probe (two or more ranks) are fitted as on CPU.
"""

from __future__ import annotations

import dataclasses
import math
import statistics

from cost_models.comm import SYNC_WAIT_PREFIX, sync_waits_s
from cost_models.compute import FUSED_BACKWARD_RATIO, layer_compute_times
from cost_models.context import MESSAGE_EXTRA_PREFIX, context_comm, messages_per_layer
from cost_models.estimate import BACKWARD_OPS_PER_FORWARD_OP, collective_time_s, num_ops
from profilers.profile import ProfileOptions, Progress, _no_progress, run_profile
from runners.probe import CONTEXT_KINDS
from specs.cluster import make_cluster
from specs.hardware import Hardware, LayerProbePoint, with_calibration
from specs.job import Job
from specs.model import ModelSpec, resolve_model
from specs.plan import Plan


def measure_profile(options: ProfileOptions, *, progress: Progress = _no_progress) -> Hardware:
    """Profile this node (or the emulated cluster) and fit the layer probe into the calibration."""
    hardware = run_profile(options, progress=progress)
    return with_layer_probe(hardware, model=resolve_model(options.model))


def with_layer_probe(hardware: Hardware, *, model: ModelSpec) -> Hardware:
    """Keep the layer and overlap probes' measurements, fit compute_time_scale (and on CPU op_overhead_s)
    and recompute_overhead_s from the layer points, and take comm_overlap_efficiency from the overlap
    probe (runners/probe.py; the module docstring says what differs on CUDA)."""
    points, overlap = list(hardware.layer_probe), dict(hardware.overlap_probe)
    calibration = fit_overheads(model, hardware, points, op_overhead=hardware.device_type == "cpu") if points else {}
    if overlap:
        calibration["comm_overlap_efficiency"] = overlap["efficiency"]
    if hardware.device_type == "cpu":  # measured seconds, as the probe took them
        calibration.update({key: hardware.sharding_probe[probe] for key, probe in SHARDING_KEYS.items()
                            if probe in hardware.sharding_probe})
        calibration.update(sync_wait_keys(hardware.sync_probe))
        calibration.update(context_message_extras(with_calibration(hardware, calibration), model=model))
    return dataclasses.replace(with_calibration(hardware, calibration), probe_calibration=dict(calibration))


# Calibration key (cost_models/estimate.py) <- the sharding probe's figure (runners/probe.measure_sharding).
SHARDING_KEYS = {"shard_grad_unit_s": "grad_unit_s", "shard_param_unit_s": "param_unit_s"}


def sync_wait_keys(probe: dict[str, float]) -> dict[str, float]:
    """The sync-wait probe's figures (runners/probe.measure_sync_wait: sync{c}_{microseconds}_s) as the
    calibration keys cost_models/comm.sync_wait_s reads (sync_wait_s_{c}_{microseconds})."""
    return {SYNC_WAIT_PREFIX + key[len("sync"):-len("_s")]: value for key, value in probe.items()
            if key.startswith("sync") and key.endswith("_s")}


def context_message_extras(hardware: Hardware, *, model: ModelSpec) -> dict[str, float]:
    """engine_{kind}_extra_s_{c} for every kind and group size the context probe timed
    (runners/probe.measure_context): its measured exchanges less cost_models/context.py's price of the same
    attention's (one micro-batch of the probe's sequence, CP groups of c of its world's ranks, the whole
    forward and backward, nothing hidden: the probe's attention is too short to hide a message), priced
    without an earlier profile's extras, per message (`messages_per_layer`)."""
    probe = hardware.context_probe
    if not probe.get("world"):
        return {}
    world, seq, ratio = int(probe["world"]), int(probe["seq_len"]), FUSED_BACKWARD_RATIO
    bare = dataclasses.replace(hardware, calibration={k: v for k, v in hardware.calibration.items()
                                                      if not k.startswith("engine_")})
    cluster = make_cluster(hardware=bare, num_devices=world, devices_per_node=world)
    job = Job(global_batch=world, seq_len=seq, precision="fp32")
    extras = {}
    for kind, cp_kind in CONTEXT_KINDS.items():
        for key in (k for k in probe if k.startswith(kind) and k.endswith("_comm_s")):
            c = int(key[len(kind):-len("_comm_s")])
            plan = Plan(dp=world // c, cp=c, cp_kind=cp_kind, micro_batch=1, num_micro_batches=1)
            ctx = context_comm(plan, cluster, model=model, job=job, core_forward_s=0.0, core_backward_s=0.0,
                               collective_time_s=collective_time_s)
            priced = ctx.a2a_forward_s + ctx.a2a_backward_s + sum(m for m, _ in ctx.ring_forward + ctx.ring_backward)
            if kind == "a2a":  # and what cost_models/estimate.py adds for its last ranks (`_sync_waits`)
                local = probe.get(f"{kind}{c}_local_s", 0.0)
                priced += sum(sync_waits_s(hardware.calibration, group_size=c, syncs=2, forward_s=local / (1 + ratio),
                                           backward_s=local * ratio / (1 + ratio)))
            key_out = MESSAGE_EXTRA_PREFIX.format(kind=kind) + str(c)
            extras[key_out] = (probe[key] - priced) / messages_per_layer(kind, c)
    return extras


_PRECISION_OF_DTYPE = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}


def fit_overheads(model: ModelSpec, hardware: Hardware, points: list[LayerProbePoint], *,
                  op_overhead: bool = True) -> dict[str, float]:
    """{'op_overhead_s', 'compute_time_scale'} fitted to the probe points without recomputation (module
    docstring; `op_overhead` False keeps o = 0, as on CUDA), 'recompute_overhead_s' from a point under
    full recomputation and 'selective_recompute_overhead_s' from one under selective, where there are.

    The predicted compute is not linear in c (each kernel's time is floored at the kernel overhead,
    cost_models/compute.py), so c is searched on a log grid, refined by golden-section search, and for each
    c the best non-negative o is closed form (one-variable least squares)."""
    n = num_ops(model)["layer"]
    k = BACKWARD_OPS_PER_FORWARD_OP
    plain = [p for p in points if p.recompute == "none"]
    # torch.utils.checkpoint's own cost per layer and micro-batch: what a fully recomputed layer's
    # forward+backward takes beyond the plain layer's forward+backward plus its re-run forward.
    by_shape = {(p.micro_batch, p.seq_len): p for p in plain}
    extra = [p.forward_backward_s - by_shape[(p.micro_batch, p.seq_len)].forward_backward_s
             - by_shape[(p.micro_batch, p.seq_len)].forward_s
             for p in points if p.recompute == "full" and (p.micro_batch, p.seq_len) in by_shape]
    selective = [p for p in points if p.recompute == "selective" and (p.micro_batch, p.seq_len) in by_shape]
    points = plain

    def predicted(c: float) -> list[tuple[float, float, float]]:
        """(compute seconds, ops, measured seconds) per equation at compute_time_scale c."""
        hw = dataclasses.replace(hardware, calibration={"compute_time_scale": c})
        rows = []
        for p in points:
            t = layer_compute_times(model, hw, micro_batch=p.micro_batch, seq_len=p.seq_len, tp=1,
                                    sequence_parallel=False, precision=_PRECISION_OF_DTYPE.get(p.dtype, "fp32"))
            rows.append((t.forward_s, n, p.forward_s))
            rows.append((t.forward_s + t.backward_s, (1 + k) * n, p.forward_backward_s))
        return rows

    def solve(c: float) -> tuple[float, float]:
        """(relative squared error, o) at c."""
        rows = predicted(c)
        # minimise sum ((f + ops * o) / m - 1)^2 over o >= 0
        num = sum((ops / m) * (1 - f / m) for f, ops, m in rows)
        den = sum((ops / m) ** 2 for _, ops, m in rows)
        o = max(0.0, num / den) if op_overhead else 0.0
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
    if selective:
        fitted["selective_recompute_overhead_s"] = _core_checkpoint_s(model, hardware, selective, by_shape, fitted)
    return fitted


def _core_checkpoint_s(model: ModelSpec, hardware: Hardware, selective: list[LayerProbePoint], by_shape: dict,
                       fitted: dict[str, float]) -> float:
    """torch.utils.checkpoint's own cost per attention core and micro-batch: what a selectively recomputed
    layer's forward+backward takes beyond the plain layer's and the core's forward, priced at the fitted
    compute scale and op overhead."""
    hw = dataclasses.replace(hardware, calibration={"compute_time_scale": fitted["compute_time_scale"]})

    def core_forward_s(p: LayerProbePoint) -> float:
        t = layer_compute_times(model, hw, micro_batch=p.micro_batch, seq_len=p.seq_len, tp=1,
                                sequence_parallel=False, precision=_PRECISION_OF_DTYPE.get(p.dtype, "fp32"))
        return t.attention_core_forward_s + num_ops(model)["core"] * fitted["op_overhead_s"]

    return max(0.0, statistics.median(
        p.forward_backward_s - by_shape[(p.micro_batch, p.seq_len)].forward_backward_s - core_forward_s(p)
        for p in selective))
