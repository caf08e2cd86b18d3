"""A plan as a torchtitan 0.3.0 config module (a function returning its `Trainer.Config`) and its launch script.

torchtitan 0.3.0 (PyPI, the release/0.3 branch) has no TOML: a run is a Python function with no
arguments returning `Trainer.Config`, picked with `--module M --config F`, and its dataclasses reject
unknown fields. The module written here holds the whole model (a `Llama3Model.Config` built from
torchtitan's public helpers with the plan's model's shape) and every plan knob torchtitan has:

- parallelism: data_parallel_replicate_degree x data_parallel_shard_degree = dp (FSDP2 over the shard
  axis, HSDP when both exceed 1), fsdp_reshard_after_forward ("always": ZeRO-3; "never": parameters
  kept gathered from forward to backward, the MAZ3 device tier, and how torchtitan runs ZeRO-1/2-like
  plans, since its FSDP2 always shards parameters at rest), tensor_parallel_degree,
  enable_sequence_parallel, pipeline_parallel_degree, pipeline_parallel_schedule (GPipe, 1F1B,
  Interleaved1F1B), pipeline_parallel_microbatch_size and module_fqns_per_model_part (the plan's exact
  chunks: torchtitan's layers_per_stage counts the embedding and the head as layers, so it cannot say
  "40 layers per stage"), context_parallel_degree (torch's ring attention; FSDP shards over
  data_parallel_shard_degree x cp, as the plan shards over dp x cp, so the shard group is a multiple of cp)
  with the "ptrr" load balancer its FlexAttention masks need, expert_parallel_degree (MoE models: EP folded
  over dp_shard x cp x tp as torchtitan folds it; no expert TP);
- training: local_batch_size, global_batch_size (gradient accumulation), seq_len, mixed precision,
  disable_cuda_graphs (required with pipeline parallelism);
- activation_checkpoint: None, SelectiveAC (per-op) or FullAC; the optimizer: Adam as the job's.

The model is torchtitan's llama3 decoder for Llama models and its qwen3 decoder (an explicit head_dim,
optional query/key head norms, per-layer dense or MoE blocks: softmax top-k routing, renormalised as the
model's norm_topk_prob says (route_norm), an optional ungated shared expert) for Qwen3 and MoE models
(Mixtral is the qwen3 decoder without head norms).

Refused (torchtitan would reject them, or has no such model): GPT-2 models, Qwen2's q/k/v biases, MLA,
gated shared experts, capacity factors, EP that does not divide dp_shard x cp x tp, tied embeddings with
pipeline parallelism, and 1F1B with fewer micro-batches than stages (torch's Schedule1F1B).
"""

from __future__ import annotations

from specs.errors import PlannerError
from specs.plan import Plan
from planner.exports.common import (Export, ExportContext, Refused, cover_sharding, dp_ranks_per_node, knob_table_gaps,
                                    launch_header, refuse, sharding_name, uniform_recompute)

VERSION = "torchtitan 0.3.0 (PyPI; the release/0.3 branch, 2026-08)"
MODULE = "planner_plan"
SCHEDULES = {"gpipe": "GPipe", "1f1b": "1F1B", "interleaved-1f1b": "Interleaved1F1B"}


def export_torchtitan(plan: Plan, ctx: ExportContext) -> Export:
    _refuse_what_torchtitan_rejects(plan, ctx)
    changes, lines = knob_table_gaps(plan, "torchtitan")
    recompute, recompute_lines = uniform_recompute(plan, "torchtitan")
    changes.update(recompute)
    lines += recompute_lines
    if recompute["recompute"] == "selective":
        lines.append("recompute='selective' (the attention core): torchtitan's selective AC is per op (it saves the "
                     "matmul and attention outputs and recomputes the rest); exported as SelectiveAC")
    shard_changes, shard_lines = _sharding(plan, changes.get("param_cache", plan.param_cache))
    changes.update(shard_changes)
    lines += shard_lines
    if ctx.problem.job.precision == "fp16":
        lines.append("precision fp16: torchtitan trains in bfloat16 or float32; exported as bfloat16")
    if ctx.problem.job.precision != "fp32" and not plan.reduce_fp32:
        changes["reduce_fp32"] = True
        lines.append("reduce_fp32=False: torchtitan reduces gradients in float32 only (training.mixed_precision_reduce); "
                     "exported with fp32 gradient reduction")
    expressed = plan.replace(**changes)
    _refuse_expert_layouts(expressed, ctx)
    settings = _settings(expressed, ctx)
    files = {f"{MODULE}.py": config_module(expressed, ctx, settings), "launch.sh": _launch_script(expressed, ctx)}
    notes = ["attention: FlexAttention with torchtitan's per-document (block-causal) masks; the planner's engine "
             "masks causally over the whole sequence",
             "hf_assets_path must hold a tokenizer of the model's vocabulary (torchtitan's "
             "scripts/download_hf_assets.py); the data is torchtitan's c4 loader"]
    if ctx.problem.model.is_moe:
        notes.append("experts: torchtitan balances them by its auxiliary-loss-free expert bias (load_balance_coeff "
                     "1e-3), not by the model's auxiliary loss; routing as the model's (softmax, top-k, "
                     f"{'renormalised' if ctx.problem.model.norm_topk_prob else 'not renormalised'})")
    return Export(target="torchtitan", version=VERSION, files=files, main=f"{MODULE}.py", expressed=expressed,
                  cannot_express=tuple(lines), notes=tuple(notes), settings=settings)


def family(model) -> str:
    """The torchtitan decoder the export writes: its llama3 model, or its qwen3 model (an explicit head_dim,
    optional query/key head norms, MoE blocks) for Qwen3 and mixture-of-experts models."""
    return "qwen3" if model.qk_norm or model.is_moe or model.head_dim * model.num_heads != model.hidden_size else "llama3"


def _refuse_what_torchtitan_rejects(plan: Plan, ctx: ExportContext) -> None:
    model, job = ctx.problem.model, ctx.problem.job
    if model.arch != "llama":
        raise Refused(f"{VERSION} has no {model.arch} decoder (LayerNorm, learned positions, GELU, biases); "
                      f"export {model.name} to megatron or deepspeed")
    missing = [what for on, what in ((model.qkv_bias, "q/k/v biases (Qwen2's attention)"),
                                     (model.uses_mla, "multi-head latent attention (its deepseek_v3 model is not "
                                                      "written by this exporter)"),
                                     (model.shared_expert_gate, "a gated shared expert (Qwen2-MoE)"),
                                     (model.capacity_factor > 0, "a capacity factor (its routing is dropless)"),
                                     (model.rope_scaling not in ("none", "llama3"),
                                      f"{model.rope_scaling} rope scaling")) if on]
    if missing:
        raise Refused(f"torchtitan export of {model.name} is not supported: {', '.join(missing)} not in the "
                      f"llama3 and qwen3 models of {VERSION}, the ones this exporter writes; export it to megatron")
    if model.tied_embeddings and plan.pp > 1:
        dp = plan.dp * plan.pp
        micro_batch = plan.micro_batch if job.global_batch % (dp * plan.micro_batch) == 0 else 1
        closest = plan.replace(pp=1, dp=dp, virtual_stages=1, schedule="1f1b", stage_layers=None, commshift=False,
                               micro_batch=micro_batch, num_micro_batches=job.global_batch // (dp * micro_batch),
                               **_scaled_shards(plan, dp))
        raise refuse("torchtitan", VERSION, "Weight tying is not supported with Pipeline Parallel",
                     export_torchtitan(closest, ctx).expressed, ctx)
    if plan.pp > 1 and plan.schedule == "1f1b" and plan.num_micro_batches < plan.pp:
        raise refuse("torchtitan", VERSION, f"torch's Schedule1F1B needs at least as many micro-batches as stages, "
                     f"got {plan.num_micro_batches} for {plan.pp}", plan.replace(schedule="gpipe"), ctx)


def _refuse_expert_layouts(plan: Plan, ctx: ExportContext) -> None:
    """torchtitan 0.3.0's EP folds over the FSDP shard x CP x TP ranks (ParallelDims: efsdp = dp_shard x cp x tp
    / ep), never across HSDP replicas (its experts are whole: etp is reset by the knob table)."""
    if not ctx.problem.model.is_moe:
        return
    fold = plan.param_shard * plan.tp  # dp_shard x cp x tp
    if fold % plan.ep:
        ep = max(e for e in range(1, plan.ep + 1) if fold % e == 0 and ctx.problem.model.num_experts % e == 0)
        raise refuse("torchtitan", VERSION, f"expert parallelism folds over dp_shard x cp x tp = {fold} ranks, which "
                     f"ep {plan.ep} does not divide", plan.replace(ep=ep), ctx)


def _scaled_shards(plan: Plan, dp: int) -> dict:
    """The plan's sharding point on a DP group of `dp` (ZeRO stages stay stages; group sizes are kept)."""
    level = plan.zero_level
    if level is not None:
        from specs.plan import zero_degrees

        return dict(zip(("param_shard", "grad_shard", "optim_shard"), zero_degrees(level, dp)))
    return {"param_shard": plan.param_shard, "grad_shard": plan.grad_shard, "optim_shard": plan.optim_shard}


def _sharding(plan: Plan, cache) -> tuple[dict, list[str]]:
    """torchtitan's FSDP2/HSDP shards parameters, gradients and optimizer states over one axis together:
    the plan's point, or the covering one (each at least as sharded), with the device tier for "never"."""
    # torchtitan's FSDP mesh dimension is data_parallel_shard x cp (CP inner, as the plan's positions).
    dp, mine = plan.dp_cp, plan.shard_degrees
    points = [(g, g, g) for g in range(1, dp + 1) if dp % g == 0 and g % plan.cp == 0]
    chosen = cover_sharding(plan, points)
    changes = dict(zip(("param_shard", "grad_shard", "optim_shard"), chosen))
    if chosen == mine:
        return changes, []
    lines = []
    if mine[0] == 1:
        # Parameters were replicated: keep the gathered copy from forward to backward ("never").
        changes["param_cache"] = "device"
        lines.append(f"{sharding_name(mine, dp)}: torchtitan's FSDP2 also shards parameters at rest; exported as "
                     f"{sharding_name(chosen, dp)} with fsdp_reshard_after_forward = \"never\" (parameters gathered once "
                     f"per micro-batch and kept until its backward)")
    else:
        lines.append(f"{sharding_name(mine, dp)}: torchtitan shards parameters, gradients and optimizer states over "
                     f"one group; exported as {sharding_name(chosen, dp)}")
    if cache not in ("none", "device"):
        changes["param_cache"] = "none"
    return changes, lines


def _settings(plan: Plan, ctx: ExportContext) -> dict:
    """torchtitan's own field values (config sections -> field -> value) for the plan."""
    model, job = ctx.problem.model, ctx.problem.job
    g = plan.param_shard
    parallelism: dict = {"data_parallel_replicate_degree": plan.dp_cp // g, "data_parallel_shard_degree": g // plan.cp,
                         "fsdp_reshard_after_forward": "never" if plan.param_cache == "device" else "always",
                         "tensor_parallel_degree": plan.tp, "enable_sequence_parallel": plan.sequence_parallel,
                         "pipeline_parallel_degree": plan.pp, "context_parallel_degree": plan.cp,
                         "expert_parallel_degree": plan.ep}
    if plan.cp > 1:
        # FlexAttention's block masks are sharded only by the per-token round-robin balancer, which balances
        # the causal work as the plan's head-tail chunks do.
        parallelism["context_parallel_load_balancer"] = "ptrr"
    training: dict = {"global_batch_size": job.global_batch, "seq_len": job.seq_len,
                      "mixed_precision_param": "float32" if job.precision == "fp32" else "bfloat16",
                      "mixed_precision_reduce": "float32"}
    if plan.ep > 1:
        # Its standard all-to-all dispatcher syncs with the CPU for the splits, which CUDA graphs cannot hold.
        training["disable_cuda_graphs"] = True
    if plan.pp > 1:
        parallelism.update({"pipeline_parallel_schedule": SCHEDULES[plan.schedule],
                            "pipeline_parallel_microbatch_size": plan.micro_batch,
                            "module_fqns_per_model_part": module_fqns(plan, model.num_layers)})
        # The pipeline runs all of a step's micro-batches of a DP rank in one local batch.
        training.update({"local_batch_size": plan.micro_batch * plan.num_micro_batches, "disable_cuda_graphs": True})
    else:
        # Without a pipeline torchtitan accumulates global / (local x DP) micro-batches.
        training["local_batch_size"] = plan.micro_batch
    recompute = {"none": None, "selective": "SelectiveAC", "full": "FullAC"}[plan.recompute]
    return {"parallelism": parallelism, "training": training, "activation_checkpoint": recompute,
            "model": {"dim": model.hidden_size, "n_layers": model.num_layers, "n_heads": model.num_heads,
                      "n_kv_heads": model.num_kv_heads, "ffn_dim": model.ffn_hidden_size, "vocab_size": model.vocab_size,
                      "enable_weight_tying": model.tied_embeddings, "rope_theta": model.rope_theta,
                      "norm_eps": model.norm_eps,
                      "rope_max_seq_len": max(model.max_seq_len, job.seq_len), "head_dim": model.head_dim,
                      "qk_norm": model.qk_norm, "num_experts": model.num_experts,
                      "top_k": model.num_experts_per_token, "expert_ffn_dim": model.expert_ffn_hidden_size,
                      "shared_ffn_dim": model.shared_expert_ffn_hidden_size,
                      "dense_layers": model.num_dense_layers if model.is_moe else model.num_layers,
                      "route_norm": model.norm_topk_prob, "rope_scaling": rope_scaling(model)},
            "world_size": ctx.problem.cluster.num_devices, "dp_ranks_per_node": dp_ranks_per_node(plan, ctx.problem)}


def rope_scaling(model) -> dict:
    """torchtitan's RoPE.Config scaling fields for the model's (its "llama" scaling is Llama 3.1's)."""
    if model.rope_scaling != "llama3":
        return {"scaling": "none"}
    return {"scaling": "llama", "scaling_factor": model.rope_scaling_factor,
            "low_freq_factor": model.rope_low_freq_factor, "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_positions}


def module_fqns(plan: Plan, num_layers: int) -> list[list[str]]:
    """torchtitan's module names per model part, chunk by chunk (chunk c on pipeline rank c % pp, the
    "loop" order of its Interleaved1F1B): the embedding on the first, the final norm and head on the last."""
    parts = []
    ranges = plan.chunk_layer_ranges(num_layers)
    for c, layers in enumerate(ranges):
        names = [f"layers.{i}" for i in layers]
        if c == 0:
            names.insert(0, "tok_embeddings")
        if c == len(ranges) - 1:
            names += ["norm", "lm_head"]
        parts.append(names)
    return parts


_HEADER = '''"""planner export for {version}.

plan as exported: {describe}
{model_name} on {devices} x {hardware} ({nodes} node(s) of {per_node}), global batch {global_batch} x {seq_len} tokens.
Run with launch.sh (torchtitan's own entry point: -m torchtitan.train --module {module} --config {module}).
"""

from functools import partial

import torch.nn as nn

from torchtitan.components.loss import CrossEntropyLoss
from torchtitan.components.optimizer import OptimizersContainer, ParamGroupConfig
from torchtitan.config import ParallelismConfig, TrainingConfig
from torchtitan.distributed.activation_checkpoint import FullAC, SelectiveAC
from torchtitan.distributed.pipeline_parallel import pipeline_llm
from torchtitan.hf_datasets.text_datasets import HuggingFaceTextDataLoader
from torchtitan.protocols.model_spec import ModelSpec
from torchtitan.trainer import Trainer
'''

_LLAMA3_MODEL = '''from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
from torchtitan.models.common.config_utils import get_attention_config, make_ffn_config, make_gqa_config
from torchtitan.models.common.param_init import depth_scaled_std
from torchtitan.models.llama3 import parallelize_llama
from torchtitan.models.llama3.model import Llama3Model, Llama3TransformerBlock
from torchtitan.models.llama3.state_dict_adapter import Llama3StateDictAdapter

# The model: {model_name} as the planner defines it (RoPE base {rope_theta:g} with ROPE_SCALING, RMSNorm, SwiGLU,
# no biases).
DIM, N_LAYERS, N_HEADS, N_KV_HEADS, FFN_DIM, VOCAB = {dim}, {n_layers}, {n_heads}, {n_kv_heads}, {ffn_dim}, {vocab}
TIED, ROPE_THETA, ROPE_MAX_SEQ_LEN, NORM_EPS = {tied}, {rope_theta!r}, {rope_max_seq_len}, {norm_eps!r}
ROPE_SCALING = {rope_scaling!r}
SPEC = dict(name="llama3", parallelize_fn=parallelize_llama, post_optimizer_build_fn=None,
            state_dict_adapter=Llama3StateDictAdapter)


def _init(std: float) -> dict:
    return {{"weight": partial(nn.init.trunc_normal_, std=std), "bias": nn.init.zeros_}}


def _layer(layer_id: int, rope: ComplexRoPE.Config) -> Llama3TransformerBlock.Config:
    # torchtitan's llama3 initialisation: std 0.02, depth-scaled for the output projections.
    return Llama3TransformerBlock.Config(
        attention_norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS),
        ffn_norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS),
        attention=make_gqa_config(dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, fuse_qkv=True, rope=rope,
                                  inner_attention=get_attention_config("flex"), wqkv_param_init=_init(0.02),
                                  wo_param_init=_init(depth_scaled_std(0.02, layer_id))),
        feed_forward=make_ffn_config(dim=DIM, hidden_dim=FFN_DIM, w1_param_init=_init(0.02),
                                     w2w3_param_init=_init(depth_scaled_std(0.02, layer_id))),
    )


def model_config() -> Llama3Model.Config:
    rope = ComplexRoPE.Config(dim=DIM // N_HEADS, max_seq_len=ROPE_MAX_SEQ_LEN, theta=ROPE_THETA, **ROPE_SCALING)
    return Llama3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=TIED,
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM),
        norm=RMSNorm.Config(normalized_shape=DIM, eps=NORM_EPS),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB),
        layers=[_layer(i, rope) for i in range(N_LAYERS)],
    )
'''

_QWEN3_MODEL = '''from torchtitan.components.optimizer import register_moe_load_balancing_hook
from torchtitan.models.common import CosSinRoPE, Embedding, Linear
from torchtitan.models.common.config_utils import (get_attention_config, make_ffn_config, make_gqa_config,
                                                   make_moe_config, make_routed_experts_config, make_router_config)
from torchtitan.models.common.nn_modules import RMSNorm
from torchtitan.models.qwen3 import parallelize_qwen3
from torchtitan.models.qwen3.model import Qwen3Model, Qwen3TransformerBlock
from torchtitan.models.qwen3.state_dict_adapter import Qwen3StateDictAdapter

# The model: {model_name} as the planner defines it, on torchtitan's qwen3 decoder (RoPE base {rope_theta:g}
# with ROPE_SCALING on rotated halves, RMSNorm, SwiGLU, no biases; query/key head norms: {qk_norm}). Layers from
# DENSE_LAYERS on are mixtures of NUM_EXPERTS experts of width EXPERT_FFN_DIM, top TOP_K by softmax,
# renormalised where ROUTE_NORM (a shared expert of width SHARED_FFN_DIM beside them where it is not 0).
DIM, N_LAYERS, N_HEADS, N_KV_HEADS, HEAD_DIM, FFN_DIM, VOCAB = ({dim}, {n_layers}, {n_heads}, {n_kv_heads}, {head_dim},
                                                             {ffn_dim}, {vocab})
NUM_EXPERTS, TOP_K, EXPERT_FFN_DIM, SHARED_FFN_DIM, DENSE_LAYERS = ({num_experts}, {top_k}, {expert_ffn_dim},
                                                                   {shared_ffn_dim}, {dense_layers})
TIED, ROPE_THETA, ROPE_MAX_SEQ_LEN, NORM_EPS, QK_NORM = {tied}, {rope_theta!r}, {rope_max_seq_len}, {norm_eps!r}, {qk_norm}
ROUTE_NORM = {route_norm}  # the top-k softmax probabilities renormalised to sum to one (HF's norm_topk_prob)
ROPE_SCALING = {rope_scaling!r}
SPEC = dict(name="qwen3", parallelize_fn=parallelize_qwen3,
            post_optimizer_build_fn=register_moe_load_balancing_hook if NUM_EXPERTS else None,
            state_dict_adapter=Qwen3StateDictAdapter)


def _init(std: float) -> dict:
    return {{"weight": partial(nn.init.normal_, std=std), "bias": nn.init.zeros_}}


def _norm(dim: int) -> RMSNorm.Config:
    return RMSNorm.Config(normalized_shape=dim, eps=NORM_EPS, param_init={{"weight": nn.init.ones_}})


def _moe() -> dict:
    # torchtitan's qwen3 initialisation: std 0.02, the output projections scaled by 1 / sqrt(2 x layers).
    out = 0.02 / (2 * N_LAYERS) ** 0.5
    shared = (make_ffn_config(dim=DIM, hidden_dim=SHARED_FFN_DIM, w1_param_init=_init(0.02), w2w3_param_init=_init(out))
              if SHARED_FFN_DIM else None)
    return {{"moe": make_moe_config(
        num_experts=NUM_EXPERTS, shared_experts=shared,
        router=make_router_config(dim=DIM, num_experts=NUM_EXPERTS, gate_param_init=_init(0.02), top_k=TOP_K,
                                  score_func="softmax", route_norm=ROUTE_NORM),
        routed_experts=make_routed_experts_config(
            dim=DIM, hidden_dim=EXPERT_FFN_DIM, num_experts=NUM_EXPERTS, top_k=TOP_K, comm_backend="standard",
            param_init={{"w1_EFD": partial(nn.init.normal_, std=0.02), "w2_EDF": partial(nn.init.normal_, std=out),
                        "w3_EFD": partial(nn.init.normal_, std=0.02)}}))}}


def _layer(layer_id: int, rope: CosSinRoPE.Config) -> Qwen3TransformerBlock.Config:
    mlp = (_moe() if layer_id >= DENSE_LAYERS else
           {{"feed_forward": make_ffn_config(dim=DIM, hidden_dim=FFN_DIM, w1_param_init=_init(0.02),
                                            w2w3_param_init=_init(0.02))}})
    return Qwen3TransformerBlock.Config(
        attention_norm=_norm(DIM), ffn_norm=_norm(DIM),
        attention=make_gqa_config(dim=DIM, n_heads=N_HEADS, n_kv_heads=N_KV_HEADS, head_dim=HEAD_DIM, fuse_qkv=True,
                                  rope=rope, inner_attention=get_attention_config("flex"), wqkv_param_init=_init(0.02),
                                  wo_param_init=_init(0.02 / (2 * N_LAYERS) ** 0.5 if NUM_EXPERTS else 0.02),
                                  qk_norm=_norm(HEAD_DIM) if QK_NORM else None),
        **mlp,
    )


def model_config() -> Qwen3Model.Config:
    rope = CosSinRoPE.Config(dim=HEAD_DIM, max_seq_len=ROPE_MAX_SEQ_LEN, theta=ROPE_THETA, **ROPE_SCALING)
    return Qwen3Model.Config(
        dim=DIM, vocab_size=VOCAB, enable_weight_tying=TIED, norm=_norm(DIM),
        tok_embeddings=Embedding.Config(num_embeddings=VOCAB, embedding_dim=DIM,
                                        param_init={{"weight": partial(nn.init.normal_, std=0.02)}}),
        lm_head=Linear.Config(in_features=DIM, out_features=VOCAB, param_init=_init(0.02)),
        layers=[_layer(i, rope) for i in range(N_LAYERS)],
    )
'''

_TRAINER = '''

def {module}() -> Trainer.Config:
    spec = ModelSpec(flavor={flavor!r}, model=model_config(), pipelining_fn=pipeline_llm, **SPEC)
    return Trainer.Config(
        model_spec=spec,
        hf_assets_path={assets!r},  # a tokenizer of VOCAB tokens
        loss=CrossEntropyLoss.Config(global_vocab_size=VOCAB),
        optimizer=OptimizersContainer.Config(param_groups=[ParamGroupConfig(
            pattern=r".*", optimizer_name="Adam",
            optimizer_kwargs={{"lr": 3e-4, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}})]),
        dataloader=HuggingFaceTextDataLoader.Config(dataset="c4"),
        training=TrainingConfig(
{training}
        ),
        parallelism=ParallelismConfig(
{parallelism}
        ),
        activation_checkpoint={activation_checkpoint},
    )
'''
ASSETS = {"llama3": "./assets/hf/Llama-3.1-8B", "qwen3": "./assets/hf/Qwen3-8B"}


def _fields(values: dict, indent: int) -> str:
    pad = " " * indent
    return "\n".join(f"{pad}{key}={value!r}," for key, value in values.items())


def config_module(plan: Plan, ctx: ExportContext, settings: dict) -> str:
    """The Python source of the config module (torchtitan loads it with --module/--config)."""
    problem, m = ctx.problem, settings["model"]
    checkpoint = settings["activation_checkpoint"]
    kind = family(problem.model)
    values = dict(
        version=VERSION, describe=plan.describe(), model_name=problem.model.name, devices=problem.cluster.num_devices,
        hardware=problem.cluster.hardware.name, nodes=problem.cluster.num_nodes,
        per_node=problem.cluster.devices_per_node, global_batch=problem.job.global_batch, seq_len=problem.job.seq_len,
        module=MODULE, vocab=m["vocab_size"], tied=m["enable_weight_tying"], flavor=f"planner-{problem.model.name}",
        **{k: m[k] for k in ("dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "rope_theta", "rope_max_seq_len",
                             "norm_eps", "head_dim", "qk_norm", "num_experts", "top_k", "expert_ffn_dim",
                             "shared_ffn_dim", "dense_layers", "route_norm", "rope_scaling")},
        assets=ASSETS[kind], training=_fields(settings["training"], 12), parallelism=_fields(settings["parallelism"], 12),
        activation_checkpoint="None" if checkpoint is None else f"{checkpoint}.Config()")
    model = {"llama3": _LLAMA3_MODEL, "qwen3": _QWEN3_MODEL}[kind]
    return "".join(part.format(**values) for part in (_HEADER, model, _TRAINER))


def _launch_script(plan: Plan, ctx: ExportContext) -> str:
    cluster = ctx.problem.cluster
    lines = launch_header(VERSION, plan, ctx.problem)
    lines += ["# Needs torchtitan 0.3.0 (pip install torchtitan==0.3.0) and this folder's planner_plan.py; run on every",
              "# node with MASTER_ADDR and MASTER_PORT set (torchtitan's run_train.sh starts the same command).",
              'export PYTHONPATH="$(cd "$(dirname "$0")" && pwd)${PYTHONPATH:+:$PYTHONPATH}"',
              'export PYTORCH_ALLOC_CONF="expandable_segments:True"',
              f"torchrun --nproc-per-node {cluster.devices_per_node} --nnodes {cluster.num_nodes} --rdzv-backend c10d "
              f'--rdzv-endpoint "${{MASTER_ADDR:-localhost}}:${{MASTER_PORT:-29500}}" --local-ranks-filter 0 '
              f"--role rank --tee 3 \\\n    -m torchtitan.train --module {MODULE} --config {MODULE}"]
    return "\n".join(lines) + "\n"
