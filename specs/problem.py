"""The problem a plan is for: what is trained (model), where (cluster), and how much (job).

    problem = make_problem(model="llama3-8b", hardware="h100", gpus=64, gpus_per_node=8,
                           global_batch=512, seq_len=8192)
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.cluster import Cluster, make_cluster
from specs.errors import PlannerError
from specs.hardware import resolve_hardware
from specs.job import Job
from specs.model import ModelSpec, resolve_model
from specs.plan import check_seq_len


@dataclass(frozen=True)
class Problem:
    """What is trained, where, and how much: everything but the plan."""

    model: ModelSpec
    cluster: Cluster
    job: Job


# The longest default sequence: Llama 3's pre-training context (HF configs of 3.1 and later say 131072, the
# context after long-context training).
MAX_DEFAULT_SEQ_LEN = 8192


def default_seq_len(spec: ModelSpec) -> int:
    """The sequence length when none is given: the model's context, at most MAX_DEFAULT_SEQ_LEN."""
    return min(spec.max_seq_len, MAX_DEFAULT_SEQ_LEN)


def make_problem(*, model: str, hardware: str, gpus: int, gpus_per_node: int | None,
                 global_batch: int, seq_len: int | None, precision: str | None = None,
                 memory_headroom: float | None = None) -> Problem:
    spec = resolve_model(model)
    hw = resolve_hardware(hardware)
    cluster = make_cluster(hardware=hw, num_devices=gpus, devices_per_node=gpus_per_node)
    if precision is None:
        precision = "fp32" if hw.device_type == "cpu" else "bf16"
    try:
        job = Job(global_batch=global_batch, seq_len=seq_len or default_seq_len(spec), precision=precision,
                  memory_headroom=memory_headroom)
    except ValueError as exc:
        raise PlannerError(str(exc)) from None
    check_seq_len(spec, seq_len=job.seq_len)
    return Problem(model=spec, cluster=cluster, job=job)
