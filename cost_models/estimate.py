"""The cost model's answer for one plan, and the entry point that prices a plan.

    from cost_models.estimate import estimate
    est = estimate(plan, model=spec, cluster=cluster, job=job)
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Estimate:
    """Predicted performance and memory of one plan on one cluster.

    `breakdown` holds named components in seconds per step (compute_s, recompute_s, tp_comm_s,
    pp_comm_s, dp_comm_s, exposed_comm_s, bubble_s, optimizer_s, ...) and bytes per device
    (weights_bytes, grads_bytes, optimizer_bytes, activations_bytes, buffers_bytes, ...).
    """

    step_time_s: float
    tokens_per_s: float
    mfu: float
    tflops_per_gpu: float
    peak_memory_bytes: int
    memory_limit_bytes: int
    breakdown: dict[str, float] = field(default_factory=dict)

    @property
    def fits(self) -> bool:
        return self.peak_memory_bytes <= self.memory_limit_bytes

    @property
    def memory_shortfall_bytes(self) -> int:
        """How much more memory per device the plan needs than the device has (0 when it fits)."""
        return max(0, self.peak_memory_bytes - self.memory_limit_bytes)

    def to_dict(self) -> dict:
        return {
            "step_time_s": self.step_time_s, "tokens_per_s": self.tokens_per_s, "mfu": self.mfu,
            "tflops_per_gpu": self.tflops_per_gpu, "peak_memory_bytes": int(self.peak_memory_bytes),
            "memory_limit_bytes": int(self.memory_limit_bytes), "fits": self.fits,
            "memory_shortfall_bytes": int(self.memory_shortfall_bytes), "breakdown": dict(self.breakdown),
        }
