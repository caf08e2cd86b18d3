"""A plan file: the plan with everything it was made for (model, hardware, cluster, job), so that
`explain`, `export`, `estimate` and `run --plan` need no other flag.

    planner search --model llama3-70b --hardware h100 --gpus 1024 --global-batch 1024 --out plan.json
    planner explain --plan plan.json

The JSON form (`format` names the version; every other key is checked exactly):

    {"format": "planner-plan/1", "plan": {...}, "model": {...}, "job": {...},
     "cluster": {"num_devices": 1024, "devices_per_node": 8},
     "hardware": {"source": "h100", "sha256": null, "spec": {...}},
     "engine": "ours", "estimate": {...}}

The hardware is carried whole (`spec`), so the file prices the same on any machine; `source` names the
preset or the profile file it came from and `sha256` that file's content hash (null for a preset).
`estimate` is what the cost model predicted when the file was written, for `engine`.

A file without `format` is a bare plan (a plan object, or any object with a "plan" key, such as
`planner run --metrics-out`); the commands then take the rest from their flags.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from specs.cluster import Cluster
from specs.errors import PlannerError
from specs.hardware import PRESETS as HARDWARE_PRESETS
from specs.hardware import Hardware
from specs.jsonio import check_keys, read_json_file, write_json_atomic
from specs.job import Job
from specs.model import ModelSpec
from specs.plan import Plan, check_plan

FORMAT = "planner-plan/1"
# The engines a plan can be priced for; cost_models/engines.py prices each (and checks it prices exactly these).
ENGINES = ("ours", "megatron", "megatron-sc21", "deepspeed", "torchtitan", "fsdp")
_KEYS = {"format", "plan", "model", "job", "cluster", "hardware", "engine", "estimate"}
_REQUIRED = _KEYS - {"estimate"}


@dataclass(frozen=True)
class HardwareSource:
    """Where a plan file's hardware came from: a preset name, or a profile path and its content hash."""

    source: str
    sha256: str | None = None

    def describe(self) -> str:
        return self.source if self.sha256 is None else f"{self.source} (sha256 {self.sha256[:12]})"


def hardware_source(name_or_path: str) -> HardwareSource:
    """The HardwareSource of a --hardware value (a preset name, or a profile file hashed by content)."""
    if name_or_path in HARDWARE_PRESETS:
        return HardwareSource(name_or_path)
    try:
        digest = hashlib.sha256(Path(name_or_path).read_bytes()).hexdigest()
    except OSError as exc:
        raise PlannerError(f"cannot read hardware profile {name_or_path}: {exc.strerror or exc}") from None
    return HardwareSource(name_or_path, digest)


@dataclass(frozen=True)
class PlanFile:
    plan: Plan
    model: ModelSpec
    job: Job
    cluster: Cluster  # carries the hardware
    hardware_source: HardwareSource
    engine: str = "ours"
    estimate: dict | None = None  # the Estimate's JSON when written (cost_models.estimate.Estimate.to_dict)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        try:
            check_plan(self.plan, model=self.model, num_devices=self.cluster.num_devices, job=self.job)
        except PlannerError as exc:
            raise ValueError(str(exc)) from None

    @property
    def hardware(self) -> Hardware:
        return self.cluster.hardware

    def to_dict(self) -> dict:
        out = {"format": FORMAT, "plan": self.plan.to_dict(), "model": self.model.to_dict(), "job": self.job.to_dict(),
               "cluster": {"num_devices": self.cluster.num_devices, "devices_per_node": self.cluster.devices_per_node},
               "hardware": {"source": self.hardware_source.source, "sha256": self.hardware_source.sha256,
                            "spec": self.hardware.to_dict()},
               "engine": self.engine}
        if self.estimate is not None:
            out["estimate"] = self.estimate
        return out

    @classmethod
    def from_dict(cls, data: Any, *, what: str = "plan file") -> "PlanFile":
        check_keys(data, allowed=_KEYS, required=_REQUIRED, what=what)
        if data["format"] != FORMAT:
            raise PlannerError(f"{what}: format {data['format']!r} is not {FORMAT!r}")
        cluster = check_keys(data["cluster"], allowed={"num_devices", "devices_per_node"},
                             required={"num_devices", "devices_per_node"}, what=f"{what}: cluster")
        hw = check_keys(data["hardware"], allowed={"source", "sha256", "spec"}, required={"source", "sha256", "spec"},
                        what=f"{what}: hardware")
        for key in ("num_devices", "devices_per_node"):
            value = cluster[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise PlannerError(f"{what}: cluster.{key} must be a positive integer, got {value!r}")
        if cluster["num_devices"] % cluster["devices_per_node"]:
            raise PlannerError(f"{what}: cluster.num_devices {cluster['num_devices']} is not a multiple of "
                               f"devices_per_node {cluster['devices_per_node']}")
        if not isinstance(hw["source"], str) or not (hw["sha256"] is None or isinstance(hw["sha256"], str)):
            raise PlannerError(f"{what}: hardware.source must be a string and hardware.sha256 a string or null")
        if data.get("estimate") is not None and not isinstance(data["estimate"], dict):
            raise PlannerError(f"{what}: estimate must be an object")
        hardware = Hardware.from_dict(hw["spec"], what=f"{what}: hardware.spec")
        try:
            return cls(plan=Plan.from_dict(data["plan"], what=f"{what}: plan"),
                       model=ModelSpec.from_dict(data["model"], what=f"{what}: model"),
                       job=Job.from_dict(data["job"], what=f"{what}: job"),
                       cluster=Cluster(num_nodes=cluster["num_devices"] // cluster["devices_per_node"],
                                       devices_per_node=cluster["devices_per_node"], hardware=hardware),
                       hardware_source=HardwareSource(hw["source"], hw["sha256"]),
                       engine=data["engine"] if isinstance(data["engine"], str) else repr(data["engine"]),
                       estimate=data.get("estimate"))
        except ValueError as exc:
            if isinstance(exc, PlannerError):
                raise
            raise PlannerError(f"{what}: {exc}") from None

    def save(self, path: str | Path) -> None:
        write_json_atomic(path, self.to_dict())


def read_plan_json(path: str | Path) -> PlanFile | Plan:
    """A plan file (PlanFile) or a bare plan (Plan) from `path`; PlannerError naming the file otherwise.

    A file of an older `search --out` (a "plan" with "model" and "job" but no "format") is refused with
    what to do, since it lacks the hardware and cluster its plan was priced on."""
    data = read_json_file(path, what="plan")
    if isinstance(data, dict) and "format" in data:
        return PlanFile.from_dict(data, what=f"plan file {path}")
    if isinstance(data, dict) and "plan" in data and {"model", "job"} & set(data):
        raise PlannerError(f"plan file {path} was written by an older `planner search --out` and does not say "
                           f"which hardware and cluster it is for; run the search again")
    if isinstance(data, dict) and "plan" in data and isinstance(data["plan"], dict):
        data = data["plan"]
    return Plan.from_dict(data, what=f"plan {path}")
