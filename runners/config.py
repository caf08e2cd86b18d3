"""What one run needs (RunConfig) and what it reports (RunMetrics): the runner's input and output types.

The application (planner/) builds a RunConfig from a plan and the problem, with the cost model's
prediction already in it (`predicted`: the runner never prices a plan itself), and reads back a
RunMetrics; both round-trip through JSON (the launcher passes them to and from the torchrun workers).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from specs.job import Job
from specs.jsonio import dataclass_from_dict
from specs.model import ModelSpec
from specs.plan import Plan

ENGINES = ("ours", "torch")


@dataclass(frozen=True)
class WorldPlan:
    """The plan an elastic run trains when it has `world_size` processes, with the cost model's estimate
    of it (planner/elastic.py builds one per world size the run may shrink or grow to)."""

    world_size: int
    plan: Plan
    predicted: dict | None = None

    def __post_init__(self) -> None:
        if self.plan.world_size != self.world_size:
            raise ValueError(f"the plan for {self.world_size} processes has {self.plan.world_size} ranks")


@dataclass(frozen=True)
class RunConfig:
    """Everything one run needs besides the processes: the plan and inputs, and how long to train."""

    plan: Plan
    model: ModelSpec
    job: Job
    steps: int = 10
    seed: int = 0
    lr: float = 1e-3
    data: str | None = None
    ranks_per_node: int = 0  # 0: all local ranks form one node
    engine: str = "ours"
    timeout_s: float = 300.0
    # Checkpoints (runners/checkpoint.py): every N steps (0: only at the end) into checkpoint_dir, keeping
    # the newest checkpoint_keep; resume continues from the newest (as does any torchrun restart).
    checkpoint_dir: str | None = None
    checkpoint_every: int = 0
    checkpoint_keep: int = 2
    resume: bool = False
    # The cost model's estimate of this plan (cost_models.estimate.Estimate.to_dict()), handed in by the
    # application so that the metrics carry measured beside predicted; None: no prediction.
    predicted: dict | None = None
    # TF32 for fp32 GEMMs on CUDA (the speed the presets' fp32 peak assumes); exactness checks against
    # one process on a GPU turn it off.
    allow_tf32: bool = True
    # Chain gradient reductions on side streams (runners/sharding/streams.py); None: on CUDA under NCCL.
    # True elsewhere runs the same logic on gloo (a GPU check of the stream code on one device).
    stream_ordered: bool | None = None
    # Elastic runs (`planner run --elastic MIN:MAX`): the plan for every world size the run may have; each
    # (re)start trains the entry for its WORLD_SIZE (`for_world`) and resumes from the newest checkpoint.
    elastic_plans: tuple[WorldPlan, ...] = ()

    def __post_init__(self) -> None:
        if self.steps < 1:
            raise ValueError(f"steps must be at least 1, got {self.steps}")
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be ours or torch, got {self.engine!r}")
        if not 0 < self.lr < float("inf"):
            raise ValueError(f"lr must be a positive finite number, got {self.lr}")
        if self.ranks_per_node < 0 or self.seed < 0:
            raise ValueError(f"ranks_per_node and seed must be non-negative, got {self.ranks_per_node} and {self.seed}")
        if not self.timeout_s > 0 or self.timeout_s == float("inf"):
            raise ValueError(f"timeout_s must be a positive number of seconds, got {self.timeout_s}")
        if self.checkpoint_every < 0 or self.checkpoint_keep < 1:
            raise ValueError(f"checkpoint_every must be >= 0 and checkpoint_keep >= 1, got {self.checkpoint_every} "
                             f"and {self.checkpoint_keep}")
        if (self.checkpoint_dir or self.resume) and self.engine != "ours":
            raise ValueError("checkpoints are implemented for --engine ours only")
        if self.resume and not self.checkpoint_dir:
            raise ValueError("resume needs a checkpoint_dir")
        if self.elastic_plans and not self.checkpoint_dir:
            raise ValueError("an elastic run needs a checkpoint_dir (it resumes from it after every change)")
        if len({w.world_size for w in self.elastic_plans}) != len(self.elastic_plans):
            raise ValueError("elastic_plans has two plans for one world size")

    def for_world(self, world_size: int) -> "RunConfig":
        """This config with the elastic plan for `world_size` processes (itself when not elastic)."""
        if not self.elastic_plans:
            return self
        for entry in self.elastic_plans:
            if entry.world_size == world_size:
                return dataclasses.replace(self, plan=entry.plan, predicted=entry.predicted)
        sizes = ", ".join(str(w.world_size) for w in self.elastic_plans)
        raise ValueError(f"the elastic run has plans for {sizes} processes, but {world_size} were launched")

    def replace(self, **changes: object) -> "RunConfig":
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict:
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        out.update(plan=self.plan.to_dict(), model=self.model.to_dict(), job=self.job.to_dict(),
                   elastic_plans=[{"world_size": w.world_size, "plan": w.plan.to_dict(), "predicted": w.predicted}
                                  for w in self.elastic_plans])
        return out

    @classmethod
    def from_dict(cls, data: object, *, what: str = "run config") -> "RunConfig":
        """Any JSON value gives a RunConfig or a PlannerError naming the bad key (types checked)."""
        return dataclass_from_dict(cls, data, what=what)


@dataclass(frozen=True)
class StepRecord:
    """One optimizer step: the global mean loss and the slowest rank's wall time."""

    step: int
    loss: float
    step_time_s: float


@dataclass(frozen=True)
class RunSummary:
    """The steady state of a run (the first, allocating step dropped where there are more)."""

    median_step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: int  # the largest rank's: torch.cuda.max_memory_allocated, or on CPU the anonymous peak (runners/train.py)
    # Bytes per step summed over all ranks by kind and link class (runners/comm.py), and seconds per step
    # a rank spent blocked on communication.
    comm_bytes: dict[str, int]
    comm_wait_s: float
    world_size: int
    device: str
    engine: str
    # False under --engine torch: torch's collectives bypass runners.comm, so comm_bytes stay zero.
    comm_counted: bool = True
    precision: str = ""  # the job's compute precision
    # fp16: steps skipped because a gradient overflowed under the loss scale, and the scale at the end.
    skipped_steps: int = 0
    loss_scale: float = 1.0
    # MoE models (runners/moe.py), per step over all ranks: (token, expert) assignments routed, those sent
    # to another EP rank, and the load imbalance: over MoE layers, the mean of the busiest expert's
    # assignments over the mean expert's (1: perfectly balanced; 0 for dense models).
    moe_rows_routed: float = 0.0
    moe_rows_off_rank: float = 0.0
    moe_imbalance: float = 0.0


@dataclass(frozen=True)
class ElasticEvent:
    """One change of an elastic run (runners/elastic.py): `kind` is lost (a failure was detected),
    replanned (a plan was picked for the new world), resumed (its first step starts from a checkpoint)
    or scaled_up (the world grew). `time_s` counts from the launch; `steps_lost` (resumed only) are the
    steps done before the change that the resumed run trains again."""

    kind: str
    time_s: float
    world_size: int
    step: int
    steps_lost: int = 0
    detail: str = ""


@dataclass(frozen=True)
class RunMetrics:
    """What a run reports: its plan, every step, the summary and the prediction it was handed. For an
    elastic run: the plan and summary of its last world, every step's final record, and the changes."""

    plan: Plan
    steps: tuple[StepRecord, ...]
    summary: RunSummary
    predicted: dict | None = None
    events: tuple[ElasticEvent, ...] = ()

    @property
    def losses(self) -> list[float]:
        return [s.loss for s in self.steps]

    def to_dict(self) -> dict:
        return {"plan": self.plan.to_dict(), "steps": [dataclasses.asdict(s) for s in self.steps],
                "summary": dataclasses.asdict(self.summary), "predicted": self.predicted,
                "events": [dataclasses.asdict(e) for e in self.events]}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "metrics") -> "RunMetrics":
        return dataclass_from_dict(cls, data, what=what)


@dataclass(frozen=True)
class TimingSpec:
    """The batched timing run (runners/timing.py): several plans' trainers in one set of processes,
    taking turns `steps_per_round` steps each, `rounds` times over."""

    configs: tuple[RunConfig, ...]
    labels: tuple[str, ...]
    rounds: int
    steps_per_round: int = 3

    def __post_init__(self) -> None:
        if not self.configs or len(self.labels) != len(self.configs):
            raise ValueError(f"need one label per config, got {len(self.labels)} labels for {len(self.configs)}")
        if self.rounds < 1 or self.steps_per_round < 1:
            raise ValueError(f"rounds and steps_per_round must be at least 1, got {self.rounds}, {self.steps_per_round}")

    def to_dict(self) -> dict:
        return {"configs": [c.to_dict() for c in self.configs], "labels": list(self.labels), "rounds": self.rounds,
                "steps_per_round": self.steps_per_round}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "timing spec") -> "TimingSpec":
        return dataclass_from_dict(cls, data, what=what)


@dataclass(frozen=True)
class TimingResult:
    """Every timed step of each plan of a TimingSpec (the slowest rank's seconds, and the CPU seconds of all
    ranks), in the spec's order."""

    step_times_s: tuple[tuple[float, ...], ...] = field(default_factory=tuple)
    # The same steps' CPU seconds (user + system, all threads) summed over the ranks.
    cpu_times_s: tuple[tuple[float, ...], ...] = field(default_factory=tuple)

    def to_dict(self) -> dict:
        return {"step_times_s": [list(t) for t in self.step_times_s], "cpu_times_s": [list(t) for t in self.cpu_times_s]}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "timing result") -> "TimingResult":
        return dataclass_from_dict(cls, data, what=what)
