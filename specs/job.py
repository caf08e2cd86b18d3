"""The training job: how much is trained per step, at what precision, with which optimizer."""

from __future__ import annotations

from dataclasses import dataclass

from specs.jsonio import dataclass_from_dict, dataclass_to_dict

PRECISIONS = ("bf16", "fp16", "fp32")
OPTIMIZERS = ("adam",)


@dataclass(frozen=True)
class Job:
    """Global batch in sequences, sequence length in tokens, compute precision and optimizer.

    Mixed precision (bf16/fp16) keeps fp32 master weights and Adam moments, as in the ZeRO paper's
    16 bytes per parameter; fp32 keeps one fp32 copy of weights and gradients (4 + 4 + 8 bytes).
    """

    global_batch: int
    seq_len: int
    precision: str = "bf16"
    optimizer: str = "adam"

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise ValueError(f"global_batch must be at least 1, got {self.global_batch}")
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be at least 1, got {self.seq_len}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(PRECISIONS)}, got {self.precision!r}")
        if self.optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be one of {', '.join(OPTIMIZERS)}, got {self.optimizer!r}")

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def to_dict(self) -> dict:
        return dataclass_to_dict(self)

    @classmethod
    def from_dict(cls, data: object, *, what: str = "job") -> "Job":
        return dataclass_from_dict(cls, data, what=what)
