"""Memory micro-benchmarks: capacity per process, device copy bandwidth, pinned host-device bandwidth.

    python -c "import torch; from profilers.memory import measure_memory; print(measure_memory(device=torch.device('cpu'), local_procs=2, quick=True))"
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import torch

from profilers.compute import time_op


@dataclass(frozen=True)
class MemoryResult:
    memory_bytes: int
    memory_source: str
    memory_bandwidth_bytes_per_s: float
    host_memory_bytes: int
    host_device_bandwidth_bytes_per_s: float


def _cgroup_limit_bytes() -> int | None:
    """The memory limit of this process's cgroup (v2 memory.max, or v1 limit_in_bytes); None if unlimited."""
    candidates = [Path("/sys/fs/cgroup/memory.max"), Path("/sys/fs/cgroup/memory/memory.limit_in_bytes")]
    try:
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, rel = line.split(":", 2)
            rel = rel.lstrip("/")
            if controllers == "":  # v2 unified hierarchy
                candidates.insert(0, Path("/sys/fs/cgroup") / rel / "memory.max")
            elif "memory" in controllers.split(","):
                candidates.insert(0, Path("/sys/fs/cgroup/memory") / rel / "memory.limit_in_bytes")
    except (OSError, ValueError):
        pass
    for path in candidates:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        # cgroup v1 reports "unlimited" as a huge page-aligned number.
        if text != "max" and int(text) < 1 << 60:
            return int(text)
    return None


def _mem_available_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES")


def host_memory_bytes() -> tuple[int, str]:
    """Memory this job may use on the host: min(MemAvailable, cgroup limit), and where it came from."""
    available = _mem_available_bytes()
    limit = _cgroup_limit_bytes()
    if limit is not None and limit < available:
        return limit, "cgroup memory limit"
    return available, "MemAvailable"


def copy_bandwidth_bytes_per_s(*, device: torch.device, nbytes: int, budget_s: float) -> float:
    """Device-to-device copy bandwidth, counting bytes read plus bytes written (as STREAM's copy does)."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).fill_(1.0)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / time_op(lambda: dst.copy_(src), device=device, budget_s=budget_s)


def pinned_h2d_bandwidth_bytes_per_s(*, device: torch.device, nbytes: int, budget_s: float) -> float:
    """Pinned host to device copy bandwidth (the path ZeRO-offload and MAZ3 host caching use)."""
    host = torch.empty(nbytes // 4, dtype=torch.float32).pin_memory()
    dev = torch.empty(nbytes // 4, dtype=torch.float32, device=device)
    return nbytes / time_op(lambda: dev.copy_(host, non_blocking=True), device=device, budget_s=budget_s)


def measure_memory(*, device: torch.device, local_procs: int, quick: bool) -> MemoryResult:
    """Capacity and bandwidths; on CPU the host's memory is divided among the node's `local_procs` processes."""
    budget_s = 0.1 if quick else 0.5
    host_bytes, host_source = host_memory_bytes()
    if device.type == "cuda":
        _free, total = torch.cuda.mem_get_info(device)
        copy_bw = copy_bandwidth_bytes_per_s(device=device, nbytes=1 << 30, budget_s=budget_s)
        h2d_bw = pinned_h2d_bandwidth_bytes_per_s(device=device, nbytes=256 << 20, budget_s=budget_s)
        return MemoryResult(memory_bytes=int(total), memory_source="torch.cuda.mem_get_info total",
                            memory_bandwidth_bytes_per_s=copy_bw, host_memory_bytes=host_bytes // local_procs,
                            host_device_bandwidth_bytes_per_s=h2d_bw)
    # Larger than any last-level cache so the copy measures DRAM, not cache.
    copy_bw = copy_bandwidth_bytes_per_s(device=device, nbytes=(128 if quick else 512) << 20, budget_s=budget_s)
    per_proc = host_bytes // local_procs
    # On CPU the "device" is the host: a host-device copy is a memory copy.
    return MemoryResult(memory_bytes=per_proc, memory_source=f"{host_source} / {local_procs} local processes",
                        memory_bandwidth_bytes_per_s=copy_bw, host_memory_bytes=per_proc,
                        host_device_bandwidth_bytes_per_s=copy_bw)
