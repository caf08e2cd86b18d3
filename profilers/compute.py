"""Compute micro-benchmarks: GEMM throughput by shape and dtype, and element-wise (norm, activation) rates.

    python -c "from profilers.compute import measure_compute; print(measure_compute(quick=True))"

The GEMM shapes are the forward matmuls of one transformer layer and the LM head of a model preset at a
few token counts (what the cost model prices), plus a square sweep that pins the efficiency curve.
"""

from __future__ import annotations

import logging
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from specs.model import ModelSpec
from profilers.fit import GemmSample

log = logging.getLogger(__name__)

TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# A lower-precision dtype slower than this fraction of fp32 on the same GEMM is emulated in software
# (no native unit): profiling it would take most of the budget and no plan should use it.
MIN_USEFUL_SPEED_VS_FP32 = 0.25


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def repeat_times(fn: Callable[[], object], *, device: torch.device, budget_s: float, min_repeats: int = 3,
                 max_repeats: int = 50) -> list[float]:
    """Seconds of each repeat of `fn` that fits in `budget_s` (at least min_repeats, at most max_repeats),
    after one warm-up call.

    Each repeat is timed alone with a device synchronisation on both sides, so a single kernel's time
    includes its launch overhead, which is what kernel_overhead_s models.
    """
    fn()
    synchronize(device)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < max_repeats and (len(times) < min_repeats or time.perf_counter() < deadline):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return times


def time_op(fn: Callable[[], object], *, device: torch.device, budget_s: float, min_repeats: int = 3,
            max_repeats: int = 50) -> float:
    """Seconds of one call of `fn`: on CPU the median of `repeat_times`; on CUDA the mean of calls issued
    back to back between two CUDA events (`cuda_event_seconds`)."""
    if device.type == "cuda":
        return cuda_event_seconds(fn, budget_s=budget_s, min_repeats=min_repeats, max_repeats=max_repeats)
    return statistics.median(repeat_times(fn, device=device, budget_s=budget_s, min_repeats=min_repeats,
                                          max_repeats=max_repeats))


def cuda_event_seconds(fn: Callable[[], object], *, budget_s: float, min_repeats: int = 3,
                       max_repeats: int = 50) -> float:
    """Mean device seconds per call of `fn`, as many calls as fit in `budget_s` issued back to back and
    timed by two CUDA events, with no synchronisation between calls: the kernels' own throughput, as a
    training step's queue of kernels sees it (a host-side timer around each synchronised call would add
    the launch and synchronisation latency to every call, most of a small GEMM's time)."""
    fn()  # warm-up: cuBLAS picks its algorithm, the allocator its blocks
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    one_s = max(start.elapsed_time(end) / 1e3, 1e-7)
    repeats = int(min(max_repeats, max(min_repeats, budget_s / one_s)))
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / repeats


def layer_gemm_shapes(model: ModelSpec, *, token_counts: tuple[int, ...]) -> list[tuple[str, int, int, int]]:
    """(name, m, n, k) of a layer's forward GEMMs and the LM head: activations (m x k) @ weight (k x n)."""
    h = model.hidden_size
    up_width = model.ffn_hidden_size * (2 if model.gated_mlp else 1)
    shapes = []
    for tokens in token_counts:
        shapes += [(f"qkv@{tokens}", tokens, h + 2 * model.kv_dim, h), (f"attn_out@{tokens}", tokens, h, h),
                   (f"mlp_up@{tokens}", tokens, up_width, h), (f"mlp_down@{tokens}", tokens, h, model.ffn_hidden_size),
                   (f"head@{tokens}", tokens, model.vocab_size, h)]
    return shapes


def square_sweep(*, quick: bool, device: torch.device) -> list[int]:
    """Square GEMM sizes 16 .. top: on CUDA up to the shapes large models run (a 70B layer's GEMMs are
    8192 x 28672 wide at thousands of tokens), where the tensor cores reach their asymptote."""
    top = (8192 if quick else 16384) if device.type == "cuda" else (1024 if quick else 2048)
    dims, d = [], 16
    while d <= top:
        dims.append(d)
        d *= 2
    return dims


def measure_gemm(m: int, n: int, k: int, *, dtype: str, device: torch.device, budget_s: float) -> float:
    a = torch.randn(m, k, dtype=TORCH_DTYPES[dtype], device=device)
    b = torch.randn(k, n, dtype=TORCH_DTYPES[dtype], device=device)
    return time_op(lambda: torch.mm(a, b), device=device, budget_s=budget_s)


def usable_dtypes(device: torch.device, *, budget_s: float) -> tuple[list[str], dict[str, str]]:
    """The dtypes worth profiling on `device`, and why each other one was skipped.

    CUDA: fp32 always; bf16 where torch.cuda.is_bf16_supported(); fp16 always. CPU: fp32, plus bf16/fp16
    only if a 512^3 GEMM in that dtype runs at >= MIN_USEFUL_SPEED_VS_FP32 of fp32 (CPUs without AMX or
    AVX512-BF16 emulate it, tens of times slower).
    """
    skipped: dict[str, str] = {}
    if device.type == "cuda":
        dtypes = ["fp32", "fp16"]
        if torch.cuda.is_bf16_supported():
            dtypes.insert(1, "bf16")
        else:
            skipped["bf16"] = "torch.cuda.is_bf16_supported() is False"
        return dtypes, skipped
    fp32_s = measure_gemm(512, 512, 512, dtype="fp32", device=device, budget_s=budget_s)
    dtypes = ["fp32"]
    for dtype in ("bf16", "fp16"):
        low_s = measure_gemm(512, 512, 512, dtype=dtype, device=device, budget_s=budget_s)
        if fp32_s / low_s >= MIN_USEFUL_SPEED_VS_FP32:
            dtypes.append(dtype)
        else:
            skipped[dtype] = (f"512^3 GEMM runs at {fp32_s / low_s:.2f}x fp32 speed "
                              f"(< {MIN_USEFUL_SPEED_VS_FP32}): emulated, not a native unit")
    return dtypes, skipped


@dataclass
class ComputeResult:
    device_name: str
    num_threads: int
    dtypes: list[str]
    skipped_dtypes: dict[str, str]
    gemms: list[GemmSample] = field(default_factory=list)
    # Element-wise kernels: name -> bytes read + written per second.
    elementwise_bytes_per_s: dict[str, float] = field(default_factory=dict)


def measure_elementwise(*, tokens: int, hidden: int, dtype: str, device: torch.device,
                        budget_s: float) -> dict[str, float]:
    """Bytes (read + written) per second of a layer's norm and activation kernels on a (tokens x hidden) input."""
    x = torch.randn(tokens, hidden, dtype=TORCH_DTYPES[dtype], device=device)
    weight = torch.ones(hidden, dtype=x.dtype, device=device)
    ops: dict[str, Callable[[], object]] = {
        "layer_norm": lambda: torch.nn.functional.layer_norm(x, (hidden,), weight),
        "rms_norm": lambda: torch.nn.functional.rms_norm(x, (hidden,), weight),
        "gelu": lambda: torch.nn.functional.gelu(x),
        "silu": lambda: torch.nn.functional.silu(x),
        "add": lambda: x + x,
    }
    traffic = {"layer_norm": 2, "rms_norm": 2, "gelu": 2, "silu": 2, "add": 3}
    nbytes = x.numel() * x.element_size()
    return {name: traffic[name] * nbytes / time_op(op, device=device, budget_s=budget_s) for name, op in ops.items()}


def measure_compute(*, model: ModelSpec, device: torch.device, quick: bool,
                    progress: Callable[[str], None] = lambda _label: None) -> ComputeResult:
    """GEMMs (layer shapes and a square sweep) in every usable dtype, then element-wise kernels."""
    budget_s = 0.05 if quick else 0.25
    dtypes, skipped = usable_dtypes(device, budget_s=budget_s)
    for dtype, why in skipped.items():
        log.warning("skipping %s GEMMs: %s", dtype, why)
    token_counts = (128, 1024) if quick else (128, 512, 2048, 8192)
    shapes = [(m, n, k) for _, m, n, k in layer_gemm_shapes(model, token_counts=token_counts)]
    shapes += [(d, d, d) for d in square_sweep(quick=quick, device=device)]
    result = ComputeResult(device_name=device_name(device), num_threads=torch.get_num_threads(),
                           dtypes=dtypes, skipped_dtypes=skipped)
    tf32_before = torch.backends.cuda.matmul.allow_tf32
    # fp32 GEMMs as training runs them: on TF32 tensor cores (runners/train.py turns it on).
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        for dtype in dtypes:
            for m, n, k in shapes:
                progress(f"gemm {dtype} {m}x{n}x{k}")
                t = measure_gemm(m, n, k, dtype=dtype, device=device, budget_s=budget_s)
                result.gemms.append(GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32_before
    progress("element-wise kernels")
    result.elementwise_bytes_per_s = measure_elementwise(
        tokens=max(token_counts), hidden=max(model.hidden_size, 1024),
        dtype="bf16" if "bf16" in dtypes else "fp32", device=device, budget_s=budget_s)
    return result


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "cpu"
