"""Fits that turn measured curves into the cost model's few numbers: pure numpy, no torch.

- Collectives: time(bytes) = latency_s + bus_bytes / bus_bandwidth, with the NCCL-tests bus-bandwidth
  convention (nccl-tests doc/PERFORMANCE.md): bus bytes = message bytes x 2(n-1)/n for all-reduce,
  x (n-1)/n for all-gather, reduce-scatter and all-to-all, x 1 for broadcast, point-to-point and a ring
  step (each rank's one message).
- GEMMs: time = max(kernel_overhead_s, flops / (peak x gemm_max_efficiency x prod_d d / (d + half_dim)))
  (the Hardware docstring's efficiency model), fitted by least squares on log time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from specs.errors import PlannerError


def bus_factor(collective: str, group_size: int) -> float:
    """Bus bytes per message byte (nccl-tests PERFORMANCE.md); `message` is the full tensor.

    The message is the all-reduce buffer, the all-gather output, the reduce-scatter input, the
    broadcast buffer, one point-to-point message, one rank's ring-step message, or one rank's whole
    all-to-all buffer.
    """
    n = group_size
    if n < 2:
        raise ValueError(f"a collective needs a group of at least 2, got {n}")
    if collective == "all_reduce":
        return 2 * (n - 1) / n
    if collective in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    if collective in ("broadcast", "p2p", "ring_step"):
        return 1.0
    raise ValueError(f"unknown collective {collective!r}")


@dataclass(frozen=True)
class LinearFit:
    latency_s: float
    bandwidth_bytes_per_s: float
    # Root-mean-square relative error of the fit over the points it used.
    rms_rel_error: float


def fit_latency_bandwidth(bus_bytes: Sequence[float], times_s: Sequence[float]) -> LinearFit:
    """Fit time = latency + bytes / bandwidth: the slope from the large messages, the latency from the small.

    Real curves are not one line: a token bucket's burst, socket buffers and caches make mid-size
    messages look fast (time ~ latency + max(0, bytes - burst) / rate), so one least-squares line over
    all sizes tilts and overstates the bandwidth. The bandwidth is therefore the least-squares slope
    over the larger half of the sizes (where the link's rate dominates), and the latency the median of
    time - bytes / bandwidth over the smallest quarter (where the fixed cost dominates), clamped at zero.

    Both read the curve's lower monotone envelope (each size's time replaced by the least time measured
    at that size or any larger one): a message cannot take longer than a bigger one over the same link,
    and noise on a shared host (a rank descheduled mid-collective) only ever adds time. Without it one
    slow median among the two smallest sizes of a quick sweep set the latency: an all-to-all measured
    0.34 / 2.36 / 1.91 / 0.17 ms at 1-64 KiB was fitted 1.35 ms per call, and every CP all-to-all plan
    was priced 80% too slow.
    """
    x = np.asarray(bus_bytes, dtype=float)
    t = np.asarray(times_s, dtype=float)
    if x.shape != t.shape or x.size < 2:
        raise PlannerError(f"a latency-bandwidth fit needs at least 2 points, got {x.size}")
    if np.any(t <= 0) or np.any(x < 0):
        raise PlannerError("a latency-bandwidth fit needs positive times and non-negative sizes")
    if np.ptp(x) == 0:
        raise PlannerError("a latency-bandwidth fit needs at least two different message sizes")
    order = np.argsort(x)
    x, raw = x[order], t[order]
    t = np.minimum.accumulate(raw[::-1])[::-1]
    half = x.size // 2
    large = slice(min(half, x.size - 2), None)
    if np.ptp(x[large]) == 0:
        large = slice(None)
    inv_bw = float(np.polyfit(x[large], t[large], 1)[0])
    if inv_bw <= 0 or np.ptp(t[large]) == 0:
        raise PlannerError("measured times do not grow with message size; cannot fit a bandwidth "
                           "(use larger messages)")
    small = slice(0, max(1, x.size // 4))
    latency_s = max(0.0, float(np.median(t[small] - x[small] * inv_bw)))
    pred = latency_s + x * inv_bw
    rms = float(np.sqrt(np.mean(((pred - raw) / raw) ** 2)))
    return LinearFit(latency_s=latency_s, bandwidth_bytes_per_s=1.0 / inv_bw, rms_rel_error=rms)


@dataclass(frozen=True)
class GemmSample:
    m: int
    n: int
    k: int
    dtype: str
    time_s: float

    @property
    def flops(self) -> float:
        return 2.0 * self.m * self.n * self.k


@dataclass(frozen=True)
class GemmFit:
    # Asymptotic FLOP/s per dtype: peak x gemm_max_efficiency, the rate of an infinitely large GEMM.
    asymptote_flops_per_s: dict[str, float]
    gemm_half_dim: float
    kernel_overhead_s: float
    rms_log_error: float


def _shape_factor(dims: np.ndarray, half_dim: float) -> np.ndarray:
    return np.prod(dims / (dims + half_dim), axis=1)


def _best_overhead(log_t: np.ndarray, log_compute: np.ndarray) -> tuple[float, float]:
    """The floor o minimising sum (log t - log max(o, compute))^2; candidates are the measured times."""
    best = (float(np.exp(log_compute.min())) * 0.5, float(np.sum((log_t - log_compute) ** 2)))
    for log_o in np.unique(log_t):
        sse = float(np.sum((log_t - np.maximum(log_o, log_compute)) ** 2))
        if sse < best[1]:
            best = (float(np.exp(log_o)), sse)
    return best


def fit_gemm(samples: Sequence[GemmSample], *, half_dims: Sequence[float] | None = None) -> GemmFit:
    """Fit per-dtype asymptotic throughput, one shared half-dimension and the kernel floor.

    For a fixed half_dim the log-space model is linear in log(asymptote) per dtype, which has a closed
    form (the mean residual over that dtype's points above the floor); half_dim is found by a 1-D scan
    and the floor by a scan over the measured times, alternating twice.
    """
    if len(samples) < 3:
        raise PlannerError(f"a GEMM fit needs at least 3 measured shapes, got {len(samples)}")
    dims = np.array([[s.m, s.n, s.k] for s in samples], dtype=float)
    log_t = np.log(np.array([s.time_s for s in samples]))
    log_f = np.log(np.array([s.flops for s in samples]))
    dtypes = sorted({s.dtype for s in samples})
    dtype_idx = np.array([dtypes.index(s.dtype) for s in samples])
    grid = half_dims if half_dims is not None else np.concatenate([[0.0], np.geomspace(0.5, 8192, 240)])
    best: tuple[float, GemmFit] | None = None
    for half in grid:
        log_shape = np.log(_shape_factor(dims, half))
        overhead = 0.0
        above = np.ones(len(samples), dtype=bool)
        for _ in range(3):
            log_a = np.zeros(len(dtypes))
            for j in range(len(dtypes)):
                sel = (dtype_idx == j) & above
                sel = sel if sel.any() else dtype_idx == j
                log_a[j] = np.mean(log_f[sel] - log_shape[sel] - log_t[sel])
            log_compute = log_f - log_shape - log_a[dtype_idx]
            overhead, sse = _best_overhead(log_t, log_compute)
            above = log_compute > np.log(overhead)
        if best is None or sse < best[0] - 1e-12:
            best = (sse, GemmFit(asymptote_flops_per_s={d: float(np.exp(log_a[j])) for j, d in enumerate(dtypes)},
                                 gemm_half_dim=float(half), kernel_overhead_s=overhead,
                                 rms_log_error=float(np.sqrt(sse / len(samples)))))
    assert best is not None
    return best[1]


def predict_gemm_time_s(fit: GemmFit, *, m: int, n: int, k: int, dtype: str) -> float:
    dims = np.array([[m, n, k]], dtype=float)
    rate = fit.asymptote_flops_per_s[dtype] * float(_shape_factor(dims, fit.gemm_half_dim)[0])
    return max(fit.kernel_overhead_s, 2.0 * m * n * k / rate)
