"""Published measured training runs (benchmarks/published/) priced by the cost model.

    planner validate --published                       # the repo's set, every row with use=yes
    planner validate --published runs.csv --format json

Each row is a run a paper, an engine's README or a benchmark page reports with its parallel layout,
batch and measured throughput (columns in benchmarks/published/SOURCES.md). A row becomes the model,
cluster, job and plan it describes, priced as its engine runs it (`engine` of cost_models.estimate),
and its measured throughput becomes a step time: tokens per second per GPU directly, TFLOP/s per GPU
through the FLOP count the source states it used (`FLOP_CONVENTIONS`).

Agreement (planner.reports.Agreement's definitions, over the rows priced):
  mape              mean |predicted - measured| / measured over all rows
  kendall_tau       Kendall's tau-b between predicted and measured seconds per token (rows differ in batch
                    and sequence length, so throughput is what compares them) within each group of rows of
                    one model on one cluster (same GPU type and count), averaged over the groups with at
                    least three rows
  regret            per group, the measured seconds per token of the row the model ranks fastest over the
                    group's fastest measured row, minus 1; the worst group is reported (and the mean)
  loso_mape         leave-one-source-out: the hardware's free efficiency parameters fitted on every other
                    source (planner/calibrate.py's least squares), then the held-out source's MAPE; the
                    mean over sources
"""

from __future__ import annotations

import csv
import dataclasses
import math
import statistics

import numpy as np
from dataclasses import dataclass, field
from pathlib import Path

from planner.reports import kendall_tau
from specs.cluster import Cluster
from specs.errors import PlannerError
from specs.hardware import PRESETS as HARDWARE, LinkSpec
from specs.job import Job
from specs.model import PRESETS, ModelSpec
from specs.plan import Plan, check_plan, zero_degrees
from cost_models.engines import ENGINES, RECOMPUTE_MODULES, EngineModel
from cost_models.moe import DISPATCHERS

PUBLISHED_DIR = Path(__file__).resolve().parents[1] / "benchmarks" / "published"
DEFAULT_CSV = PUBLISHED_DIR / "dense_runs.csv"

# The CSV's hardware labels and the presets they are priced on.
HARDWARE_OF = {"a100-40gb": "a100-40gb", "a100-80gb": "a100", "h100-sxm": "h100", "h200": "h200"}
# Each source's engine and the engine the cost model prices it as (cost_models.estimate ENGINES).
ENGINE_OF = {"megatron": "megatron", "nemo": "megatron", "deepspeed": "deepspeed",
             "llm-foundry/composer-fsdp": "fsdp", "torchtitan": "torchtitan"}
# How a source counts the FLOPs behind a TFLOP/s figure: "model" (forward + 2x backward, attention over the
# full square, logits included, no recomputation: Megatron's num_floating_point_operations, Narayanan et
# al. 2021 without the recompute term) or "hardware" (the same plus the recomputed forward of every layer
# under full recomputation: Megatron-DeepSpeed's and SC21's 96 B s l h^2 (...) count).
FLOP_CONVENTIONS = {"megatron_readme_h100": "model", "bloom_tr11_prequel": "hardware", "bloom_tr11_readme": "hardware",
                    # Megatron-Core's MoE ModelZoo (2025-26 code) prints Megatron's num_floating_point_operations
                    # as it is since 2025: causal attention counted as half the square, the k routed and the
                    # shared experts, no router (`megatron_core_flops_per_step`); its printed step times
                    # (the CSV's step_time_s) agree with it to 0.5%, with the full square not (13% off at 4k).
                    "mcore_moe_modelzoo_qwen3": "megatron-core"}
# MoE rows whose model is a preset (its config.json has what the CSV's columns cannot say: Qwen3's
# head_dim and qk norm, DeepSeek-V3's MLA and dense layers).
MOE_PRESET_OF = {"Qwen3-30B-A3B": "qwen3-30b-a3b", "Qwen3-235B-A22B": "qwen3-235b-a22b", "DeepSeek-V3 671B": "deepseek-v3"}


@dataclass(frozen=True)
class PublishedRun:
    """One priced row: the problem and plan it describes, the engine that ran it, what it measured."""

    source_id: str
    label: str
    group: str  # model on cluster: rows of one group are ranked against each other
    hardware: str  # the source's label (a100-40gb, h100-sxm, ...)
    model: ModelSpec
    cluster: Cluster
    job: Job
    plan: Plan
    engine: str
    measured_step_time_s: float
    measured_peak_memory_bytes: float | None = None
    # The attention kernel the run used where the source's software version fixes it (the CSV's
    # attention_kernel: llm-foundry's tables before 2024 ran FlashAttention-1's Triton kernel); empty: the
    # engine's own.
    attention_kernel: str = ""
    # The MoE token dispatcher and EP overlap the run's recipe sets (the CSV's moe_dispatcher and
    # moe_a2a_overlap; empty: the engine's own, cost_models/engines.py).
    moe_dispatcher: str = ""
    moe_a2a_overlap: bool | None = None
    # The dtype the run reduced (and accumulated) gradients in where its source says (the CSV's reduce_dtype):
    # fp32 is the plan's reduce_fp32 knob; a 16-bit one also overrides an engine that would keep fp32 main
    # gradients (Megatron-DeepSpeed's fp16 runs before its BF16 optimizer); empty: the engine's own.
    reduce_dtype: str = ""
    # Whether the run kept its fp8 weights only as fp8 (the CSV's fp8_param_gather: Megatron's
    # --fp8-param-gather, Megatron-Bridge's fp8 mixed-precision configs); empty: the engine's own.
    fp8_param_gather: bool = False
    # The modules Megatron-Core's selective recomputation repeats where the source names them (the CSV's
    # recompute "partial:..."; empty: the engine's own, the attention core).
    recompute_modules: tuple[str, ...] = ()

    @property
    def priced_engine(self) -> str | EngineModel:
        """The engine as this run ran it: its name, or a variant with the run's attention kernel, MoE
        dispatch and 16-bit gradients."""
        changes = {k: v for k, v in (("attention", self.attention_kernel), ("moe_dispatcher", self.moe_dispatcher),
                                     ("moe_a2a_overlap", self.moe_a2a_overlap),
                                     ("recompute_modules", self.recompute_modules)) if v not in ("", None, ())}
        if self.reduce_dtype in ("bf16", "fp16"):
            changes.update(reduce_fp32=False, main_grads_fp32=False)
        if self.fp8_param_gather:
            changes.update(fp8_param_gather=True)
        return dataclasses.replace(ENGINES[self.engine], **changes) if changes else self.engine


@dataclass(frozen=True)
class PublishedRow:
    """A priced row's prediction beside its measurement."""

    source_id: str
    label: str
    group: str
    hardware: str
    predicted_step_time_s: float
    measured_step_time_s: float
    tokens_per_step: int = 1

    @property
    def predicted_s_per_token(self) -> float:
        return self.predicted_step_time_s / self.tokens_per_step

    @property
    def measured_s_per_token(self) -> float:
        return self.measured_step_time_s / self.tokens_per_step

    @property
    def error(self) -> float:
        return self.predicted_step_time_s / self.measured_step_time_s - 1


@dataclass(frozen=True)
class PublishedReport:
    num_rows: int
    mape: float
    kendall_tau: float | None
    regret: float | None  # the worst group's
    mean_regret: float | None
    loso_mape: float | None
    per_source: dict[str, dict[str, float]] = field(default_factory=dict)
    rows: tuple[PublishedRow, ...] = ()
    skipped: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        out = dataclasses.asdict(self)
        out["rows"] = [{**dataclasses.asdict(r), "error": r.error} for r in self.rows]
        return out


# --- loading --------------------------------------------------------------------------------------------
def _int(row: dict, key: str, default: int | None = None) -> int:
    value = (row.get(key) or "").strip()
    if not value:
        if default is None:
            raise PlannerError(f"column {key!r} is empty")
        return default
    return int(float(value))


def _model(row: dict) -> ModelSpec:
    name = (row.get("model") or "").strip()
    if name:
        # A user's runs file names the model as `planner search --model` does: a preset or a config.json.
        from specs.model import resolve_model

        return resolve_model(name)
    num_experts = _int(row, "num_experts", 0)
    if num_experts and row.get("model_name") in MOE_PRESET_OF:
        preset = PRESETS[MOE_PRESET_OF[row["model_name"]]]
        # The source trained at its seq_len (Qwen3 with YaRN rope scaling past its 40,960 positions).
        return dataclasses.replace(preset, max_seq_len=max(preset.max_seq_len, _int(row, "seq_len")),
                                   load_balancing=_load_balancing(row, preset.load_balancing))
    # An MoE model outside the presets: a llama block (SwiGLU experts) with the CSV's expert columns.
    arch = "llama" if num_experts else row["arch"] if row["arch"] in ("llama", "gpt2") else "gpt2"
    hidden, heads = _int(row, "hidden_size"), _int(row, "num_heads")
    seq = _int(row, "seq_len")
    expert_ffn = _int(row, "moe_ffn_hidden_size", 0) if num_experts else 0
    ffn = _int(row, "ffn_hidden_size", expert_ffn or 4 * hidden)
    moe = dict(num_experts=num_experts, num_experts_per_token=_int(row, "top_k"), expert_ffn_hidden_size=expert_ffn,
               shared_expert_ffn_hidden_size=_int(row, "shared_experts", 0) * expert_ffn,
               load_balancing=_load_balancing(row, "aux_loss")) if num_experts else {}
    # head_dim: a width the source's config sets apart from hidden / heads (GPT-OSS: 64 x 64 heads on 2880).
    return ModelSpec(name=row["model_name"], arch=arch, num_layers=_int(row, "num_layers"), hidden_size=hidden,
                     num_heads=heads, num_kv_heads=_int(row, "num_kv_heads", heads), ffn_hidden_size=ffn,
                     vocab_size=_int(row, "vocab_size", 50257), max_seq_len=max(seq, 2048),
                     tied_embeddings=arch == "gpt2", attention_head_dim=_int(row, "head_dim", 0), **moe)


# The zoo's shorthand in its recompute column ("norm, act") for Megatron-Core's module names.
MODULE_ALIASES = {"norm": "layernorm", "act": "moe_act"}


def _recompute_modules(row: dict) -> tuple[str, ...]:
    """The modules of a "partial:a, b" recompute cell (Megatron-Core --recompute-modules), in a fixed order;
    () for any other cell."""
    cell = (row.get("recompute") or "").strip().lower()
    if not cell.startswith("partial:"):
        return ()
    names = {MODULE_ALIASES.get(n.strip(), n.strip()) for n in cell.split(":", 1)[1].split(",") if n.strip()}
    unknown = sorted(names - set(RECOMPUTE_MODULES))
    if unknown:
        raise PlannerError(f"recompute module {unknown[0]!r} is not priced; priced: {', '.join(RECOMPUTE_MODULES)}")
    return tuple(m for m in RECOMPUTE_MODULES if m in names)


def _load_balancing(row: dict, trained: str) -> str:
    """The routing a run's expert loads follow (ModelSpec.load_balancing): "forced" where the source says it
    forced the balance (NeMo's and Megatron-Bridge's footnote, the zoo's --moe-router-force-load-balancing)
    or does not say, the model's own trained router (`trained`) only where it says dropless and nothing
    more, so an unstated run keeps the balanced price rather than a guessed imbalance."""
    routing = (row.get("capacity_factor_or_dropless") or "").strip().lower()
    return trained if routing.startswith("dropless") and "force" not in routing else "forced"


def _cluster(row: dict, hardware=None) -> Cluster:
    if hardware is None:
        if row.get("hardware") not in HARDWARE_OF:
            raise PlannerError(f"hardware {row.get('hardware')!r} has no preset")
        hardware = HARDWARE[HARDWARE_OF[row["hardware"]]]
    gbit = (row.get("inter_node_gbit_per_gpu") or "").strip()
    if gbit:
        link = LinkSpec(bandwidth_bytes_per_s=float(gbit) * 1e9 / 8, latency_s=hardware.inter_node.latency_s)
        hardware = dataclasses.replace(hardware, inter_node=link)
    gpus = _int(row, "num_gpus")
    per_node = min(gpus, _int(row, "gpus_per_node", 8))
    return Cluster(num_nodes=gpus // per_node, devices_per_node=per_node, hardware=hardware)


def _shards(sharding: str, dp: int, engine: str) -> tuple[int, int, int]:
    sharding = sharding.strip().lower()
    if sharding.startswith("zero3") or sharding == "full_shard":
        return zero_degrees(3, dp)
    if sharding == "zero2":
        return zero_degrees(2, dp)
    if sharding == "zero1":
        return zero_degrees(1, dp)
    if sharding == "distributed-optimizer" or (sharding == "" and engine == "megatron"):
        # Megatron's distributed optimizer (NeMo's default): gradients reduce-scattered, optimizer sharded.
        return zero_degrees(2, dp)
    return zero_degrees(0, dp)


# The CSV's cp_comm_type (Megatron-LM's --cp-comm-type names) and the plan's cp_kind. Megatron's
# "allgather" (K/V all-gathered once, then local attention) has no kind of its own here: not priced.
CP_KIND_OF = {"": "ring", "p2p": "ring", "ring": "ring", "a2a": "all-to-all", "all-to-all": "all-to-all",
              "a2a+p2p": "hierarchical", "hierarchical": "hierarchical"}
# A row's attention_kernel column (empty: the engine's own kernel).
ATTENTION_KERNELS = ("", "flash1", "flash2", "flash3", "materialized")
# A row's reduce_dtype column (empty: the engine's own; bf16 / fp16: 2-byte gradients whatever the engine
# would keep).
REDUCE_DTYPES = ("", "fp32", "bf16", "fp16")
# Sources that print a local batch (sequences per data-parallel rank per step) instead of a global one:
# torchtitan's `training.local_batch_size`, micro-batched into pipeline micro-batches of 1 sequence
# (its default pipeline micro-batch size).
LOCAL_BATCH_OF = {"torchtitan_bench_h100_2412": {"Llama 3.1 8B": 1, "Llama 3.1 405B": 8}}


def _batch(row: dict, *, dp: int, pp: int) -> tuple[int, int]:
    """(micro-batch, global batch) in sequences, from the row or its source's local-batch convention."""
    local = LOCAL_BATCH_OF.get(row.get("source_id", ""), {}).get(row.get("model_name", ""))
    if local is not None and not (row.get("global_batch") or "").strip():
        micro_batch = _int(row, "micro_batch", 1 if pp > 1 else local)
        return micro_batch, local * dp
    micro_batch = _int(row, "micro_batch", 1)
    return micro_batch, _int(row, "global_batch", micro_batch * dp)


def _plan(row: dict, engine: str) -> Plan:
    tp, pp, dp = _int(row, "tp", 1), _int(row, "pp", 1), _int(row, "dp")
    cp = _int(row, "cp", 1)
    comm_type = (row.get("cp_comm_type") or "").strip().lower()
    if comm_type not in CP_KIND_OF:
        raise PlannerError(f"cp_comm_type {comm_type!r} is not priced; priced: p2p, a2a, a2a+p2p")
    vp = _int(row, "virtual_stages", 1)
    micro_batch, global_batch = _batch(row, dp=dp, pp=pp)
    if global_batch % (dp * micro_batch):
        raise PlannerError(f"global batch {global_batch} is not a multiple of dp x micro-batch {dp} x {micro_batch}")
    # Megatron-based engines turn sequence parallelism on with TP (NeMo's and the README's runs say so).
    sp = row.get("sequence_parallel", "").strip().lower()
    sequence_parallel = tp > 1 and (sp == "true" or (sp == "" and engine == "megatron"))
    recompute = (row.get("recompute") or "").strip().lower() or "none"
    # Megatron-Core's recomputation of named modules (--recompute-modules layernorm moe_act): the selective
    # policy, with the modules the engine variant carries (`_recompute_modules`).
    recompute = "selective" if recompute.startswith("partial") else recompute
    recompute = recompute if recompute in ("none", "selective", "full") else "full"
    s_p, s_g, s_os = _shards(row.get("sharding", ""), dp * cp, engine)
    # The dtype the run reduced gradients in where its source says (llm-foundry's "FSDP MP Mode": Composer's
    # DEFAULT reduces in fp32, PURE in the compute dtype); empty: the engine's own.
    reduce_dtype = (row.get("reduce_dtype") or "").strip().lower()
    if reduce_dtype not in REDUCE_DTYPES:
        raise PlannerError(f"reduce_dtype {reduce_dtype!r} is not priced; priced: {', '.join(REDUCE_DTYPES[1:])}")
    return Plan(dp=dp, cp=cp, cp_kind=CP_KIND_OF[comm_type], tp=tp, pp=pp, virtual_stages=vp, micro_batch=micro_batch,
                num_micro_batches=global_batch // (dp * micro_batch),
                schedule="interleaved-1f1b" if vp > 1 else "1f1b", recompute=recompute,
                sequence_parallel=sequence_parallel, param_shard=s_p, grad_shard=s_g, optim_shard=s_os,
                ep=_int(row, "expert_parallel", 1), etp=_int(row, "expert_tensor_parallel", 1),
                reduce_fp32=reduce_dtype == "fp32")


def megatron_core_flops_per_step(model: ModelSpec, *, global_batch: int, seq_len: int) -> float:
    """Megatron-Core's num_floating_point_operations (megatron/training/training.py, 2025+; Megatron-Bridge's
    flop_utils.py the same): 3 x 2 x 2 per multiply-add pair of GEMMs, the attention square halved (causal),
    the dense and the routed (k experts) and shared-expert MLPs at 3/2 for SwiGLU, MLA's projections by
    its ranks, the logits; no router, no recomputation."""
    h, n, L = model.hidden_size, model.num_heads, model.num_layers
    glu = 1.5 if model.gated_mlp else 1.0
    dense_layers = L - model.num_moe_layers if model.is_moe else L
    mlp = 12 * h * glu * (dense_layers * model.ffn_hidden_size + model.num_moe_layers * (
        model.num_experts_per_token * model.expert_ffn_hidden_size + model.shared_expert_ffn_hidden_size))
    if model.uses_mla:
        qk, rope, v = model.qk_nope_head_dim, model.qk_rope_head_dim, model.v_head_dim
        q = h * n * (qk + rope) if not model.q_lora_rank else model.q_lora_rank * (h + n * (qk + rope) + 1)
        attn = 6 * L * (q + model.kv_lora_rank * (h + n * (qk + v) + 1) + h * rope + n * v * h
                        + seq_len * n * (qk + rope) / 2 + seq_len * n * v / 2)
    else:
        q_dim = n * model.head_dim
        attn = 12 * L * h * h * (1 + model.num_kv_heads / n + seq_len / h / 2) * q_dim / h
    return global_batch * seq_len * (mlp + attn + 6 * h * model.vocab_size)


def _measured_step_time_s(row: dict, *, model: ModelSpec, job: Job, plan: Plan, num_gpus: int) -> float:
    from cost_models.compute import model_flops_per_step

    if (row.get("step_time_s") or "").strip():
        return float(row["step_time_s"])
    metric, value = row["measured_metric"], float(row["measured_value"])
    tokens = job.global_batch * job.seq_len
    if metric == "tokens_per_s_per_gpu":
        return tokens / (value * num_gpus)
    if metric == "tflops_per_gpu":
        convention = FLOP_CONVENTIONS.get(row["source_id"])
        if convention is None:
            raise PlannerError(f"source {row['source_id']} reports TFLOP/s with no known FLOP convention")
        if convention == "megatron-core":
            return megatron_core_flops_per_step(model, global_batch=job.global_batch, seq_len=job.seq_len) / (
                value * 1e12 * num_gpus)
        policies = (plan.recompute,) * model.num_layers if convention == "hardware" else None
        flops = model_flops_per_step(model, global_batch=job.global_batch, seq_len=job.seq_len,
                                     recompute_layers=policies)
        return flops / (value * 1e12 * num_gpus)
    raise PlannerError(f"unknown measured_metric {metric!r}")


def _run(row: dict, *, hardware=None) -> PublishedRun:
    engine_name = (row.get("engine") or "").strip()
    engine = ENGINE_OF.get(engine_name, engine_name if engine_name in ENGINES else None)
    if engine is None:
        raise PlannerError(f"engine {engine_name!r} has no pricing; engines: {', '.join(ENGINES)}")
    model, cluster = _model(row), _cluster(row, hardware)
    plan = _plan(row, engine)
    precision = (row.get("precision") or "bf16").strip() or "bf16"
    job = Job(global_batch=plan.global_batch, seq_len=_int(row, "seq_len"), precision=precision)
    check_plan(plan, model=model, num_devices=cluster.num_devices, job=job)
    measured = _measured_step_time_s(row, model=model, job=job, plan=plan, num_gpus=cluster.num_devices)
    if not measured > 0:
        raise PlannerError(f"measured step time must be positive, got {measured}")
    source = (row.get("source_id") or "").strip() or "runs"
    label_hw = row.get("hardware") or cluster.hardware.name
    group = f"{model.name} on {cluster.num_devices} x {label_hw} ({source})"
    label = f"{model.name} {cluster.num_devices}x{label_hw} {plan.describe()}"
    peak = (row.get("peak_memory_gib") or "").strip()
    kernel = (row.get("attention_kernel") or "").strip()
    if kernel not in ATTENTION_KERNELS:
        raise PlannerError(f"attention_kernel {kernel!r} is not priced; priced: {', '.join(ATTENTION_KERNELS[1:])}")
    dispatcher = (row.get("moe_dispatcher") or "").strip().lower()
    if dispatcher and dispatcher not in DISPATCHERS:
        raise PlannerError(f"moe_dispatcher {dispatcher!r} is not priced; priced: {', '.join(DISPATCHERS)}")
    overlap = (row.get("moe_a2a_overlap") or "").strip().lower()
    if overlap not in ("", "true", "false"):
        raise PlannerError(f"moe_a2a_overlap must be true, false or empty, got {overlap!r}")
    fp8_params = (row.get("fp8_param_gather") or "").strip().lower()
    if fp8_params not in ("", "true", "false"):
        raise PlannerError(f"fp8_param_gather must be true, false or empty, got {fp8_params!r}")
    return PublishedRun(source_id=source, label=label, group=group, hardware=label_hw, model=model,
                        cluster=cluster, job=job, plan=plan, engine=engine, measured_step_time_s=measured,
                        measured_peak_memory_bytes=float(peak) * 1024**3 if peak else None,
                        attention_kernel=kernel, moe_dispatcher=dispatcher,
                        moe_a2a_overlap=None if not overlap else overlap == "true",
                        reduce_dtype=(row.get("reduce_dtype") or "").strip().lower(),
                        fp8_param_gather=fp8_params == "true", recompute_modules=_recompute_modules(row))


def load_published(path: str | Path = DEFAULT_CSV, *, hardware=None,
                   strict: bool = False) -> tuple[list[PublishedRun], list[str]]:
    """The rows marked use=yes (or with no use column) as runs, and a line for each such row that cannot
    be priced; `hardware` prices every row on that profile instead of the row's preset; `strict` raises
    on the first bad row instead (a user's own runs file)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"cannot read runs file {path}: {exc}") from None
    reader = csv.DictReader(line for line in lines if not line.startswith("#"))
    runs, skipped = [], []
    try:
        for i, row in enumerate(reader, 1):
            if None in row or None in row.values():
                raise PlannerError(f"{path}: row {i} does not have the header's columns")
            if (row.get("use") or "yes").strip() != "yes":
                continue
            try:
                runs.append(_run(row, hardware=hardware))
            except (PlannerError, ValueError, KeyError) as exc:
                why = f"missing column {exc}" if isinstance(exc, KeyError) else str(exc)
                if strict:
                    raise PlannerError(f"{path}: row {i}: {why}") from None
                skipped.append(f"row {i} ({row.get('source_id') or row.get('model')}, {row.get('model_name', '')}): {why}")
    except csv.Error as exc:
        raise PlannerError(f"{path} is not a readable CSV: {exc}") from None
    if not runs:
        raise PlannerError(f"{path}: no row could be priced" + (f" ({skipped[0]})" if skipped else ""))
    return runs, skipped


# --- pricing and agreement -----------------------------------------------------------------------------
def price(run: PublishedRun, *, hardware=None, calibration: dict[str, float] | None = None) -> float:
    """Predicted step time of `run` as its engine runs it, on its cluster (or `hardware` with the run's
    inter-node link), with `calibration` merged into the hardware's."""
    from cost_models.estimate import estimate

    hw = run.cluster.hardware if hardware is None else dataclasses.replace(
        hardware, inter_node=run.cluster.hardware.inter_node)
    if calibration:
        hw = dataclasses.replace(hw, calibration={**hw.calibration, **calibration})
    cluster = dataclasses.replace(run.cluster, hardware=hw)
    return estimate(run.plan, model=run.model, cluster=cluster, job=run.job, engine=run.priced_engine).step_time_s


def _groups(rows: list[PublishedRow]) -> dict[str, list[PublishedRow]]:
    out: dict[str, list[PublishedRow]] = {}
    for r in rows:
        out.setdefault(r.group, []).append(r)
    return out


def agreement(rows: list[PublishedRow]) -> dict:
    """mape, the mean within-group Kendall tau, and the worst and mean within-group regret."""
    taus, regrets = [], []
    for members in _groups(rows).values():
        if len(members) >= 3:
            tau = kendall_tau([r.predicted_s_per_token for r in members], [r.measured_s_per_token for r in members])
            if tau is not None:
                taus.append(tau)
        if len(members) >= 2:
            pick = min(members, key=lambda r: r.predicted_s_per_token)
            best = min(members, key=lambda r: r.measured_s_per_token)
            regrets.append(pick.measured_s_per_token / best.measured_s_per_token - 1)
    return {"mape": statistics.fmean(abs(r.error) for r in rows),
            "kendall_tau": statistics.fmean(taus) if taus else None,
            "regret": max(regrets) if regrets else None,
            "mean_regret": statistics.fmean(regrets) if regrets else None}


def validate_published(path: str | Path = DEFAULT_CSV, *, loso: bool = True) -> PublishedReport:
    """Price every usable row of `path` and report the agreement (module docstring)."""
    runs, skipped = load_published(path)
    curves = _scale_curves(runs) if loso else None
    predicted = curves[:, LOSO_SCALES.index(1.0)] if curves is not None else [price(r) for r in runs]
    rows = [PublishedRow(r.source_id, r.label, r.group, r.hardware, float(t), r.measured_step_time_s,
                         r.job.tokens_per_step) for r, t in zip(runs, predicted)]
    per_source = {}
    for source in sorted({r.source_id for r in rows}):
        mine = [r for r in rows if r.source_id == source]
        per_source[source] = {"num_rows": len(mine), "mape": statistics.fmean(abs(r.error) for r in mine),
                              "mean_error": statistics.fmean(r.error for r in mine)}
    loso_mape = None
    if curves is not None:
        loso_mape, held = leave_one_source_out(runs, curves)
        for source, value in held.items():
            per_source[source]["loso_mape"] = value
    stats = agreement(rows)
    return PublishedReport(num_rows=len(rows), mape=stats["mape"], kendall_tau=stats["kendall_tau"],
                           regret=stats["regret"], mean_regret=stats["mean_regret"], loso_mape=loso_mape,
                           per_source=per_source, rows=tuple(rows), skipped=tuple(skipped))


# The compute_time_scale values each row is priced at for the leave-one-source-out fit; between them the
# step time is interpolated (log-log), which is exact at 1.0 (the datasheet prediction).
LOSO_SCALES = (0.7, 0.85, 1.0, 1.2, 1.45, 1.75)
_FINE_SCALES = np.geomspace(LOSO_SCALES[0], LOSO_SCALES[-1], 241)


def _scale_curves(runs: list[PublishedRun]) -> np.ndarray:
    """Predicted step time of every run (rows) at every LOSO_SCALES compute_time_scale (columns)."""
    return np.array([[price(r, calibration={"compute_time_scale": c}) for c in LOSO_SCALES] for r in runs])


def _at_scale(curves: np.ndarray, scale: float) -> np.ndarray:
    logs = np.log(LOSO_SCALES)
    return np.exp(np.array([np.interp(math.log(scale), logs, np.log(row)) for row in curves]))


def fit_compute_scale(curves: np.ndarray, measured: np.ndarray) -> float:
    """The compute_time_scale (within LOSO_SCALES' range) that minimises the squared relative errors of
    these rows: the one free parameter the leave-one-source-out check fits per hardware type."""
    logs, fine = np.log(LOSO_SCALES), np.log(_FINE_SCALES)
    predicted = np.exp(np.array([np.interp(fine, logs, np.log(row)) for row in curves]))  # rows x fine
    errors = ((predicted - measured[:, None]) / measured[:, None]) ** 2
    return float(_FINE_SCALES[int(np.argmin(errors.sum(axis=0)))])


def leave_one_source_out(runs: list[PublishedRun], curves: np.ndarray) -> tuple[float | None, dict[str, float]]:
    """(mean over sources, per source) of the MAPE on each source's rows after fitting the hardware's
    free compute parameter (compute_time_scale, one per hardware type) on every other source's rows of
    that hardware type; a hardware type no other source measured keeps its datasheet value."""
    measured = np.array([r.measured_step_time_s for r in runs])
    kinds = [r.cluster.hardware.name for r in runs]
    sources = sorted({r.source_id for r in runs})
    if len(sources) < 2:
        return None, {}
    held_mape = {}
    for source in sources:
        errors = []
        for kind in sorted({k for k, r in zip(kinds, runs) if r.source_id == source}):
            train = [i for i, r in enumerate(runs) if r.source_id != source and kinds[i] == kind]
            test = [i for i, r in enumerate(runs) if r.source_id == source and kinds[i] == kind]
            scale = fit_compute_scale(curves[train], measured[train]) if train else 1.0
            predicted = _at_scale(curves[test], scale)
            errors.extend(np.abs(predicted - measured[test]) / measured[test])
        held_mape[source] = float(np.mean(errors))
    return statistics.fmean(held_mape.values()), held_mape
