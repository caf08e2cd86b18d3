"""Plan-independent, sharded, atomic checkpoints with torch.distributed.checkpoint (DCP).

    planner run --nproc 4 --zero 3 --checkpoint-dir ckpt --checkpoint-every 50
    planner run --nproc 4 --tp 2 --checkpoint-dir ckpt --resume      # a different plan resumes it

What is saved does not depend on the plan that saved it. Every parameter is stored under its
one-process name (runners/transformer.py: `canonical_name`) as three global tensors: its fp32 master value
(`model/<name>`) and its Adam moments (`optim/exp_avg/<name>`, `optim/exp_avg_sq/<name>`). Each rank
writes only the part it owns: the slice of its optimizer shard (runners/sharding/'s nested layout)
that falls in each parameter, placed at its offsets in the full tensor (the TP shard's position along
`tp_split_dim`). An MoE model's experts live in their own sharding engine over expert-DP: each expert
weight [experts, a, b] is stored as [experts x a, b], every EP rank writing its experts' rows (under
expert TP, each ETP rank its slice of each expert's a rows or b columns) from its expert-DP shard, so an
ep4 checkpoint resumes under ep2 x etp2, or with the experts replicated. A contiguous
slice of a row-major [rows, cols] shard is at most three rectangles (a partial row, whole rows, a partial
row), so every piece is a box DCP can index; DCP's load plan then
reads, for any other plan, exactly the boxes that overlap what each of its ranks needs (resharding on
load). Replicas write nothing: DP positions q >= s_os duplicate positions q < s_os, and parameters that
TP replicates are written by tp rank 0 only. DCP's save validation checks that the written pieces
cover each tensor exactly once.

The compute-dtype parameters are not stored: they equal the fp32 master cast to the compute dtype (the
engine copies master into them after every Adam step), so a load sets both from the master.

Beside the tensors, `planner_meta.json` holds the step count (which is also the data position, since
the data of step k is a pure function of (seed, k), runners/data.py), the run's model, job, seed and
data path (a resume must train the same thing), the saving plan (for the record), every rank's RNG
state, and the records (loss, step time) of the steps trained since the previous checkpoint: a worker
stopped between a save and reporting its step (an elastic restart) has trained a step nobody heard of,
and the resume replays those records (runners/train.py) so the run's history has every step.

Atomicity: a checkpoint is written into `step-N.tmp/`, renamed to `step-N/` by rank 0 only after every
rank's DCP write has finished (DCP's final collective) and the metadata is on disk, and only then is
the `latest` file replaced (write-and-rename). A run killed mid-write leaves a `.tmp` folder that
loading ignores (and the next save of that step clears); loading checks the folder it picks is complete
and otherwise falls back to the newest complete one. The folder must be on a file system every node
sees.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import logging
import math
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader, FileSystemWriter
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, MetadataIndex, TensorProperties,
                                                   TensorStorageMetadata)
from torch.distributed.checkpoint.planner import LoadPlan, SavePlan, TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

from specs.errors import PlannerError
from specs.job import Job
from specs.jsonio import check_keys, read_json_file, write_json_atomic
from specs.model import ModelSpec
from specs.plan import Plan
from runners.config import StepRecord
from runners.sharding import shard_chunks

log = logging.getLogger(__name__)

CHECKPOINT_FORMAT = 1
META_FILE = "planner_meta.json"
LATEST_FILE = "latest"
DCP_METADATA_FILE = ".metadata"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def step_dir_name(step: int) -> str:
    return f"step-{step:08d}"


# --- the metadata file --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class CheckpointMeta:
    """What a checkpoint holds besides the tensors; `step` optimizer steps are done."""

    step: int
    seed: int
    model: ModelSpec
    job: Job
    data: str | None
    plan: Plan
    world_size: int
    rng_states: tuple[str, ...]  # base64 torch CPU generator state of each saving rank, in rank order
    format: int = CHECKPOINT_FORMAT
    # The steps trained since the previous checkpoint, (step, loss, step time); absent in older files.
    records: tuple[StepRecord, ...] = ()

    def to_dict(self) -> dict:
        return {"format": self.format, "step": self.step, "seed": self.seed, "model": self.model.to_dict(),
                "job": self.job.to_dict(), "data": self.data, "plan": self.plan.to_dict(),
                "world_size": self.world_size, "rng_states": list(self.rng_states),
                "records": [[r.step, r.loss, r.step_time_s] for r in self.records]}

    @classmethod
    def from_dict(cls, data: object, *, what: str = "checkpoint metadata") -> "CheckpointMeta":
        """Any JSON value gives a CheckpointMeta or a PlannerError naming the bad key."""
        names = {f.name for f in dataclasses.fields(cls)}
        check_keys(data, allowed=names, required=names - {"records"}, what=what)
        assert isinstance(data, dict)
        if data["format"] != CHECKPOINT_FORMAT or isinstance(data["format"], bool):
            raise PlannerError(f"{what}: format {data['format']!r} is not {CHECKPOINT_FORMAT} (written by another version)")
        for key in ("step", "seed", "world_size"):
            value = data[key]
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise PlannerError(f"{what}.{key}: expected a non-negative integer, got {value!r}")
        if data["world_size"] < 1:
            raise PlannerError(f"{what}.world_size: expected at least 1, got {data['world_size']}")
        if data["data"] is not None and not isinstance(data["data"], str):
            raise PlannerError(f"{what}.data: expected a path or null, got {data['data']!r}")
        rng = data["rng_states"]
        if not isinstance(rng, list) or len(rng) != data["world_size"] or not all(isinstance(s, str) for s in rng):
            raise PlannerError(f"{what}.rng_states: expected one string per rank ({data['world_size']})")
        for s in rng:
            try:
                base64.b64decode(s, validate=True)
            except ValueError:
                raise PlannerError(f"{what}.rng_states: not base64: {s[:20]!r}") from None
        return cls(step=data["step"], seed=data["seed"], model=ModelSpec.from_dict(data["model"], what=f"{what}.model"),
                   job=Job.from_dict(data["job"], what=f"{what}.job"), data=data["data"],
                   plan=Plan.from_dict(data["plan"], what=f"{what}.plan"), world_size=data["world_size"],
                   rng_states=tuple(rng), format=data["format"],
                   records=_records_from_json(data.get("records", []), step=data["step"], what=f"{what}.records"))

    def check_compatible(self, cfg) -> None:
        """Raise PlannerError unless `cfg` (a RunConfig) continues the run this checkpoint is from: the same
        model, batch, sequence length, seed and data (the plan and precision may change)."""
        mismatch = [(what, saved, now) for what, saved, now in (
            ("model", self.model, cfg.model), ("global batch", self.job.global_batch, cfg.job.global_batch),
            ("sequence length", self.job.seq_len, cfg.job.seq_len), ("seed", self.seed, cfg.seed),
            ("data", self.data, cfg.data)) if saved != now]
        if mismatch:
            what, saved, now = mismatch[0]
            saved_s = saved.name if isinstance(saved, ModelSpec) else saved
            now_s = now.name if isinstance(now, ModelSpec) else now
            if saved_s == now_s:
                saved_s, now_s = "a different spec", "this one"
            raise PlannerError(f"checkpoint at step {self.step} was saved with {what} {saved_s}, this run has {now_s}")
        if self.step >= cfg.steps:
            raise PlannerError(f"checkpoint is at step {self.step} and --steps is {cfg.steps}: nothing left to train")


def _records_from_json(value: object, *, step: int, what: str) -> tuple[StepRecord, ...]:
    """[[step, loss, step time], ...] of steps before `step` to StepRecords, or a PlannerError."""
    if not isinstance(value, list):
        raise PlannerError(f"{what}: expected a list of [step, loss, step time], got {type(value).__name__}")
    records = []
    for item in value:
        ok = (isinstance(item, list) and len(item) == 3 and isinstance(item[0], int) and not isinstance(item[0], bool)
              and 0 <= item[0] < step and all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in item[1:]))
        if not ok:
            raise PlannerError(f"{what}: expected [step < {step}, loss, step time], got {item!r}")
        records.append(StepRecord(step=item[0], loss=float(item[1]), step_time_s=float(item[2])))
    return tuple(records)


def load_meta(folder: Path) -> CheckpointMeta:
    return CheckpointMeta.from_dict(read_json_file(folder / META_FILE, what="checkpoint metadata"),
                                    what=f"checkpoint metadata {folder / META_FILE}")


# --- where each rank's pieces lie in the canonical tensors ---------------------------------------------------
@dataclass(frozen=True)
class Piece:
    """A box of one canonical tensor and where it lies in a unit's flat buffer (a contiguous run)."""

    name: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    flat_start: int  # in the unit's flat (TP-local) buffer
    tp_replicated: bool  # every TP rank holds the whole tensor

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)


def flat_range_boxes(shape: tuple[int, ...], start: int, stop: int) -> list[tuple[tuple[int, ...], tuple[int, ...], int]]:
    """Split elements [start, stop) of a row-major tensor of `shape` (1-D or 2-D) into boxes.

    Returns (offsets, sizes, flat start) per box: at most a partial row, a run of whole rows, a partial row.
    """
    if len(shape) == 1:
        return [((start,), (stop - start,), start)] if stop > start else []
    assert len(shape) == 2, f"checkpoint pieces support 1-D and 2-D parameters, got shape {shape}"
    cols = shape[1]
    boxes = []
    row, col = divmod(start, cols)
    if col and start < stop:  # the partial first row
        end = min(stop, (row + 1) * cols)
        boxes.append(((row, col), (1, end - start), start))
        start, row = end, row + 1
    whole_rows = (stop - start) // cols
    if whole_rows > 0:
        boxes.append(((row, 0), (whole_rows, cols), start))
        start, row = start + whole_rows * cols, row + whole_rows
    if stop > start:  # the partial last row
        boxes.append(((row, 0), (1, stop - start), start))
    return boxes


def unit_params(chunks, *, experts: bool | None = None) -> list[tuple[torch.nn.Module, list[torch.nn.Parameter]]]:
    """Every engine unit and its parameters in the engine's order (runners/sharding/engine.py builds units
    the same way: chunk by chunk, unit by unit, trainable parameters only, units without any skipped).
    `experts` as the engine's: None every parameter, False all but MoE experts', True the experts' alone
    (one unit per MoE layer's GroupedExperts)."""
    from runners.moe import GroupedExperts

    units, seen = [], set()
    for chunk in chunks:
        modules = [m for m in chunk.modules() if isinstance(m, GroupedExperts)] if experts else chunk.units
        for module in modules:
            params = [p for p in module.parameters() if p.requires_grad and id(p) not in seen  # a shared tied weight: its owner's
                      and (experts is None or bool(getattr(p, "is_expert", False)) == experts)]
            seen |= {id(p) for p in params}
            if params:
                units.append((module, params))
    return units


def _tp_boxes(p, lo: int, hi: int, *, tp_rank: int, tp: int) -> tuple[tuple[int, ...], list]:
    """(global shape, [(offsets, sizes, flat start)]) of elements [lo, hi) of a parameter's local tensor,
    placed along its tp_split_dim."""
    shape, split = tuple(p.shape), p.tp_split_dim
    global_shape = list(shape)
    if split is not None and tp > 1:
        global_shape[split] *= tp
    boxes = []
    for box_offsets, sizes, flat in flat_range_boxes(shape, lo, hi):
        box_offsets = list(box_offsets)
        if split is not None and tp > 1:
            box_offsets[split] += tp_rank * shape[split]
        boxes.append((tuple(box_offsets), sizes, flat))
    return tuple(global_shape), boxes


def _expert_boxes(p, lo: int, hi: int, *, ep_rank: int, ep: int, etp_rank: int,
                  etp: int) -> tuple[tuple[int, ...], list]:
    """The same for an MoE expert weight: local [local, a, b] (a or b cut by expert TP along
    etp_split_dim) stored as [local x a, b] in the global [experts x A, B]. A run of whole rows is cut
    where it crosses from one local expert to the next (under etp > 1 on dim 1 they are apart there)."""
    local, a, b = p.shape
    by_rows, by_cols = (etp if p.etp_split_dim == 1 else 1), (etp if p.etp_split_dim == 2 else 1)
    full_a = a * by_rows
    boxes = []
    for (row, col), (rows, cols), flat in flat_range_boxes((local * a, b), lo, hi):
        cuts = [row] if by_rows == 1 else [row, *range((row // a + 1) * a, row + rows, a)]
        ends = [*cuts[1:], row + rows]
        for r0, r1 in zip(cuts, ends):
            expert, within = divmod(r0, a)
            g_row = (ep_rank * local + expert) * full_a + (etp_rank * a if by_rows > 1 else 0) + within
            g_col = col + (etp_rank * b if by_cols > 1 else 0)
            boxes.append(((g_row, g_col), (r1 - r0, cols), flat + (r0 - row) * cols))
    return (local * ep * full_a, b * by_cols), boxes


def pieces_in_range(params, *, start: int, stop: int, tp_rank: int, tp: int, ep_rank: int = 0, ep: int = 1,
                    etp_rank: int = 0, etp: int = 1) -> list[Piece]:
    """The canonical boxes that elements [start, stop) of a unit's flat buffer hold."""
    pieces, offset = [], 0
    for p in params:
        lo, hi = max(start, offset), min(stop, offset + p.numel())
        if lo < hi:
            expert = getattr(p, "is_expert", False)
            global_shape, boxes = (
                _expert_boxes(p, lo - offset, hi - offset, ep_rank=ep_rank, ep=ep, etp_rank=etp_rank, etp=etp)
                if expert else _tp_boxes(p, lo - offset, hi - offset, tp_rank=tp_rank, tp=tp))
            for box_offsets, sizes, flat in boxes:
                pieces.append(Piece(p.canonical_name, global_shape, box_offsets, sizes, offset + flat,
                                    tp_replicated=not expert and p.tp_split_dim is None and tp > 1))
        offset += p.numel()
    return pieces


@dataclass(frozen=True)
class UnitLayout:
    """One unit's flat-buffer ranges on this rank under the plan (runners/sharding/'s nested shards)."""

    module: torch.nn.Module
    params: list
    padded: int
    param_range: tuple[int, int]
    optim_range: tuple[int, int]


def unit_layouts(chunks, *, plan: Plan, dp_rank: int, experts: bool | None = None) -> list[UnitLayout]:
    s_p, _, s_os = plan.shard_degrees
    p_chunk, _, o_chunk = shard_chunks(dp_rank, degrees=plan.shard_degrees)
    layouts = []
    for module, params in unit_params(chunks, experts=experts):
        padded = math.ceil(sum(p.numel() for p in params) / s_os) * s_os
        param_len, optim_len = padded // s_p, padded // s_os
        layouts.append(UnitLayout(module, params, padded, (p_chunk * param_len, (p_chunk + 1) * param_len),
                                  (o_chunk * optim_len, (o_chunk + 1) * optim_len)))
    return layouts


@dataclass(frozen=True)
class EngineView:
    """One of a trainer's sharding engines as the checkpoint sees it: the dense parameters' (every parameter
    of a dense model), or an MoE model's experts' over expert-DP (runners/train.py, `expert_plan`)."""

    engine: object
    plan: Plan
    shard_rank: int
    experts: bool | None


def engine_views(trainer, plan: Plan) -> list[EngineView]:
    moe = trainer.expert_engine is not None
    views = [EngineView(trainer.engine, plan, trainer.mesh.shard_rank, False if moe else None)]
    if moe:  # the experts' engine runs runners/train.expert_plan on the mesh's expert view
        engine = trainer.expert_engine
        views.append(EngineView(engine, engine.plan, engine.mesh.shard_rank, True))
    return views


# --- DCP planners over explicit pieces ----------------------------------------------------------------------
class _PieceSavePlanner(DefaultSavePlanner):
    """Writes explicitly placed boxes: {key: [(Piece, tensor)]}; the default global plan merges them and
    validates that every tensor is covered exactly once."""

    def __init__(self, pieces: dict[str, list[tuple[Piece, torch.Tensor]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = {(key, piece.offsets): tensor for key, entries in pieces.items() for piece, tensor in entries}
        self.items = [WriteItem(index=MetadataIndex(key, torch.Size(piece.offsets)), type=WriteItemType.SHARD,
                                tensor_data=TensorWriteData(
                                    chunk=ChunkStorageMetadata(offsets=torch.Size(piece.offsets),
                                                               sizes=torch.Size(piece.sizes)),
                                    properties=TensorProperties.create_from_tensor(tensor),
                                    size=torch.Size(piece.global_shape)))
                      for key, entries in pieces.items() for piece, tensor in entries]

    def create_local_plan(self) -> SavePlan:
        self.plan = SavePlan(self.items)
        return self.plan

    def resolve_data(self, write_item: WriteItem):
        return self.pieces[(write_item.index.fqn, tuple(write_item.index.offset))]


class _PieceLoadPlanner(DefaultLoadPlanner):
    """Reads explicitly placed boxes into the given tensors: {key: [(offsets, tensor)]}; boxes may
    overlap other ranks' (replicas read the same data)."""

    def __init__(self, pieces: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False)
        self.pieces = pieces

    def set_up_planner(self, state_dict, metadata=None, is_coordinator: bool = False) -> None:
        self.metadata, self.is_coordinator = metadata, is_coordinator
        self.state_dict, self.original_state_dict = {}, {}

    def create_local_plan(self) -> LoadPlan:
        items = []
        for key, entries in self.pieces.items():
            chunks = [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape) for off, t in entries]
            items += create_read_items_for_chunk_list(key, self.metadata.state_dict_metadata[key], chunks)
        return LoadPlan(items)

    def resolve_tensor(self, read_item):
        tensor = self.pieces[read_item.dest_index.fqn][read_item.dest_index.index][1]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            tensor = tensor.narrow(dim, start, length)
        return tensor

    def commit_tensor(self, read_item, tensor) -> None:
        pass  # resolve_tensor returned a view of the destination, already filled


@contextlib.contextmanager
def _plain_errors(doing: str):
    """DCP raises CheckpointException, a BaseException carrying every rank's failure: turn it into a
    RuntimeError naming the first failed rank, so the worker's error handling reports it."""
    try:
        yield
    except CheckpointException as exc:
        rank, (error, _) = min(exc.failures.items()) if exc.failures else (-1, (exc, None))
        raise RuntimeError(f"{doing} failed on rank {rank}: {type(error).__name__}: {error}") from None


# --- save ----------------------------------------------------------------------------------------------------
def _writes_params(*, plan: Plan, dp_rank: int) -> bool:
    """DP positions q >= s_os hold copies of the optimizer chunks of positions q < s_os."""
    return dp_rank < plan.shard_degrees[2]


def save_pieces(trainer, *, plan: Plan) -> dict[str, list[tuple[Piece, torch.Tensor]]]:
    """This rank's owned boxes of the master weights and Adam moments, as tensors to write: of the dense
    parameters, and of an MoE model's experts (each EP rank its own, expert-DP replicas nothing)."""
    out: dict[str, list[tuple[Piece, torch.Tensor]]] = {}
    for view in engine_views(trainer, plan):
        if _writes_params(plan=view.plan, dp_rank=view.shard_rank):
            _save_engine_pieces(trainer, view, out, tp=plan.tp)
    return out


def _save_engine_pieces(trainer, view: EngineView, out: dict, *, tp: int) -> None:
    from runners.transformer import LMHead

    mesh = trainer.mesh
    state = view.engine.local_state(copy=False)  # the live shards: each piece is copied to host once
    for i, layout in enumerate(unit_layouts(trainer.chunks, plan=view.plan, dp_rank=view.shard_rank,
                                            experts=view.experts)):
        start, stop = layout.optim_range
        assert state[f"unit{i}.master"].numel() == stop - start, "checkpoint layout disagrees with the engine's shards"
        if isinstance(layout.module, LMHead) and trainer.cfg.model.tied_embeddings:
            continue  # a tied head is a copy of the embedding (the trainer keeps them equal): written once
        for piece in pieces_in_range(layout.params, start=start, stop=stop, tp_rank=mesh.tp_rank, tp=tp,
                                     ep_rank=trainer.ep.rank, ep=trainer.ep.size, etp_rank=trainer.ep.etp_rank,
                                     etp=trainer.ep.etp_size):
            if piece.tp_replicated and mesh.tp_rank != 0:  # never an expert's: EP splits those
                continue
            lo, hi = piece.flat_start - start, piece.flat_start - start + piece.numel
            for prefix, key in (("model", "master"), ("optim/exp_avg", "exp_avg"), ("optim/exp_avg_sq", "exp_avg_sq")):
                tensor = state[f"unit{i}.{key}"][lo:hi].reshape(piece.sizes).to("cpu", copy=True)
                out.setdefault(f"{prefix}/{piece.name}", []).append((piece, tensor))


def _rng_state_b64() -> str:
    return base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode()


def save_checkpoint(trainer, cfg, *, step: int, keep: int = 2, records: tuple[StepRecord, ...] = ()) -> Path:
    """Write the checkpoint after `step` optimizer steps (collective over every rank); returns its folder.
    `records`: the steps trained since the previous checkpoint (kept in its metadata)."""
    root = Path(cfg.checkpoint_dir)
    rank = dist.get_rank()
    tmp = root / (step_dir_name(step) + ".tmp")
    final = root / step_dir_name(step)
    if rank == 0:
        root.mkdir(parents=True, exist_ok=True)
        if tmp.exists():  # the leftover of a write that was killed
            shutil.rmtree(tmp)
        tmp.mkdir()
    rng: list[str] = [None] * dist.get_world_size()  # type: ignore[list-item]
    dist.all_gather_object(rng, _rng_state_b64())  # also orders every rank after the mkdir
    pieces = save_pieces(trainer, plan=cfg.plan)
    with _plain_errors(f"writing checkpoint {tmp}"):
        dcp.save({}, storage_writer=_Writer(tmp, single_file_per_rank=True, sync_files=True, step=step),
                 planner=_PieceSavePlanner(pieces))
    # dcp.save returns on every rank only after the coordinator wrote .metadata, i.e. every rank's data is on disk.
    if rank == 0:
        meta = CheckpointMeta(step=step, seed=cfg.seed, model=cfg.model, job=cfg.job, data=cfg.data, plan=cfg.plan,
                              world_size=dist.get_world_size(), rng_states=tuple(rng), records=tuple(records))
        write_json_atomic(tmp / META_FILE, meta.to_dict())
        if final.exists():  # a resumed run writing a step again: replace the older copy
            old = root / (step_dir_name(step) + ".old")
            shutil.rmtree(old, ignore_errors=True)
            final.rename(old)
            tmp.rename(final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(final)
        _fsync_dir(root)
        _write_latest(root, final.name)
        _prune(root, keep=keep)
    dist.barrier()
    return final


PAUSE_ENV = "PLANNER_TEST_CHECKPOINT_PAUSE"


class _Writer(FileSystemWriter):
    """DCP's file writer, with a test hook: PLANNER_TEST_CHECKPOINT_PAUSE=STEP:SECONDS makes every rank
    wait that long after writing its data files of checkpoint STEP and before the collective that
    finishes the write, so a test can kill a node in the middle of a checkpoint write (first attempt
    only). Unset (always, outside tests) it is FileSystemWriter."""

    def __init__(self, *args, step: int, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.pause_s = _pause_seconds(step)
        self.step = step

    def write_data(self, plan, planner):
        written = super().write_data(plan, planner)
        if self.pause_s > 0:
            import time

            written.wait()
            time.sleep(self.pause_s)
        return written


def _pause_seconds(step: int) -> float:
    """The test hook's pause for checkpoint `step`; only in a run's first attempt (its restarts write the
    step again without pausing)."""
    value = os.environ.get(PAUSE_ENV, "")
    at, _, seconds = value.partition(":")
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    return float(seconds) if value and int(at) == step and first_attempt else 0.0


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_latest(root: Path, name: str) -> None:
    tmp = root / (LATEST_FILE + ".tmp")
    with open(tmp, "w") as f:
        f.write(name + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST_FILE)
    _fsync_dir(root)


def _prune(root: Path, *, keep: int) -> None:
    """Delete complete checkpoints older than the newest `keep` (never the one `latest` names)."""
    steps = sorted(_complete_steps(root), reverse=True)
    for step in steps[keep:]:
        shutil.rmtree(root / step_dir_name(step), ignore_errors=True)


# --- find and load -------------------------------------------------------------------------------------------
def _is_complete(folder: Path) -> bool:
    return (folder / DCP_METADATA_FILE).is_file() and (folder / META_FILE).is_file()


def _complete_steps(root: Path) -> list[int]:
    steps = []
    if root.is_dir():
        for entry in root.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and entry.is_dir() and _is_complete(entry):
                steps.append(int(match.group(1)))
    return steps


def find_latest(root: str | Path) -> Path | None:
    """The checkpoint `latest` names if it is complete, else the newest complete one, else None."""
    root = Path(root)
    if root.exists() and not root.is_dir():
        raise PlannerError(f"checkpoint dir {root} is not a directory")
    pointer = root / LATEST_FILE
    if pointer.is_file():
        name = pointer.read_text().strip()
        if _STEP_DIR.match(name) and _is_complete(root / name):
            return root / name
        log.warning("checkpoint pointer %s names %r, which is not a complete checkpoint; using the newest complete one",
                    pointer, name)
    steps = _complete_steps(root)
    return root / step_dir_name(max(steps)) if steps else None


def load_pieces(trainer, *, plan: Plan):
    """Destination buffers this rank needs: for each unit of each engine, the fp32 master over its parameter
    shard (compute parameters are cast from it) and the Adam moments over its optimizer shard."""
    mesh = trainer.mesh
    wanted: dict[str, list[tuple[tuple[int, ...], torch.Tensor]]] = {}
    buffers = []
    for view in engine_views(trainer, plan):
        for layout in unit_layouts(trainer.chunks, plan=view.plan, dp_rank=view.shard_rank, experts=view.experts):
            bufs = {"model": torch.zeros(layout.param_range[1] - layout.param_range[0]),
                    "exp_avg": torch.zeros(layout.optim_range[1] - layout.optim_range[0]),
                    "exp_avg_sq": torch.zeros(layout.optim_range[1] - layout.optim_range[0])}
            for kind, (start, stop) in (("model", layout.param_range), ("exp_avg", layout.optim_range),
                                        ("exp_avg_sq", layout.optim_range)):
                key_prefix = "model" if kind == "model" else f"optim/{kind}"
                for piece in pieces_in_range(layout.params, start=start, stop=stop, tp_rank=mesh.tp_rank, tp=plan.tp,
                                             ep_rank=trainer.ep.rank, ep=trainer.ep.size,
                                             etp_rank=trainer.ep.etp_rank, etp=trainer.ep.etp_size):
                    lo = piece.flat_start - start
                    box = bufs[kind][lo:lo + piece.numel].view(piece.sizes)
                    wanted.setdefault(f"{key_prefix}/{piece.name}", []).append((piece.offsets, box, piece.global_shape))
            buffers.append((view.engine, layout, bufs))
    return wanted, buffers


def _check_against_metadata(folder: Path, wanted: dict) -> None:
    """Every tensor this rank needs must be in the checkpoint with the same global shape."""
    try:
        metadata = FileSystemReader(folder).read_metadata()
    except Exception as exc:  # a truncated or foreign .metadata file
        raise PlannerError(f"checkpoint {folder}: cannot read its DCP metadata ({type(exc).__name__}: {exc})") from None
    for key, entries in wanted.items():
        md = metadata.state_dict_metadata.get(key)
        if not isinstance(md, TensorStorageMetadata):
            raise PlannerError(f"checkpoint {folder} has no tensor {key!r}")
        shape = entries[0][2]
        if tuple(md.size) != tuple(shape):
            raise PlannerError(f"checkpoint {folder}: {key} has shape {tuple(md.size)}, this model needs {tuple(shape)}")


def restore_checkpoint(trainer, cfg, folder: Path) -> CheckpointMeta:
    """Load `folder` into the trainer (collective over every rank); returns its metadata (`.step`: the
    step to continue from)."""
    meta = load_meta(folder)
    meta.check_compatible(cfg)
    wanted, buffers = load_pieces(trainer, plan=cfg.plan)
    _check_against_metadata(folder, wanted)
    with _plain_errors(f"reading checkpoint {folder}"):
        dcp.load({}, storage_reader=FileSystemReader(folder),
                 planner=_PieceLoadPlanner({k: [(off, t) for off, t, _ in v] for k, v in wanted.items()}))
    for engine in trainer.engines:
        state = engine.local_state(copy=False)  # only read for dtypes; replaced below
        state["num_steps"] = torch.tensor(meta.step)
        for i, (layout, bufs) in enumerate((layout, bufs) for e, layout, bufs in buffers if e is engine):
            o_lo = layout.optim_range[0] - layout.param_range[0]
            master = bufs["model"][o_lo:o_lo + layout.optim_range[1] - layout.optim_range[0]]
            state[f"unit{i}.param_shard"] = bufs["model"].to(state[f"unit{i}.param_shard"].dtype)
            state[f"unit{i}.master"] = master.clone()
            state[f"unit{i}.exp_avg"] = bufs["exp_avg"]
            state[f"unit{i}.exp_avg_sq"] = bufs["exp_avg_sq"]
        engine.load_local_state(state)
    _restore_rng(meta, rank=dist.get_rank())
    return meta


def _restore_rng(meta: CheckpointMeta, *, rank: int) -> None:
    """Rank r takes saved rank r's generator state (r modulo the saving world size under another plan:
    no trained module draws random numbers, so only the sequence a user's code would see is restored)."""
    raw = base64.b64decode(meta.rng_states[rank % meta.world_size])
    try:
        torch.set_rng_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
    except RuntimeError as exc:
        raise PlannerError(f"checkpoint RNG state of rank {rank % meta.world_size} is not a torch generator state: {exc}") from None


def resume_requested(cfg) -> bool:
    """Resume from the newest checkpoint when asked to, when torchrun restarted this worker, or always in
    an elastic run (a restart for a node that joined keeps torchrun's restart count, and the joining
    node's own count starts at 0)."""
    return bool(cfg.checkpoint_dir) and (cfg.resume or bool(cfg.elastic_plans)
                                         or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0)


def remove_partial_writes(root: str | Path) -> list[Path]:
    """Delete the `.tmp` folders of checkpoint writes that were killed (call when no rank is writing:
    before a run's first step). Returns what it removed."""
    root = Path(root)
    partial = [p for p in root.glob("step-*.tmp") if p.is_dir()] + [p for p in root.glob("step-*.old") if p.is_dir()]
    for folder in partial:
        shutil.rmtree(folder, ignore_errors=True)
    return partial


def maybe_restore(trainer, cfg) -> tuple[int, tuple[StepRecord, ...]]:
    """(the step to start from, the records of the steps the checkpoint trained since the one before it):
    the checkpoint's if resuming from one, else (0, ()). Rank 0 picks the folder and broadcasts it, so
    every rank loads the same one even while files change."""
    if not resume_requested(cfg):
        return 0, ()
    choice = [None]
    if dist.get_rank() == 0:
        for folder in remove_partial_writes(cfg.checkpoint_dir):
            log.warning("removed %s, a checkpoint write that did not finish", folder)
        found = find_latest(cfg.checkpoint_dir)
        choice = [str(found) if found is not None else None]
    dist.broadcast_object_list(choice, src=0)
    if choice[0] is None:
        if dist.get_rank() == 0 and (cfg.resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0):
            log.warning("no complete checkpoint in %s; starting from step 0", cfg.checkpoint_dir)
        return 0, ()
    meta = restore_checkpoint(trainer, cfg, Path(choice[0]))
    return meta.step, meta.records


def save_due(cfg, *, step: int) -> bool:
    """Whether to checkpoint after `step` optimizer steps: every `checkpoint_every`, and at the end."""
    if not cfg.checkpoint_dir:
        return False
    every = cfg.checkpoint_every
    return step == cfg.steps or (every > 0 and step % every == 0)
