"""Where a model trains: one device type's compute, memory and links, from a datasheet or a profile.

The same type is a datasheet preset (`a100`, `h100`, `h200`, `cpu`) and the file `planner profile`
writes; a measured profile adds the raw points and fitted curves (`gemm_points`, `collectives`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path

from specs.errors import PlannerError
from specs.jsonio import dataclass_from_dict, dataclass_to_dict, read_json_file, write_json_atomic

LINK_CLASSES = ("intra_node", "inter_node")
# ring_step: every rank of the group sends one message to the next and receives one from the previous at once
# (context parallelism's K/V ring); p2p: one message one way (a pipeline boundary).
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all", "ring_step")


@dataclass(frozen=True)
class LinkSpec:
    """A link class: per-device unidirectional bandwidth and the latency of one message."""

    bandwidth_bytes_per_s: float
    latency_s: float

    def __post_init__(self) -> None:
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s}")
        if self.latency_s < 0:
            raise ValueError(f"latency_s must be non-negative, got {self.latency_s}")


@dataclass(frozen=True)
class CollectiveFit:
    """A measured latency-bandwidth fit: time(bytes) = latency_s + bytes / bandwidth_bytes_per_s.

    `bandwidth_bytes_per_s` is the bus bandwidth (NCCL-tests convention: algorithm bandwidth times
    2(n-1)/n for all-reduce, (n-1)/n for all-gather and reduce-scatter), so one fit serves all group
    sizes of a link class; `group_size` records where it was measured.
    """

    collective: str
    link: str
    group_size: int
    latency_s: float
    bandwidth_bytes_per_s: float
    # Raw curve: message bytes and median seconds, with the spread (p90 - p10) of the measured rounds.
    sizes_bytes: tuple[int, ...] = ()
    median_s: tuple[float, ...] = ()
    spread_s: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.collective not in COLLECTIVES:
            raise ValueError(f"collective must be one of {', '.join(COLLECTIVES)}, got {self.collective!r}")
        if self.link not in LINK_CLASSES:
            raise ValueError(f"link must be one of {', '.join(LINK_CLASSES)}, got {self.link!r}")
        if self.bandwidth_bytes_per_s <= 0:
            raise ValueError(f"bandwidth_bytes_per_s must be positive, got {self.bandwidth_bytes_per_s}")


@dataclass(frozen=True)
class GemmPoint:
    """One measured matmul: (m x k) @ (k x n) in `dtype` at `flops_per_s`."""

    m: int
    n: int
    k: int
    dtype: str
    flops_per_s: float


@dataclass(frozen=True)
class AttentionPoint:
    """Causal fused attention (torch's scaled_dot_product_attention, the engine's attention core) timed on
    one device: `num_heads` heads of `head_dim` over `seq_len` tokens, micro-batch 1; forward seconds and
    backward seconds (forward + backward less forward). `concurrent`: timed on every rank of the profile at
    once beside the ring's steps (runners/probe.py, profiler version 9; the group's wall), so the processes
    sharing the host's cores are in the times; False: in one process with the others idle (older profiles)."""

    seq_len: int
    num_heads: int
    head_dim: int
    dtype: str
    forward_s: float
    backward_s: float
    concurrent: bool = False


@dataclass(frozen=True)
class RingBlockPoint:
    """This engine's ring attention steps (runners/context_parallel.ring_forward_step / ring_backward_step) timed in
    fp32 (on CPUs torch's flash kernel per step since profiler version 11, written out before): a rank holding
    `side` tokens of `num_heads` query heads (`num_kv_heads` K/V heads) of `head_dim`, micro-batch 1. `square_*`:
    step 0, the causal side x side block; `half_*`: every other step, side x side / 2 unmasked scores. Seconds per
    call, forward and backward. `concurrent`: timed on every rank of the profile at once (runners/probe.py, profiler
    version 8; the slowest rank's), so the processes sharing the host's cores are in the times; False: in one
    process with the others idle (older profiles)."""

    side: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    square_forward_s: float
    square_backward_s: float
    half_forward_s: float
    half_backward_s: float
    concurrent: bool = False


@dataclass(frozen=True)
class LayerProbePoint:
    """One transformer layer timed on every rank at once (runners/probe.py): the slowest rank's
    mean forward and forward+backward seconds at this micro-batch and sequence length."""

    micro_batch: int
    seq_len: int
    dtype: str
    forward_s: float
    forward_backward_s: float
    recompute: str = "none"  # the layers' recomputation policy ("full": under torch.utils.checkpoint)


@dataclass(frozen=True)
class CalibrationRun:
    """One timed plan a profile's calibration was fitted to, as it ran: the host's speed at the time, which
    `planner validate` compares with the same plan's time now (planner/validate.host_speed)."""

    model: str
    plan: dict  # Plan.to_dict()
    global_batch: int
    seq_len: int
    precision: str
    processes: int
    step_time_s: float  # the measured median step time


@dataclass(frozen=True)
class Hardware:
    """One device type and the links between devices.

    Efficiency model (see cost_models/compute.py): a GEMM runs at
    peak_flops_per_s[dtype] * gemm_max_efficiency * prod over m, n, k of d / (d + gemm_half_dim),
    and each kernel costs at least kernel_overhead_s.
    """

    name: str
    device_type: str  # "cuda" or "cpu"
    device_name: str
    peak_flops_per_s: dict[str, float]
    memory_bytes: int
    memory_bandwidth_bytes_per_s: float
    host_memory_bytes: int
    host_device_bandwidth_bytes_per_s: float
    intra_node: LinkSpec
    inter_node: LinkSpec
    gemm_max_efficiency: float
    gemm_half_dim: float
    kernel_overhead_s: float
    source: str = "datasheet"
    collectives: tuple[CollectiveFit, ...] = ()
    gemm_points: tuple[GemmPoint, ...] = ()
    # Measured element-wise kernels (norm, activation, add): kernel name -> bytes read + written per second.
    elementwise_bytes_per_s: dict[str, float] = field(default_factory=dict)
    # Free parameters fitted by `planner calibrate` (names documented in cost_models/).
    calibration: dict[str, float] = field(default_factory=dict)
    # The layer probe's raw points; on CPU `planner profile` fits op_overhead_s and compute_time_scale
    # from them into `calibration`.
    layer_probe: tuple[LayerProbePoint, ...] = ()
    # The overlap probe (runners/probe.measure_overlap): compute_s, forward_s, comm_s, serial_s, both_s
    # (the prefetched micro-step), efficiency.
    overlap_probe: dict[str, float] = field(default_factory=dict)
    # The sharding probe (runners/probe.measure_sharding; CPU): grad_unit_s and param_unit_s, the sharding
    # engine's own seconds per unit and micro-batch with gradients and with parameters sharded.
    sharding_probe: dict[str, float] = field(default_factory=dict)
    # The context-parallel probe (runners/probe.measure_context; CPU): per CP kind and group size, the
    # seconds of the engine's CP exchanges in one attention forward and backward, and of the attention without.
    context_probe: dict[str, float] = field(default_factory=dict)
    # The sync-wait probe (runners/probe.measure_sync_wait; CPU): per group size and segment of compute, the
    # seconds a blocking collective waits for its last ranks (sync{c}_{microseconds}_s), and the world.
    sync_probe: dict[str, float] = field(default_factory=dict)
    # The calibration keys as the probes measured them (planner/profiling.with_layer_probe), kept apart from
    # the fitted `calibration`: `planner tune`'s fit leans on them where its timed plans say little.
    probe_calibration: dict[str, float] = field(default_factory=dict)
    # Measured training runs the calibration was last fitted to (`planner calibrate`, `planner tune`);
    # 0: only the profile's own probes.
    calibrated_from_runs: int = 0
    # Those runs (CPU hosts: `planner tune`, `planner calibrate --measurements`); empty for --from-runs fits
    # and older profiles.
    calibration_runs: tuple[CalibrationRun, ...] = ()
    # The processes sharing one host a profile was measured with, and that host's cores (planner/machine.py
    # re-measures for another count); 0: not a local measurement (presets, older profiles).
    measured_processes: int = 0
    measured_cores: int = 0
    # What measured a profile (profilers/profile.PROFILER_VERSION; 0: presets and profiles from before the
    # number): planner/machine.py measures a cached profile again when it was taken another way.
    profiler_version: int = 0
    # Measured efficiencies (fraction of the dtype's peak) of kernels that are not plain GEMMs, by name:
    # flash1_forward/backward (FlashAttention-1 class), flash2_forward/backward (FlashAttention-2),
    # flash3_forward/backward (FlashAttention-3 / cuDNN fused attention, Hopper only), fp8_gemm (the largest-GEMM rate in fp8, whose peak is peak_flops_per_s["fp8"]),
    # and head_dim_64_<kernel>: that flash kernel's rate at head dimension 64 over its rate at 128 (the
    # flash entries are for 128; cost_models/compute.flash_head_dim_scale), 1 where absent.
    # Absent: the kernel is priced from `attention_points` where measured (CPU profiles), else as its
    # GEMMs at gemm_max_efficiency.
    kernel_efficiency: dict[str, float] = field(default_factory=dict)
    # CPU profiles: the fused attention kernel timed by sequence length at two head widths
    # (runners/probe.measure_attention_blocks since profiler version 9, profilers/compute.measure_attention
    # before; cost_models/compute.measured_attention_times_s prices from them).
    attention_points: tuple[AttentionPoint, ...] = ()
    # CPU profiles: this engine's context-parallel ring steps timed by local tokens at the profiled model's
    # head width (runners/probe.measure_attention_blocks; cost_models/compute.own_ring_times_s prices the
    # ring from them where the head width matches, else like a fused engine's).
    ring_points: tuple[RingBlockPoint, ...] = ()
    # GPUs: streaming multiprocessors and the output tile (rows, columns) of the library's large-GEMM kernel;
    # a GEMM runs in waves of one tile per SM, so shapes that leave the last wave part-empty or pad their
    # edge tiles lose that share (cost_models/compute.py). 0 SMs: no wave model (CPU).
    num_sms: int = 0
    gemm_tile: tuple[int, ...] = (128, 256)
    # GPUs: the SMs a collective running beside compute holds (NCCL: one CTA per channel, for the
    # collective's whole duration); the compute under it runs on the rest (cost_models/compute.py contended).
    nccl_ctas: int = 0
    # SMs held by a collective running beside the compute being priced: 0 for the device itself,
    # nccl_ctas in its contended view (cost_models/compute.py contended).
    sms_held: int = 0
    # Where a profile's links come from when no collective measured them ("" : measured, or a datasheet
    # preset's own), e.g. "h200 preset" for `planner profile --nproc 1`.
    links_from: str = ""
    # A node's sustained checkpoint write bandwidth (files written and fsynced), measured by `planner
    # profile`; 0: not measured (cost_models/checkpoint.py then assumes its documented default).
    storage_write_bytes_per_s: float = 0.0

    def __post_init__(self) -> None:
        if self.device_type not in ("cuda", "cpu"):
            raise ValueError(f"device_type must be cuda or cpu, got {self.device_type!r}")
        if not self.peak_flops_per_s:
            raise ValueError("peak_flops_per_s needs at least one dtype")
        for dtype, flops in self.peak_flops_per_s.items():
            if not isinstance(flops, (int, float)) or isinstance(flops, bool) or flops <= 0:
                raise ValueError(f"peak_flops_per_s[{dtype!r}] must be a positive number, got {flops!r}")
        if self.memory_bytes <= 0:
            raise ValueError(f"memory_bytes must be positive, got {self.memory_bytes}")
        if not 0 < self.gemm_max_efficiency <= 1:
            raise ValueError(f"gemm_max_efficiency must be in (0, 1], got {self.gemm_max_efficiency}")
        if self.gemm_half_dim < 0:
            raise ValueError(f"gemm_half_dim must be non-negative, got {self.gemm_half_dim}")
        # The cost model divides by these: zero, negative, NaN or infinite values would price nonsense.
        for name in ("memory_bandwidth_bytes_per_s", "host_device_bandwidth_bytes_per_s"):
            value = getattr(self, name)
            if not 0 < value < float("inf"):
                raise ValueError(f"{name} must be a positive finite number, got {value}")
        for name in ("gemm_half_dim", "kernel_overhead_s"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):
                raise ValueError(f"{name} must be a non-negative finite number, got {value}")
        if not 0 <= self.storage_write_bytes_per_s < float("inf"):
            raise ValueError(f"storage_write_bytes_per_s must be a non-negative finite number, got {self.storage_write_bytes_per_s}")
        if self.host_memory_bytes < 0:
            raise ValueError(f"host_memory_bytes must be non-negative, got {self.host_memory_bytes}")
        if self.sms_held < 0 or (self.num_sms and self.sms_held >= self.num_sms):
            raise ValueError(f"sms_held must be non-negative and below num_sms, got {self.sms_held}")
        if self.nccl_ctas < 0 or (self.num_sms and self.nccl_ctas >= self.num_sms):
            raise ValueError(f"nccl_ctas must be non-negative and below num_sms, got {self.nccl_ctas}")
        if self.num_sms < 0:
            raise ValueError(f"num_sms must be non-negative, got {self.num_sms}")
        if len(self.gemm_tile) != 2 or min(self.gemm_tile) <= 0:
            raise ValueError(f"gemm_tile must be two positive sizes, got {self.gemm_tile}")

    def mismatch(self, *, device_type: str, device_name: str | None = None) -> str | None:
        """Why this measured profile does not describe the devices a run uses (another device type or
        model), or None; datasheet presets are hypothetical by design and never mismatch."""
        if self.source != "profile":
            return None
        if self.device_type != device_type:
            return (f"hardware profile was measured on {self.device_type} ({self.device_name}) but the run "
                    f"uses {device_type}; its numbers will not match")
        if device_name is not None and device_name != self.device_name:
            return (f"hardware profile was measured on {self.device_name!r} but the run uses {device_name!r}; "
                    f"re-run `planner profile` there")
        return None

    def link(self, link_class: str) -> LinkSpec:
        return self.intra_node if link_class == "intra_node" else self.inter_node

    def has_kernel(self, name: str) -> bool:
        return name in self.kernel_efficiency

    def peak_flops(self, dtype: str) -> float:
        """Peak dense FLOP/s in `dtype`, falling back to fp32 where the device has no such unit."""
        if dtype in self.peak_flops_per_s:
            return self.peak_flops_per_s[dtype]
        return self.peak_flops_per_s.get("fp32", max(self.peak_flops_per_s.values()))

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, what: str = "hardware") -> "Hardware":
        return dataclass_from_dict(cls, data, what=what)

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_dict())


GB = 1e9
GIB = 1024**3


def _gpu(name: str, device_name: str, *, bf16: float, fp32: float, mem: int, mem_bw: float, nvlink: float, nic: float,
         gemm: float, kernels: dict[str, float], sms: int, tile: tuple[int, int], fp8: float | None = None) -> Hardware:
    peaks = {"bf16": bf16, "fp16": bf16, "fp32": fp32, **({"fp8": fp8} if fp8 else {})}
    return Hardware(
        name=name, device_type="cuda", device_name=device_name, peak_flops_per_s=peaks,
        memory_bytes=mem, memory_bandwidth_bytes_per_s=mem_bw,
        host_memory_bytes=2048 * GIB // 8, host_device_bandwidth_bytes_per_s=25 * GB,
        intra_node=LinkSpec(bandwidth_bytes_per_s=nvlink, latency_s=5e-6),
        inter_node=LinkSpec(bandwidth_bytes_per_s=nic, latency_s=1.5e-5),
        gemm_max_efficiency=gemm, gemm_half_dim=48.0, kernel_overhead_s=5e-6, kernel_efficiency=kernels,
        num_sms=sms, gemm_tile=tile, nccl_ctas=NCCL_CTAS)


# Kernel efficiencies of the GPU presets, each from a published measurement (never from end-to-end runs):
# - gemm_max_efficiency: the sustained bf16 matmul rate over the datasheet peak. Burst: the largest rate a
#   shape sweep finds ("Maximum Achievable Matmul FLOPS", MAMF; S. Bekman, ml-engineering,
#   compute/accelerator/README.md): A100 SXM 271.2 of 312 TFLOP/s, H100 SXM 794.5 of 989, H200 834.
#   Training runs GEMMs back to back at the power limit, where the clocks settle lower: the same source's
#   "Maximum Sustained Matmul FLOPS" (MSMF, the figure it recommends for training) is 755 on H200, 0.905 of
#   its MAMF. Presets: H200 755/989 = 0.763; H100 and A100 their MAMF x 0.905 (the same power-limited
#   behaviour; no MSMF published for them): 0.727 and 0.786. fp8 the same way: H100 1402.6 x 0.905 of
#   1979 (0.641), H200 1453.4 x 0.905 (0.665).
# - Shapes: the wave and tile quantization of cost_models/compute.py over the SM count (A100 108, H100/H200
#   132) and the large-GEMM tile of cuBLAS's kernels (Ampere 256x128, Hopper 128x256), and a K-loop fill of
#   gemm_half_dim.
# - FlashAttention-2 (Dao, 2023, arXiv 2307.08691): 50-73% of the A100's peak forward + backward; its
#   causal head-dim-128 curves level off near 0.62 forward and 0.50 backward; on H100 it reaches about 35%
#   (FlashAttention-3 paper, Shah et al. 2024, arXiv 2407.08608), backward lower.
# - FlashAttention-3 / cuDNN fused attention on H100: up to 740 TFLOP/s forward (75%) non-causal, the
#   causal curve lower (~0.62); backward 1.5-1.75x FlashAttention-2's (~0.47).
# - Links are what NCCL's busbw reaches (nccl-tests reference numbers: 8x A100 NVLink-3 all-reduce
#   230-250 GB/s, 8x H100 NVLink-4 all-gather/reduce-scatter ~370 GB/s, 460-480 all-reduce with NVLS),
#   and one NIC per GPU at ~92% of its line rate (HDR 200 Gb/s: 23 GB/s; NDR 400 Gb/s: 46 GB/s).
# - nccl_ctas: NCCL runs one CTA per channel on an SM of its own for the collective's whole duration
#   (NCCL issue #689: "NCCL CTAs won't share an SM with compute kernels"); an NVLink all-gather beside a GEMM
#   on H100 holds 24 (NVIDIA developer forum, "Compute-Communication Overlap Causes Severe GEMM Performance
#   Degradation because of Tail Effect", 2025: a one-wave 132-block GEMM nearly doubles in time beside it).
#   The compute under a collective runs on the other SMs, its waves re-quantized (cost_models/compute.py).
# - FlashAttention-1 class (flash-attn 1.0.x, and the Triton implementation of it that MPT / llm-foundry ran by
#   default until 2024): forward + backward, causal, head dim 128, at 16k keys, from the flash-attention
#   repository's own benchmark figures: assets/flash2_a100_fwd_bwd_benchmark.png panel d (FlashAttention 83 and
#   FlashAttention Triton 80 TFLOP/s, so 0.261 of the A100's 312; FlashAttention-2 189) and
#   assets/flash2_h100_fwd_bwd_benchmark.png panel d (137 of 989: 0.139; FlashAttention-2 328). Those are rates
#   at 16k keys, so the long-key efficiency is that over the short-key fall-off there (cost_models/compute.py
#   prices a kernel at efficiency x keys / (keys + FLASH_HALF_SEQ)); the fall-off is the shared one (2k keys:
#   68-69 and 108 TFLOP/s in the same figures). Split into forward and backward as the Triton kernel splits
#   them, not as FlashAttention-2 does: FlashAttention-2 "is around 1.3-1.5x faster than FlashAttention in
#   Triton in the forward pass and around 2x faster in the backward pass" (Dao 2023, arXiv 2307.08691, sec.
#   4.1, Figs. 5-6), and the Triton kernel llm-foundry copies (flash_attn/flash_attn_triton.py, whose docstring
#   llmfoundry/models/layers/flash_attn_triton.py keeps) says "Triton forward is generally faster than CUDA
#   forward, while Triton backward is generally slower" (its backward has each program walk the query blocks of
#   one key block and add dQ across programs by atomic adds, or walk every key block of a head in one program;
#   its forward is one streaming pass per query block). OpenAI's Triton kernel shows the same
#   split (triton-lang/triton#1917, A100, causal, head dim 64, 16k: forward 145, backward 84 TFLOP/s, 1.7x).
#   So the forward runs at FlashAttention-2's over FLASH1_FORWARD_GAP (the middle of 1.3-1.5), the backward at
#   its over FLASH1_BACKWARD_GAP, both scaled to the measured forward + backward rate; this matters where the
#   forward runs twice (full recomputation re-runs the attention forward, then the 2.5x backward).
NCCL_CTAS = 24
# A flash kernel's efficiency falls on short key sequences (fewer tiles per head to pipeline):
# FlashAttention-2's A100 curves (Dao 2023, Fig. 4-5) reach about half their long-sequence rate at 512
# keys, i.e. efficiency x s / (s + FLASH_HALF_SEQ) (cost_models/compute.py flash_attention_times_s).
FLASH_HALF_SEQ = 384
FLASH1_MEASURED_KEYS = 16384
FLASH1_FORWARD_GAP = 1.4
FLASH1_BACKWARD_GAP = 2.0


def _with_flash1(kernels: dict[str, float], *, fwd_bwd_efficiency: float) -> dict[str, float]:
    """`kernels` plus flash1_forward/backward: FlashAttention-2's forward rate over FLASH1_FORWARD_GAP and its
    backward rate over FLASH1_BACKWARD_GAP, scaled together so that forward + backward (1 + 2.5 passes) runs
    at `fwd_bwd_efficiency` of peak at FLASH1_MEASURED_KEYS keys (the comment above)."""
    forward = kernels["flash2_forward"] / FLASH1_FORWARD_GAP
    backward = kernels["flash2_backward"] / FLASH1_BACKWARD_GAP
    combined = 3.5 / (1 / forward + 2.5 / backward)
    fall_off = FLASH1_MEASURED_KEYS / (FLASH1_MEASURED_KEYS + FLASH_HALF_SEQ)
    scale = fwd_bwd_efficiency / (combined * fall_off)
    return {**kernels, "flash1_forward": forward * scale, "flash1_backward": backward * scale}


# - Head dimension (the same two figures, causal, at 16k keys; the flash entries above are head dim 128): at
#   head dim 64 FlashAttention-1 runs faster, FlashAttention-2 slower, on both GPUs. A100 panels c/d:
#   FlashAttention 97 against 83 TFLOP/s, FlashAttention-2 171 against 189; H100: 156 against 137 and 284
#   against 328. (The A100 figure's "FlashAttention Triton" bars are triton.ops.flash_attention, OpenAI's
#   tutorial kernel, per the repository's benchmarks/benchmark_flash_attention.py, not the
#   flash_attn_triton.py that MPT vendored, which its docstring puts "slightly slower than CUDA forward +
#   backward": the CUDA FlashAttention bars carry the head-dim dependence.)
_AMPERE = {**_with_flash1({"flash2_forward": 0.62, "flash2_backward": 0.50}, fwd_bwd_efficiency=0.261),
           "head_dim_64_flash1": 97 / 83, "head_dim_64_flash2": 171 / 189}
# - The Hopper fused kernel (flash3: cuDNN's, which Transformer Engine runs on Hopper, and the only fused one it
#   runs for attention sinks) at head dim 64: FlashAttention-3 paper (Shah et al. 2024, arXiv 2407.08608), Fig. 5,
#   forward FP16, causal, 16k: cuDNN 388 TFLOP/s at head dim 64 against 539 at 128 (FlashAttention-3 473 and 616).
_HOPPER = {**_with_flash1({"flash2_forward": 0.35, "flash2_backward": 0.30, "flash3_forward": 0.62,
                           "flash3_backward": 0.47}, fwd_bwd_efficiency=0.139),
           "head_dim_64_flash1": 156 / 137, "head_dim_64_flash2": 284 / 328, "head_dim_64_flash3": 388 / 539}


PRESETS: dict[str, Hardware] = {
    # Datasheet figures: dense bf16 (and fp8) tensor-core FLOP/s; fp32 is TF32 tensor-core throughput,
    # which PyTorch uses for fp32 matmuls when allowed; memory bandwidth of the HBM.
    "a100": _gpu("a100", "NVIDIA A100-SXM4-80GB", bf16=312e12, fp32=156e12, mem=80 * GIB, mem_bw=2.039e12,
                 nvlink=235 * GB, nic=23 * GB, gemm=0.786, kernels=_AMPERE, sms=108, tile=(256, 128)),
    "a100-40gb": _gpu("a100-40gb", "NVIDIA A100-SXM4-40GB", bf16=312e12, fp32=156e12, mem=40 * GIB, mem_bw=1.555e12,
                      nvlink=235 * GB, nic=23 * GB, gemm=0.786, kernels=_AMPERE, sms=108, tile=(256, 128)),
    "h100": _gpu("h100", "NVIDIA H100 80GB HBM3", bf16=989e12, fp32=494e12, fp8=1979e12, mem=80 * GIB, mem_bw=3.35e12,
                 nvlink=370 * GB, nic=46 * GB, gemm=0.727, kernels={**_HOPPER, "fp8_gemm": 0.641},
                 sms=132, tile=(128, 256)),
    "h200": _gpu("h200", "NVIDIA H200", bf16=989e12, fp32=494e12, fp8=1979e12, mem=141 * GB, mem_bw=4.8e12,
                 nvlink=370 * GB, nic=46 * GB, gemm=0.763, kernels={**_HOPPER, "fp8_gemm": 0.665},
                 sms=132, tile=(128, 256)),
    # The local runner: one process per core, gloo over loopback. Rough figures; `planner profile`
    # replaces them with measured ones.
    "cpu": Hardware(
        name="cpu", device_type="cpu", device_name="cpu", peak_flops_per_s={"fp32": 5e10},
        memory_bytes=8 * GIB, memory_bandwidth_bytes_per_s=1e10, host_memory_bytes=8 * GIB,
        host_device_bandwidth_bytes_per_s=1e10,
        intra_node=LinkSpec(bandwidth_bytes_per_s=1e9, latency_s=5e-5),
        inter_node=LinkSpec(bandwidth_bytes_per_s=1.25e8, latency_s=1e-3),
        gemm_max_efficiency=0.7, gemm_half_dim=16.0, kernel_overhead_s=1e-5),
}


def preset_for_device(device_name: str) -> Hardware | None:
    """The GPU preset whose name appears in a CUDA device's name ('NVIDIA H200' -> h200), or None."""
    for preset in PRESETS.values():
        if preset.device_type == "cuda" and preset.name.lower() in device_name.lower():
            return preset
    return None


def resolve_hardware(name_or_path: str) -> Hardware:
    """A datasheet preset by name or a profile JSON written by `planner profile`."""
    from specs.model import suggest

    if name_or_path in PRESETS:
        return PRESETS[name_or_path]
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        return Hardware.from_dict(read_json_file(path, what="hardware profile"), what=f"hardware profile {path}")
    raise PlannerError(f"unknown hardware {name_or_path!r}{suggest(name_or_path, list(PRESETS))}; "
                       f"presets: {', '.join(PRESETS)}, or a profile .json")


def with_calibration(hw: Hardware, calibration: dict[str, float]) -> Hardware:
    return dataclasses.replace(hw, calibration={**hw.calibration, **calibration})
