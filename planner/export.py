"""`planner export`: the same plan as another engine's configuration, and what that engine cannot express.

    planner export --plan plan.json --to torchtitan
    planner export --plan plan.json --to megatron --format json
    planner export --plan plan.json --to deepspeed --out ds_config.json

Targets and the knobs they take (read from the engines' sources and docs):
- torchtitan (torchtitan/config/job_config.py): a TOML job file. [parallelism] data_parallel_replicate_degree,
  data_parallel_shard_degree (FSDP2; both > 1 is HSDP), fsdp_reshard_after_forward, tensor_parallel_degree
  (its TP always shards the norms over the sequence: sequence parallelism on), pipeline_parallel_degree,
  pipeline_parallel_schedule (GPipe, 1F1B, Interleaved1F1B), pipeline_parallel_microbatch_size,
  pipeline_parallel_layers_per_stage / pipeline_parallel_split_points; [training] local_batch_size,
  global_batch_size (gradient accumulation when larger than local x DP), seq_len, mixed_precision_param;
  [activation_checkpoint] mode (none, selective, full), selective_ac_option ("op": per-op SAC).
- Megatron-LM (megatron/training/arguments.py): command-line arguments. --tensor-model-parallel-size,
  --sequence-parallel, --pipeline-model-parallel-size, --num-layers-per-virtual-pipeline-stage,
  --decoder-first/last-pipeline-num-layers, --micro-batch-size, --global-batch-size (accumulation is
  implied), --recompute-granularity full|selective (+ --recompute-method uniform --recompute-num-layers 1),
  --use-distributed-optimizer (ZeRO-1), --use-torch-fsdp2 (ZeRO-3), --overlap-grad-reduce,
  --overlap-param-gather, and the model shape (--num-layers, --hidden-size, ...).
- DeepSpeed (docs/_pages/config-json.md): a JSON config. train_batch_size, train_micro_batch_size_per_gpu,
  gradient_accumulation_steps, zero_optimization.stage (0-3) with reduce_bucket_size, overlap_comm,
  stage3_prefetch_bucket_size, zero_hpz_partition_size (ZeRO++ hierarchical partitioning: our MAZ3
  "secondary" tier), mics_shard_size (MiCS: sharding inside groups, our HSDP point), bf16/fp16,
  tensor_parallel.autotp_size (AutoTP training). Pipeline parallelism and recomputation are code-side in
  DeepSpeed (PipelineModule(num_stages=...), deepspeed.checkpointing), so they are listed as notes.

Every plan knob a target has no setting for is listed in `unsupported` with the nearest setting used.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from specs.errors import PlannerError
from specs.job import Job
from specs.model import ModelSpec
from specs.plan import DEFAULT_BUCKET_BYTES, PLAN_KNOBS, Plan

TARGETS = ("torchtitan", "megatron", "deepspeed")


@dataclass(frozen=True)
class Export:
    """What to hand the engine (`text`, in `format`), and what it cannot express or needs in code."""

    target: str
    format: str  # "toml", "args" or "json"
    text: str
    unsupported: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    settings: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {"target": self.target, "format": self.format, "text": self.text, "settings": self.settings,
                "unsupported": list(self.unsupported), "notes": list(self.notes)}


def export_plan(plan: Plan, *, model: ModelSpec, job: Job, target: str) -> Export:
    """`plan` for `target` (one of TARGETS)."""
    builders = {"torchtitan": _torchtitan, "megatron": _megatron, "deepspeed": _deepspeed}
    if target not in builders:
        raise PlannerError(f"--to must be one of {', '.join(TARGETS)}, got {target!r}")
    return builders[target](plan, model, job)


def _common_unsupported(plan: Plan, target: str) -> list[str]:
    """The plan's knobs that `target` has no setting for (no export rule in the knob table, specs/plan.py)
    and that are off their default, each in one line from the knob's help; and a per-layer
    recomputation mix, which no target expresses."""
    out = []
    for spec in PLAN_KNOBS:
        value = getattr(plan, spec.name)
        if target not in spec.knob.exports and value != spec.default:
            shown = value if isinstance(value, str) or not isinstance(value, tuple) else "per-layer"
            out.append(f"{spec.name}={shown!r}: {target} has no such setting ({spec.knob.help.rstrip('.')}); "
                       f"its default is used")
    if plan.recompute_layers is not None and len(set(plan.recompute_layers)) > 1:
        out.append(f"per-layer recomputation {_mix(plan.recompute_layers)}: one policy for every layer is used "
                   f"({_dominant(plan.recompute_layers)})")
    return out


def _mix(policies) -> str:
    return "(" + ", ".join(f"{policies.count(p)} {p}" for p in ("none", "selective", "full") if p in policies) + ")"


def _dominant(policies) -> str:
    return max(("none", "selective", "full"), key=lambda p: (policies.count(p), p != "none"))


def _recompute(plan: Plan) -> str:
    return _dominant(plan.recompute_layers) if plan.recompute_layers is not None else plan.recompute


def _even_stages(plan: Plan, model: ModelSpec) -> bool:
    counts = plan.chunk_layer_counts(model.num_layers)
    return len(set(counts)) == 1


def _sharding_name(plan: Plan) -> str:
    level = plan.zero_level
    return f"ZeRO-{level}" if level is not None else f"shard degrees {plan.shard_degrees}"


# --- torchtitan ------------------------------------------------------------------------------------
_TITAN_SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}


def _toml_value(value) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    return json.dumps(str(value))


def _torchtitan(plan: Plan, model: ModelSpec, job: Job) -> Export:
    unsupported, notes = _common_unsupported(plan, "torchtitan"), []
    s_p, s_g, s_os = plan.shard_degrees
    replicate, shard, reshard = plan.dp, 1, None
    if plan.shard_degrees == (1, 1, 1):
        pass  # DDP
    elif s_p == s_g == s_os:
        # ZeRO-3 over dp, or HSDP: shard inside groups of s_p, replicate across them.
        replicate, shard, reshard = plan.dp // s_p, s_p, "always"
    elif s_p == 1 and s_g == s_os == plan.dp:
        # ZeRO-2: FSDP2 that keeps the gathered parameters from forward to backward.
        replicate, shard, reshard = 1, plan.dp, "never"
        notes.append("ZeRO-2 is FSDP2 with fsdp_reshard_after_forward = \"never\": parameters are gathered once per "
                     "step and kept until backward (persistent storage stays sharded, unlike ZeRO-2)")
    else:
        replicate, shard, reshard = 1, plan.dp, "always"
        unsupported.append(f"{_sharding_name(plan)}: FSDP2 shards parameters, gradients and optimizer states together; "
                           f"fully sharded over dp {plan.dp} instead")
    parallelism: dict = {"data_parallel_replicate_degree": replicate, "data_parallel_shard_degree": shard,
                         "tensor_parallel_degree": plan.tp, "pipeline_parallel_degree": plan.pp}
    if reshard:
        parallelism["fsdp_reshard_after_forward"] = reshard
    if plan.tp > 1 and not plan.sequence_parallel:
        unsupported.append("sequence_parallel off: torchtitan's TP always shards the norms over the sequence (on)")
    local_batch = plan.micro_batch * plan.num_micro_batches
    training: dict = {"local_batch_size": local_batch, "global_batch_size": job.global_batch, "seq_len": job.seq_len,
                      "mixed_precision_param": "float32" if job.precision == "fp32" else "bfloat16"}
    if job.precision == "fp16":
        unsupported.append("precision fp16: torchtitan trains in bf16 or fp32; bf16 used")
    if plan.pp > 1:
        parallelism["pipeline_parallel_schedule"] = _TITAN_SCHEDULES[plan.schedule]
        parallelism["pipeline_parallel_microbatch_size"] = plan.micro_batch
        if _even_stages(plan, model):
            parallelism["pipeline_parallel_layers_per_stage"] = model.num_layers // plan.num_chunks
        else:
            # Split points name the first layer of every stage after the first.
            starts = [r.start for r in plan.chunk_layer_ranges(model.num_layers)[1:]]
            parallelism["pipeline_parallel_split_points"] = [f"layers.{s}" for s in starts]
    else:
        # Without PP, torchtitan accumulates gradients over global / (local x DP) micro-batches.
        training["local_batch_size"] = plan.micro_batch
    recompute = _recompute(plan)
    checkpoint = {"mode": recompute}
    if recompute == "selective":
        checkpoint["selective_ac_option"] = "op"
        notes.append("selective: torchtitan's per-op SAC saves every other matmul, close to but not exactly "
                     "recomputing only the attention core")
    sections = {"training": training, "parallelism": parallelism, "activation_checkpoint": checkpoint}
    lines = [f"# planner export: {plan.describe()} for {model.name}, batch {job.global_batch} x {job.seq_len}"]
    for name, values in sections.items():
        lines.append(f"\n[{name}]")
        lines += [f"{k} = {_toml_value(v)}" for k, v in values.items()]
    return Export("torchtitan", "toml", "\n".join(lines) + "\n", tuple(unsupported), tuple(notes), sections)


# --- Megatron-LM -----------------------------------------------------------------------------------
def _megatron(plan: Plan, model: ModelSpec, job: Job) -> Export:
    unsupported, notes = _common_unsupported(plan, "megatron"), []
    args: dict = {
        "--num-layers": model.num_layers, "--hidden-size": model.hidden_size,
        "--num-attention-heads": model.num_heads, "--ffn-hidden-size": model.ffn_hidden_size,
        "--seq-length": job.seq_len, "--max-position-embeddings": max(model.max_seq_len, job.seq_len),
        "--tensor-model-parallel-size": plan.tp, "--pipeline-model-parallel-size": plan.pp,
        "--micro-batch-size": plan.micro_batch, "--global-batch-size": job.global_batch,
    }
    if model.num_kv_heads != model.num_heads:
        args["--group-query-attention"] = True
        args["--num-query-groups"] = model.num_kv_heads
    if model.arch == "llama":
        args.update({"--swiglu": True, "--normalization": "RMSNorm", "--position-embedding-type": "rope",
                     "--disable-bias-linear": True})
    if not model.tied_embeddings:
        args["--untie-embeddings-and-output-weights"] = True
    if job.precision in ("bf16", "fp16"):
        args[f"--{job.precision}"] = True
    if plan.sequence_parallel:
        args["--sequence-parallel"] = True
    if plan.pp > 1:
        _megatron_pipeline(plan, model, args, unsupported)
    recompute = _recompute(plan)
    if recompute == "full":
        args.update({"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": 1})
    elif recompute == "selective":
        args["--recompute-granularity"] = "selective"
    level, dp = plan.zero_level, plan.dp
    if dp > 1 and level == 1:
        args["--use-distributed-optimizer"] = True
    elif dp > 1 and level == 2:
        args["--use-distributed-optimizer"] = True
        unsupported.append("ZeRO-2 (sharded gradients): the distributed optimizer reduce-scatters gradients but keeps "
                           "the full gradient buffer (ZeRO-1 memory)")
    elif dp > 1 and level == 3:
        args["--use-torch-fsdp2"] = True
        notes.append("ZeRO-3 through --use-torch-fsdp2 (Megatron-LM core >= 0.10)")
    elif dp > 1 and level is None:
        args["--use-distributed-optimizer"] = True
        unsupported.append(f"{_sharding_name(plan)}: Megatron shards the optimizer over all of DP or (FSDP2) "
                           f"everything; the distributed optimizer is used")
    if dp > 1:
        args["--overlap-grad-reduce"] = True
        if "--use-distributed-optimizer" in args:
            args["--overlap-param-gather"] = True
    if plan.bucket_size_bytes != DEFAULT_BUCKET_BYTES:
        # Megatron's --ddp-bucket-size counts parameters, not bytes.
        args["--ddp-bucket-size"] = plan.bucket_size_bytes // (4 if job.precision == "fp32" else 2)
    parts = ["torchrun", "--nproc-per-node=<gpus per node>", "pretrain_gpt.py"]
    for k, v in args.items():
        parts.append(k if v is True else f"{k} {v}")
    text = " \\\n    ".join(parts) + "\n"
    return Export("megatron", "args", text, tuple(unsupported), tuple(notes), args)


def _megatron_pipeline(plan: Plan, model: ModelSpec, args: dict, unsupported: list[str]) -> None:
    if plan.schedule == "gpipe":
        unsupported.append("schedule gpipe: Megatron runs 1F1B (the same bubble, fewer micro-batches in flight)")
    counts = plan.chunk_layer_counts(model.num_layers)
    if plan.virtual_stages > 1:
        if len(set(counts)) == 1:
            args["--num-layers-per-virtual-pipeline-stage"] = counts[0]
        else:
            args["--num-layers-per-virtual-pipeline-stage"] = model.num_layers // plan.num_chunks
            unsupported.append(f"unequal interleaved chunks {list(counts)}: Megatron splits them evenly")
        return
    middle = counts[1:-1]
    if len(set(counts)) == 1:
        return
    if len(set(middle)) <= 1:
        # Megatron-core sizes the first and last stages separately and splits the rest evenly.
        args["--decoder-first-pipeline-num-layers"] = counts[0]
        args["--decoder-last-pipeline-num-layers"] = counts[-1]
    else:
        unsupported.append(f"unequal stages {list(counts)}: Megatron sets only the first and last stage; split evenly")


# --- DeepSpeed -------------------------------------------------------------------------------------
def _deepspeed(plan: Plan, model: ModelSpec, job: Job) -> Export:
    unsupported, notes = _common_unsupported(plan, "deepspeed"), []
    config: dict = {
        "train_batch_size": job.global_batch, "train_micro_batch_size_per_gpu": plan.micro_batch,
        "gradient_accumulation_steps": plan.num_micro_batches,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
    }
    if job.precision in ("bf16", "fp16"):
        config[job.precision] = {"enabled": True}
    s_p, s_g, s_os = plan.shard_degrees
    level = plan.zero_level
    zero: dict = {"stage": level if level is not None else 3, "overlap_comm": True, "contiguous_gradients": True,
                  "reduce_bucket_size": plan.bucket_size_bytes // (4 if job.precision == "fp32" else 2)}
    if level is None and s_p == s_g == s_os:
        # The HSDP point: ZeRO-3 inside groups of s_p, replicated across them (MiCS).
        zero["stage"], zero["mics_shard_size"] = 3, s_p
    elif level is None:
        unsupported.append(f"{_sharding_name(plan)}: DeepSpeed shards by stage (ZeRO-1/2/3) over all of DP; ZeRO-3 used")
    cache = plan.param_cache if isinstance(plan.param_cache, str) else "per-layer"
    if zero["stage"] == 3 and cache == "secondary":
        per_node = min(plan.dp, 8)
        zero["zero_hpz_partition_size"] = per_node
        notes.append("MAZ3 secondary tier as ZeRO++ hpZ: a secondary parameter shard inside each node "
                     "(zero_hpz_partition_size = DP ranks per node; set it to your node's GPU count)")
    elif cache != "none":
        unsupported.append(f"param_cache={cache!r} (MAZ3 tier): DeepSpeed has only the hpZ secondary partition; none used")
    if zero["stage"] == 3:
        zero["stage3_prefetch_bucket_size"] = max(1, plan.prefetch_depth) * _layer_params(model, plan.tp)
    config["zero_optimization"] = zero
    if plan.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp}
        notes.append("TP through AutoTP training (DeepSpeed >= 0.16.4)")
        if plan.sequence_parallel:
            unsupported.append("sequence_parallel: AutoTP has no Megatron-style sequence parallelism")
    if plan.pp > 1:
        notes.append(f"pipeline parallelism is code-side: PipelineModule(layers, num_stages={plan.pp}, "
                     f"partition_method=...) and engine.train_batch(); gradient_accumulation_steps is its micro-batch count")
        if plan.schedule != "1f1b":
            unsupported.append(f"schedule {plan.schedule}: DeepSpeed's pipeline engine runs 1F1B (TrainSchedule)")
        if not _even_stages(plan, model):
            notes.append(f"unequal stages {list(plan.chunk_layer_counts(model.num_layers))}: PipelineModule("
                         f"partition_method='type:...') or a custom partition")
    recompute = _recompute(plan)
    if recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": plan.tp > 1, "contiguous_memory_optimization": False,
                                              "cpu_checkpointing": False}
        notes.append(f"recompute {recompute}: wrap each {'layer' if recompute == 'full' else 'attention core'} in "
                     f"deepspeed.checkpointing.checkpoint (the JSON only configures it)")
    return Export("deepspeed", "json", json.dumps(config, indent=2) + "\n", tuple(unsupported), tuple(notes), config)


def _layer_params(model: ModelSpec, tp: int) -> int:
    from cost_models.memory import layer_params_per_device

    return int(layer_params_per_device(model, tp=tp))
