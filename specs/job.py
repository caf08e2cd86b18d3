"""The training job: how much is trained per step, at what precision, with which optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from specs.jsonio import dataclass_from_dict, dataclass_to_dict

PRECISIONS = ("bf16", "fp16", "fp32", "fp8")
OPTIMIZERS = ("adam",)
GPU_MEMORY_HEADROOM = 0.10


@dataclass(frozen=True)
class Job:
    """Global batch in sequences, sequence length in tokens, compute precision and optimizer.

    Mixed precision (bf16/fp16) keeps fp32 master weights and Adam moments, as in the ZeRO paper's
    16 bytes per parameter; fp32 keeps one fp32 copy of weights and gradients (4 + 4 + 8 bytes); fp8
    (Transformer Engine's recipe on Hopper) runs the linear layers' GEMMs in fp8 and the rest in bf16,
    keeping an fp8 copy of the weights besides the bf16 ones.

    memory_headroom: the share of each device's memory a plan must leave free (allocator growth, a longer
    batch, another process); None: 10% on GPUs (GPU_MEMORY_HEADROOM), nothing on CPU hosts, whose
    profile's measured reserve already covers the runtime.
    """

    global_batch: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adam"
    memory_headroom: float | None = None

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be at least 1, got {self.global_batch}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {self.seq_len}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.memory_headroom is not None and not 0 <= self.memory_headroom <= 0.9:
            raise ValueError(f"memory headroom must be between 0 and 0.9, got {self.memory_headroom}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")

    def headroom(self, device_type: str) -> float:
        """The memory headroom in force on `device_type` devices (see the class docstring)."""
        if self.memory_headroom is not None:
            return self.memory_headroom
        return GPU_MEMORY_HEADROOM if device_type == "cuda" else 0.0

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, what: str = "job") -> "Job":
        return dataclass_from_dict(cls, data, what=what)
