"""`planner profile`: measure this node (or an emulated cluster) and write a Hardware profile JSON.

    planner profile --nproc 2 --quick --out profile.json
    planner profile --nproc 1 --model llama3.2-1b --out gpu.json   # one GPU: links from its preset
    planner profile --cluster --quick --out profile.json      # on `planner cluster up`

Compute and memory are measured in this process (with the cores and memory one of the run's processes
gets); collectives by the profilers.comm worker and the engine's own layer by runners.probe, both
launched on every rank through runners.launch (locally, or in each namespace of the emulated cluster),
then fitted (profilers.fit) into the Hardware type the presets use. The layer probe's points are kept
raw; what they mean for the cost model is fitted by the application (planner/profiling.py).

With one process (`--nproc 1`, e.g. a one-GPU machine) no collective can be measured: compute, memory,
host-device copies and the layer probe are, and the links come from the datasheet preset of the device
(its GPU's by name, else h100; cpu on CPU), which the profile records in `links_from` and the log says.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Protocol

import torch

from profilers.comm import CommSpec, plan_groups
from profilers.compute import ComputeResult, measure_compute
from profilers.fit import GemmFit, bus_factor, fit_gemm, fit_latency_bandwidth
from profilers.memory import MemoryResult, measure_memory
from runners.launch import RunFailed, Where, num_cores, run_workers, steady_allocator
from specs.errors import PlannerError
from specs.hardware import (COLLECTIVES, NCCL_CTAS, PRESETS, AttentionPoint, CollectiveFit, GemmPoint, Hardware,
                            LayerProbePoint, LinkSpec, RingBlockPoint, preset_for_device)
from specs.model import ModelSpec, resolve_model

log = logging.getLogger(__name__)

KIB, MIB = 1024, 1024**2
# 1: collectives timed as a step calls them (after compute, not after a barrier) and the ring-step curve
# (profilers/comm.py); 2: the engine's ring attention steps timed (Hardware.ring_points); 3: the layer probe's
# point under selective recomputation (runners/probe.py); 4: the sharding probe (runners/probe.measure_sharding);
# 5: the context-parallel probe (runners/probe.measure_context); 6: its extras named engine_*_extra_s_* (5's cp_*
# keys would no longer be read); 7: the sync-wait probe (runners/probe.measure_sync_wait); 8: the ring steps
# timed on every rank at once in the probe worker (RingBlockPoint.concurrent), they and the sync-wait loops as
# the group's wall (runners/probe._group_seconds); 9: the fused attention's points timed in the same rounds
# as the ring's steps, every rank at once (AttentionPoint.concurrent; runners/probe.measure_attention_blocks);
# 10: every worker, and the profile's own sweeps, keep the memory they free (runners/launch.steady_allocator:
# the ring's steps ran 25-40% faster, and no longer by what the process had freed before); 11: the ring's steps
# run torch's CPU flash kernel (runners/context_parallel._fused_blocks), so the timed ring points changed; 12: the
# attention probe's windows lose their own cost (runners/probe._window_overhead_s), and the quick profile times
# the fused attention at the model's length up to 4096 tokens (attention_seq_lens), and at the default budgets the
# sync-wait probe times a 128-ms segment (runners/probe.sync_segments).
# A cached profile of another version is measured again (planner/machine.stale_reason).
PROFILER_VERSION = 12
# Tokens a ring rank holds (its two chunks), where the probe times the ring's steps
# (runners/probe.measure_attention_blocks): a tiny model's cp4 at 64 tokens holds 16, benchmarks/context_parallel.py's
# cp4 at 4096 holds 1024. Per score the steps cost much more at the small sides (a step launches ~20 kernels)
# and less at the large, where the scores outgrow the caches; cost_models/compute.measured_ring_times_s reads
# time over scores in log-log between the sides.
RING_SIDES = (16, 64, 256, 1024)
RING_SIDES_FULL = (16, 64, 256, 1024, 2048)
# Causal fused attention on CPUs, by key length, timed beside the ring's steps (the same rounds): the GEMM
# sweep says nothing about it (the kernel tiles the scores, and its softmax, masking and the backward's
# recomputation run at their own rate, which falls as the score blocks outgrow the caches), and a long-context
# step spends most of its time there. Measured at the model's head width and at ATTENTION_WIDE_HEAD_DIM, since
# the per-score cost is a fixed part (softmax, masking) plus a part per head dimension (the two GEMMs):
# cost_models/compute.py interpolates between the two widths and over the logarithm of the sequence.
ATTENTION_SEQ_LENS = (64, 256, 1024, 2048)
ATTENTION_SEQ_LENS_FULL = (64, 256, 1024, 2048, 4096)
ATTENTION_WIDE_HEAD_DIM = 64


def attention_seq_lens(model: ModelSpec, *, quick: bool) -> tuple[int, ...]:
    """The lengths the attention probe times: the full ladder, or the quick one with the full ladder's longer
    points up to the model's maximum length. Past the longest point the price extrapolates (a + b / s through
    the last two, cost_models/compute._per_score_s), and a long-context plan runs its attention there: 4 ranks
    of a 2-core host timed 4 heads of 32 at 4096 tokens 3-4% under the extrapolation from 1024 and 2048 (8%
    for the backward at 64 wide), and two points' noise moves the extrapolation twice as far as either."""
    if not quick:
        return ATTENTION_SEQ_LENS_FULL
    longer = tuple(s for s in ATTENTION_SEQ_LENS_FULL if ATTENTION_SEQ_LENS[-1] < s <= model.max_seq_len)
    return ATTENTION_SEQ_LENS + longer


def attention_head_dims(model: ModelSpec) -> tuple[int, ...]:
    d = model.head_dim
    return (d, 2 * d) if d == ATTENTION_WIDE_HEAD_DIM else tuple(sorted({d, ATTENTION_WIDE_HEAD_DIM}))


FULL_SIZES_BYTES = tuple(KIB * 4**i for i in range(10))  # 1 KiB .. 256 MiB
QUICK_SIZES_BYTES = tuple(KIB * 4**i for i in range(8))  # 1 KiB .. 16 MiB


class Progress(Protocol):
    def __call__(self, stage: str, done: int, total: int | None, label: str) -> None: ...


def _no_progress(stage: str, done: int, total: int | None, label: str) -> None:
    pass


@dataclass(frozen=True)
class ProfileOptions:
    nproc: int = 2
    # Ranks per emulated node when all processes run on one real node (None: one node).
    ranks_per_node: int | None = None
    quick: bool = False
    model: str = "tiny"
    sizes_bytes: tuple[int, ...] | None = None
    collectives: tuple[str, ...] = COLLECTIVES
    # Name prefix of an emulated cluster (runners.netns_cluster) to run the collectives on, or None.
    cluster_prefix: str | None = None
    comm_timeout_s: float = 300.0
    # Seconds the layer probe spends on each of its points (shape x forward / forward+backward); None:
    # 1.5 with quick, else 4. Shorter is noisier: for a first look or a test, not for the profile calibrated on.
    probe_seconds: float | None = None

    def __post_init__(self) -> None:
        if self.nproc < 1:
            raise PlannerError(f"--nproc must be at least 1, got {self.nproc}")
        if self.probe_seconds is not None and not self.probe_seconds > 0:
            raise PlannerError(f"--probe-seconds must be above 0, got {self.probe_seconds}")
        unknown = [c for c in self.collectives if c not in COLLECTIVES]
        if unknown:
            raise PlannerError(f"unknown collective {unknown[0]!r}; choose from {', '.join(COLLECTIVES)}")
        if self.sizes_bytes is not None and (len(self.sizes_bytes) < 2 or min(self.sizes_bytes) < 1):
            raise PlannerError("--sizes needs at least two positive message sizes to fit latency and bandwidth")


# --- collectives and the layer probe ----------------------------------------------------------------
def parse_sizes(text: str) -> tuple[int, ...]:
    """'1k,64k,1m' (binary units k/m/g, or plain bytes) to message sizes in bytes."""
    units = {"": 1, "b": 1, "k": KIB, "kb": KIB, "m": MIB, "mb": MIB, "g": 1024**3, "gb": 1024**3}
    sizes = []
    for item in text.split(","):
        number = item.strip().lower()
        head = number.rstrip("kmgb")
        unit = number[len(head):]
        if not head or unit not in units:
            raise PlannerError(f"bad message size {item.strip()!r} in --sizes: use e.g. 1k,64k,1m")
        try:
            sizes.append(int(float(head) * units[unit]))
        except ValueError:
            raise PlannerError(f"bad message size {item.strip()!r} in --sizes: use e.g. 1k,64k,1m") from None
    return tuple(sizes)


def _where(options: ProfileOptions) -> Where:
    return Where(nproc=options.nproc, cluster=options.cluster_prefix)


def _topology(options: ProfileOptions) -> tuple[int, int]:
    """(world size, ranks per node) of the collective run."""
    if options.cluster_prefix is not None:
        return _where(options).topology()
    per_node = options.ranks_per_node or options.nproc
    if per_node < 1 or options.nproc % per_node:
        raise PlannerError(f"--nproc {options.nproc} is not a multiple of --gpus-per-node {per_node}")
    return options.nproc, per_node


def run_collectives(options: ProfileOptions, *, progress: Progress = _no_progress) -> list[dict]:
    """Run the collective benchmark (profilers.comm) on all ranks; rank 0's curves. A failed rank raises
    runners.launch.RunFailed naming it."""
    world_size, ranks_per_node = _topology(options)
    sizes = options.sizes_bytes or (QUICK_SIZES_BYTES if options.quick else FULL_SIZES_BYTES)
    spec = CommSpec(sizes_bytes=tuple(sizes), collectives=tuple(options.collectives),
                    groups=tuple(plan_groups(world_size=world_size, ranks_per_node=ranks_per_node, quick=options.quick)),
                    budget_s_per_point=0.1 if options.quick else 0.5, max_repeats=20 if options.quick else 50,
                    timeout_s=options.comm_timeout_s)

    def on_event(event: dict) -> None:
        if event.get("kind") == "progress":
            progress("collectives", event["done"], event["total"], event["label"])

    return run_workers("profilers.comm", spec.to_dict(), where=_where(options), on_event=on_event)["curves"]


def measures_collectives(options: ProfileOptions) -> bool:
    """A collective needs two ranks: not with one local process."""
    return options.cluster_prefix is not None or options.nproc > 1


# A probe rank aborting (SIGABRT, gloo's "terminate called without an active exception") was seen twice in
# about 30 profile runs on a 2-core host since the overlap probe issues ~500 asynchronous all-gathers; its
# cause is not found. A probe is a measurement with no state to lose, so an abort is measured again once.
PROBE_ATTEMPTS = 2


def budget_share(budget_s: float) -> float:
    """How much of its default length a probe runs at this --probe-seconds: 1 at the default budgets (1.5 s a
    point and more), less for a shorter one (0.2 at 0.3 s), which asks for a quicker, noisier probe. The sync-wait
    probe takes it as is (its loops' length and its rounds, runners/probe.measure_sync_wait: at 0.3 s its full
    length took 18 of a 2-process quick profile's 52 s)."""
    return min(1.0, budget_s / 1.5)


def overlap_repeats(budget_s: float) -> int:
    """The overlap probe's micro-steps per mode and round: 12 at the default budgets, fewer for a shorter
    --probe-seconds (3 at 0.3 s): `budget_share`."""
    return max(3, round(12 * budget_share(budget_s)))


# The attention probe's interleaved rounds (runners/probe.measure_attention_blocks) at the default budgets: its
# longest calls (a 1024-token ring block, 0.3-0.4 s on 4 ranks of a 2-core host) fit once a round, and over 3
# rounds the median of one such call moved 28% between two profiles minutes apart (305 and 390 ms) while the
# ring's measured step moved 1%.
ATTENTION_ROUNDS = 7


def attention_rounds(budget_s: float) -> int:
    """The attention probe's rounds: ATTENTION_ROUNDS at the default budgets, fewer for a shorter --probe-seconds
    (3 at 0.3 s): `budget_share`."""
    return max(3, round(ATTENTION_ROUNDS * budget_share(budget_s)))


def run_layer_probe(options: ProfileOptions, *, progress: Progress = _no_progress) -> dict:
    """The engine's layer, ring-step, overlap, sharding, context-parallel and sync-wait probes (runners.probe)
    on every rank at once: the Hardware fields they fill (layer_probe, ring_points, overlap_probe,
    sharding_probe, context_probe, sync_probe)."""
    model = resolve_model(options.model)
    budget_s = options.probe_seconds or (1.5 if options.quick else 4.0)
    spec = {"model": model.to_dict(), "budget_s": budget_s, "timeout_s": options.comm_timeout_s,
            "overlap_repeats": overlap_repeats(budget_s),
            "ring_sides": list(RING_SIDES if options.quick else RING_SIDES_FULL),
            "attention_rounds": attention_rounds(budget_s), "sync_share": budget_share(budget_s),
            "attention_seq_lens": list(attention_seq_lens(model, quick=options.quick)),
            "attention_head_dims": list(attention_head_dims(model))}

    def on_event(event: dict) -> None:
        if event.get("kind") == "progress":
            progress("layer probe", event["done"], event["total"], event["label"])

    for attempt in range(PROBE_ATTEMPTS):
        try:
            result = run_workers("runners.probe", spec, where=_where(options), on_event=on_event)
            break
        except RunFailed as exc:
            if "killed by signal 6" not in str(exc) or attempt == PROBE_ATTEMPTS - 1:
                raise
            log.warning("the layer probe failed (%s); measuring it again", exc)
    return {"layer_probe": tuple(LayerProbePoint(**p) for p in result["points"]),
            "ring_points": tuple(RingBlockPoint(**p) for p in result.get("ring") or ()),
            "attention_points": tuple(AttentionPoint(**p) for p in result.get("attention") or ()),
            "overlap_probe": dict(result.get("overlap") or {}), "sharding_probe": dict(result.get("sharding") or {}),
            "context_probe": dict(result.get("context") or {}), "sync_probe": dict(result.get("sync") or {})}


def fit_collectives(curves: list[dict]) -> list[CollectiveFit]:
    """One latency-bandwidth fit per measured curve, in bus bytes (profilers.fit.bus_factor); a curve
    that does not grow with size is dropped with a warning."""
    fits = []
    for curve in curves:
        if len(curve["sizes_bytes"]) < 2:
            continue
        factor = bus_factor(curve["collective"], curve["group_size"])
        try:
            fit = fit_latency_bandwidth([s * factor for s in curve["sizes_bytes"]], curve["median_s"])
        except PlannerError as exc:
            # One noisy curve (an oversubscribed host) must not discard the rest of the profile.
            log.warning("dropped %s over %s (group %d): %s; raw times %s", curve["collective"], curve["link"],
                        curve["group_size"], exc, ", ".join(f"{t * 1e6:.0f} us" for t in curve["median_s"]))
            continue
        fits.append(CollectiveFit(collective=curve["collective"], link=curve["link"], group_size=curve["group_size"],
                                  latency_s=fit.latency_s, bandwidth_bytes_per_s=fit.bandwidth_bytes_per_s,
                                  sizes_bytes=tuple(curve["sizes_bytes"]), median_s=tuple(curve["median_s"]),
                                  spread_s=tuple(curve["spread_s"])))
    return fits


def link_from_fits(fits: list[CollectiveFit], link: str) -> LinkSpec | None:
    """A link class's per-device bandwidth and latency: its 2-rank point-to-point fit (the bare link),
    else the all-reduce of its smallest group, else any collective of its smallest group."""
    own = sorted((f for f in fits if f.link == link), key=lambda f: f.group_size)
    if not own:
        return None
    for pick in ([f for f in own if f.collective == "p2p"], [f for f in own if f.collective == "all_reduce"], own):
        if pick:
            return LinkSpec(bandwidth_bytes_per_s=pick[0].bandwidth_bytes_per_s, latency_s=pick[0].latency_s)
    return None


# --- compute and memory -----------------------------------------------------------------------------
def _datasheet_peak(device: torch.device, device_name: str) -> dict[str, float] | None:
    """Datasheet peaks when the GPU is one of the presets (then efficiency is measured against them)."""
    if device.type != "cuda":
        return None
    preset = preset_for_device(device_name)
    return dict(preset.peak_flops_per_s) if preset is not None else None


def base_preset(device: torch.device, device_name: str) -> Hardware:
    """The preset whose links a profile keeps where it measured none: the GPU's own, else h100; cpu."""
    if device.type == "cpu":
        return PRESETS["cpu"]
    return preset_for_device(device_name) or PRESETS["h100"]


def efficiency_fields(fit: GemmFit, *, datasheet_peak: dict[str, float] | None) -> tuple[dict[str, float], float]:
    """(peak_flops_per_s, gemm_max_efficiency) from the fitted asymptotes.

    The model only sees peak x efficiency. With a datasheet peak, efficiency = asymptote / peak of the
    fastest dtype (capped at 1) and other dtypes' peaks follow from it; without one (CPUs), the
    asymptote is the peak and efficiency is 1.
    """
    asym = fit.asymptote_flops_per_s
    if datasheet_peak:
        ref = max((d for d in asym if d in datasheet_peak), key=lambda d: asym[d], default=None)
        if ref is not None:
            efficiency = min(1.0, asym[ref] / datasheet_peak[ref])
            return {d: (datasheet_peak[d] if d == ref else a / efficiency) for d, a in asym.items()}, efficiency
    return dict(asym), 1.0


def build_hardware(*, device: torch.device, compute: ComputeResult, memory: MemoryResult,
                   fits: list[CollectiveFit], base: Hardware, processes: int = 0) -> Hardware:
    """The Hardware profile; a link class no group crossed keeps `base`'s value (with a warning)."""
    gemm_fit = fit_gemm(compute.gemms)
    peaks, efficiency = efficiency_fields(gemm_fit, datasheet_peak=_datasheet_peak(device, compute.device_name))
    links, kept = {}, []
    for link in ("intra_node", "inter_node"):
        spec = link_from_fits(fits, link)
        if spec is None:
            log.warning("%s link not measured (%s); keeping the %s preset's value", link,
                        "no group crossed it" if fits else "one process: no collective measured", base.name)
            kept.append(link)
        links[link] = spec or base.link(link)
    return Hardware(
        name=f"profile-{device.type}", device_type=device.type, device_name=compute.device_name,
        peak_flops_per_s=peaks, memory_bytes=memory.memory_bytes,
        memory_bandwidth_bytes_per_s=memory.memory_bandwidth_bytes_per_s, host_memory_bytes=memory.host_memory_bytes,
        host_device_bandwidth_bytes_per_s=memory.host_device_bandwidth_bytes_per_s,
        intra_node=links["intra_node"], inter_node=links["inter_node"], gemm_max_efficiency=efficiency,
        gemm_half_dim=gemm_fit.gemm_half_dim, kernel_overhead_s=gemm_fit.kernel_overhead_s, source="profile",
        collectives=tuple(fits),
        gemm_points=tuple(GemmPoint(m=g.m, n=g.n, k=g.k, dtype=g.dtype, flops_per_s=g.flops / g.time_s)
                          for g in compute.gemms),
        elementwise_bytes_per_s=compute.elementwise_bytes_per_s,
        links_from=f"{base.name} preset ({', '.join(kept)})" if kept else "",
        # The wave model (cost_models/compute.py) needs the SM count; the device reports it, and the
        # tile and NCCL's CTAs are the library's choices the preset records for this GPU family.
        num_sms=_num_sms(device) or base.num_sms, gemm_tile=base.gemm_tile,
        nccl_ctas=(base.nccl_ctas or NCCL_CTAS) if device.type == "cuda" else 0,
        measured_processes=processes, measured_cores=num_cores(), profiler_version=PROFILER_VERSION)


def _num_sms(device: torch.device) -> int:
    """The streaming multiprocessors of a CUDA device; 0 elsewhere."""
    if device.type != "cuda":
        return 0
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def run_profile(options: ProfileOptions, *, progress: Progress = _no_progress) -> Hardware:
    """Measure collectives, the engine's layer, compute and memory; the Hardware profile with the layer
    probe's raw points (planner/profiling.py fits what they mean for the cost model)."""
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    world_size, _ranks_per_node = _topology(options)
    model = resolve_model(options.model)
    # Collectives first: the multi-process part is what fails (a rank, the network), so fail fast.
    curves = run_collectives(options, progress=progress) if measures_collectives(options) else []
    if not curves:
        log.warning("one process: collectives are not measured; the links come from the device's preset")
    probes = run_layer_probe(options, progress=progress)
    # Every rank runs on this host (locally, or in the emulated cluster's namespaces), so a training
    # process gets 1/world_size of its cores and memory; measure with exactly that share.
    host_procs = world_size
    threads_before = torch.get_num_threads()
    if device.type == "cpu":
        torch.set_num_threads(max(1, num_cores() // host_procs))
        steady_allocator()  # the sweeps allocate as a worker does (runners/launch.py); kept for this process
    try:
        steps = iter(range(1, 1 << 30))
        compute = measure_compute(model=model, device=device, quick=options.quick,
                                  progress=lambda label: progress("compute", next(steps), None, label))
        progress("memory", 0, None, "copy bandwidth")
        memory = measure_memory(device=device, local_procs=host_procs, quick=options.quick)
    finally:
        torch.set_num_threads(threads_before)
    base = base_preset(device, compute.device_name)
    # Per host: processes on this host (all of them locally; on the emulated cluster they share it too).
    hardware = build_hardware(device=device, compute=compute, memory=memory, fits=fit_collectives(curves), base=base,
                              processes=host_procs)
    from profilers.storage import measure_storage_write

    progress("memory", 0, None, "checkpoint write bandwidth")
    return dataclasses.replace(hardware, **probes, storage_write_bytes_per_s=measure_storage_write(quick=options.quick))


def summary(hardware: Hardware) -> dict:
    """The headline numbers of a profile, for the CLI table and the benchmark."""
    return {
        "device": hardware.device_name,
        "peak_flops_per_s": hardware.peak_flops_per_s,
        "gemm_max_efficiency": hardware.gemm_max_efficiency, "gemm_half_dim": hardware.gemm_half_dim,
        "kernel_overhead_s": hardware.kernel_overhead_s, "memory_bytes": hardware.memory_bytes,
        "memory_bandwidth_bytes_per_s": hardware.memory_bandwidth_bytes_per_s,
        "intra_node": dataclasses.asdict(hardware.intra_node), "inter_node": dataclasses.asdict(hardware.inter_node),
        "links_from": hardware.links_from or "measured",
        "storage_write_bytes_per_s": hardware.storage_write_bytes_per_s,
        "collectives": [{"collective": f.collective, "link": f.link, "group_size": f.group_size,
                         "latency_s": f.latency_s, "bus_bandwidth_bytes_per_s": f.bandwidth_bytes_per_s}
                        for f in hardware.collectives],
    }
