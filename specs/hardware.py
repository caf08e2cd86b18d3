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
COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "p2p", "all_to_all")


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
    # Raw curve: message bytes and median seconds, with the spread (p90 - p10) of the repeats.
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
    # The overlap probe (runners/probe.measure_overlap): compute_s, comm_s, both_s, efficiency.
    overlap_probe: dict[str, float] = field(default_factory=dict)
    # Measured training runs the calibration was last fitted to (`planner calibrate`, `planner tune`);
    # 0: only the profile's own probes.
    calibrated_from_runs: int = 0
    # Where a profile's links come from when no collective measured them ("" : measured, or a datasheet
    # preset's own), e.g. "h200 preset" for `planner profile --nproc 1`.
    links_from: str = ""

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
        if self.host_memory_bytes < 0:
            raise ValueError(f"host_memory_bytes must be non-negative, got {self.host_memory_bytes}")

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


def _gpu(name: str, device_name: str, bf16: float, fp32: float, mem: int, mem_bw: float,
         nvlink: float, nic: float) -> Hardware:
    return Hardware(
        name=name, device_type="cuda", device_name=device_name,
        peak_flops_per_s={"bf16": bf16, "fp16": bf16, "fp32": fp32},
        memory_bytes=mem, memory_bandwidth_bytes_per_s=mem_bw,
        host_memory_bytes=2048 * GIB // 8, host_device_bandwidth_bytes_per_s=25 * GB,
        intra_node=LinkSpec(bandwidth_bytes_per_s=nvlink, latency_s=5e-6),
        inter_node=LinkSpec(bandwidth_bytes_per_s=nic, latency_s=1.5e-5),
        gemm_max_efficiency=0.80, gemm_half_dim=96.0, kernel_overhead_s=5e-6)


PRESETS: dict[str, Hardware] = {
    # Datasheet figures: dense bf16 tensor-core FLOP/s; fp32 is TF32 tensor-core throughput, which
    # PyTorch uses for fp32 matmuls when allowed; NVLink is per GPU per direction (600 and 900 GB/s
    # bidirectional); the NIC is one 200 Gb/s HDR (A100) or 400 Gb/s NDR (H100/H200) rail per GPU.
    "a100": _gpu("a100", "NVIDIA A100-SXM4-80GB", 312e12, 156e12, 80 * GIB, 2.039e12, 300 * GB, 25 * GB),
    "h100": _gpu("h100", "NVIDIA H100 80GB HBM3", 989e12, 494e12, 80 * GIB, 3.35e12, 450 * GB, 50 * GB),
    "h200": _gpu("h200", "NVIDIA H200", 989e12, 494e12, 141 * GB, 4.8e12, 450 * GB, 50 * GB),
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
