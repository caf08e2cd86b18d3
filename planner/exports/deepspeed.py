"""A plan as a DeepSpeed 0.19.8 config (ds_config.json), the model as an HF config (config.json, which the
training script builds its model from) and a `deepspeed` launch script.

DeepSpeed takes the model and the pipeline in code (PipelineModule(num_stages=...), AutoTP), so the
JSON holds what it has keys for: the batch (train_batch_size = micro x accumulation x DP),
zero_optimization (stage 0-3, reduce_bucket_size, overlap_comm, the stage-3 prefetch bucket and ZeRO++
hpZ: the MAZ3 secondary tier), bf16/fp16, the optimizer (Adam with adam_w_mode false: DeepSpeed turns
"Adam" into AdamW otherwise), AutoTP's tensor_parallel.autotp_size, activation_checkpointing, and the
pipeline block (stages, activation checkpoint interval).

An MoE model is the HF architecture of its attention (mixtral, qwen2_moe, qwen3_moe: hf_moe_type), whose MoE
blocks DeepSpeed trains with the experts replicated over data parallelism: its expert parallelism lives in
the model code (deepspeed.moe.layer.MoE), so ep is reset to 1 (one line).

Refused (DeepSpeed would reject them): ZeRO-2/3 with pipeline parallelism ("ZeRO-2 and ZeRO-3 are
incompatible with pipeline parallelism", runtime/pipe/engine.py); MoE models no HF architecture describes
(MLA, capacity factors, other mixes). Not exported: MiCS (its keys are
rejected since 0.19.7), so an HSDP point becomes ZeRO-3 over all of DP.
"""

from __future__ import annotations

import json

from cost_models.moe import dense_view
from specs.errors import PlannerError
from specs.plan import Plan, zero_degrees
from planner.exports.common import (Export, ExportContext, Refused, cover_sharding, dp_ranks_per_node, knob_table_gaps,
                                    launch_header, refuse, sharding_name, uniform_recompute)

VERSION = "DeepSpeed 0.19.8 (PyPI, 2026-10)"


def export_deepspeed(plan: Plan, ctx: ExportContext) -> Export:
    problem = ctx.problem
    if problem.model.is_moe:
        hf_moe_type(problem.model)  # refuses an MoE model no HF architecture describes
        if plan.tp > 1:
            _refuse_moe_tensor_parallel(plan, ctx)
    if problem.model.qk_norm and problem.model.qkv_bias:
        raise Refused(f"DeepSpeed export of {problem.model.name} is not supported: no HF architecture has both query/key "
                      f"head norms and q/k/v biases without an output bias (config.json could not describe it)")
    if plan.cp > 1:
        _refuse_context_parallel(plan, ctx)
    if plan.pp > 1 and plan.grad_shard > 1:
        zero1 = plan.replace(**dict(zip(("param_shard", "grad_shard", "optim_shard"), zero_degrees(1, plan.dp))),
                             param_cache="none")
        raise refuse("deepspeed", VERSION, "ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism",
                     express(zero1, problem.model.num_layers, problem.job.precision)[0], ctx)
    expressed, lines = express(plan, problem.model.num_layers, problem.job.precision)
    config = ds_config(expressed, ctx)
    files = {"ds_config.json": json.dumps(config, indent=2) + "\n",
             "config.json": json.dumps(hf_config(problem.model), indent=2) + "\n",
             "launch.sh": _launch_script(expressed, ctx)}
    notes = ["the training script is yours: build the model from config.json (transformers' AutoConfig), "
             "call deepspeed.initialize(config='ds_config.json'); with pipeline parallelism wrap the layers in "
             f"PipelineModule(num_stages={expressed.pp}, partition_method='uniform') and call engine.train_batch()"]
    if expressed.tp > 1:
        notes.append(f"tensor parallelism is AutoTP training (tensor_parallel.autotp_size = {expressed.tp}): "
                     "DeepSpeed shards the HF model's linear layers itself")
    if problem.model.is_moe:
        notes.append(f"experts: the HF model's own MoE blocks ({hf_moe_type(problem.model)}), replicated over "
                     "data parallelism (DeepSpeed's expert parallelism needs deepspeed.moe.layer.MoE in the model "
                     "code); load-balancing loss from output_router_logits; under ZeRO-3 call "
                     "deepspeed.utils.set_z3_leaf_modules(model, [<the sparse MoE block class>]) before initialize, "
                     "or ranks whose tokens skip an expert stall its gather")
    return Export(target="deepspeed", version=VERSION, files=files, main="ds_config.json", expressed=expressed,
                  cannot_express=tuple(lines), notes=tuple(notes), settings={"ds_config": config})


def _refuse_moe_tensor_parallel(plan: Plan, ctx: ExportContext) -> None:
    """AutoTP has no sequence parallelism, and MoE layers under TP need it (every TP rank would route the same
    tokens; Megatron-Core and this project refuse it): the closest plan folds TP into DP."""
    dp = plan.dp * plan.tp
    level = plan.zero_level if plan.zero_level is not None else 1
    if plan.pp > 1:
        level = min(level, 1)  # ZeRO-2/3 with pipelines is refused (export_deepspeed)
    closest = plan.replace(tp=1, dp=dp, sequence_parallel=False, ep=1, etp=1, param_cache="none",
                           **dict(zip(("param_shard", "grad_shard", "optim_shard"), zero_degrees(level, dp))))
    if ctx.problem.job.global_batch % (dp * closest.micro_batch):
        closest = closest.replace(micro_batch=1)
    closest = closest.replace(num_micro_batches=ctx.problem.job.global_batch // (dp * closest.micro_batch))
    raise refuse("deepspeed", VERSION, "AutoTP has no sequence parallelism, which MoE layers under tensor "
                 "parallelism need", express(closest, ctx.problem.model.num_layers, ctx.problem.job.precision)[0], ctx)


def _refuse_context_parallel(plan: Plan, ctx: ExportContext) -> None:
    """DeepSpeed's context parallelism is Ulysses (all-to-all) sequence parallelism, set up by the training
    script (deepspeed.runtime.sequence_parallel's mpu, UlyssesSPAttentionHF), not by ds_config.json, whose
    sequence_parallel_size only rescales its batch arithmetic; and it has no ring. So an exported config
    cannot express cp: refuse, naming the plan with the CP ranks turned into DP ranks where the batch allows."""
    why = (f"cp {plan.cp}: DeepSpeed's config has no context parallelism (its Ulysses sequence parallelism is set "
           f"up in the training script); export to megatron or torchtitan")
    dp = plan.dp * plan.cp
    global_batch = ctx.problem.job.global_batch
    if global_batch % dp == 0:
        per_rank = global_batch // dp
        micro_batch = plan.micro_batch if per_rank % plan.micro_batch == 0 else 1
        closest = plan.replace(cp=1, cp_kind="ring", dp=dp, micro_batch=micro_batch,
                               num_micro_batches=per_rank // micro_batch,
                               **dict(zip(("param_shard", "grad_shard", "optim_shard"), plan.shard_degrees)))
        raise refuse("deepspeed", VERSION, why, express(closest, ctx.problem.model.num_layers,
                                                        ctx.problem.job.precision)[0], ctx)
    raise Refused(f"{VERSION} would reject this plan ({why})")


def express(plan: Plan, num_layers: int, precision: str) -> tuple[Plan, list[str]]:
    """The plan as DeepSpeed runs it, and one line per knob it cannot express."""
    dp = plan.dp
    changes, lines = knob_table_gaps(plan, "deepspeed")
    recompute, recompute_lines = uniform_recompute(plan, "deepspeed")
    changes.update(recompute)
    lines += recompute_lines
    lines += _pipeline_gaps(plan, num_layers, changes)
    points = [zero_degrees(level, dp) for level in range(4)]
    chosen = cover_sharding(plan, points)
    if chosen != plan.shard_degrees:
        changes.update(zip(("param_shard", "grad_shard", "optim_shard"), chosen))
        lines.append(f"{sharding_name(plan.shard_degrees, dp)}: DeepSpeed shards by ZeRO stage over all of DP (MiCS "
                     f"was removed in 0.19.7); exported as {sharding_name(chosen, dp)}")
    if chosen[0] == 1 and changes.get("param_cache", plan.param_cache) != "none":
        changes["param_cache"] = "none"
    if plan.reduce_fp32 and precision != "fp32" and not (precision == "bf16" and dp > 1 and chosen == zero_degrees(1, dp)):
        # Only ZeRO-1 under bf16 takes grad_accum_dtype fp32 (its BF16_Optimizer); ZeRO-2/3 keep gradients in
        # the model's dtype and a run without ZeRO refuses the mix (engine._do_optimizer_sanity_check).
        changes["reduce_fp32"] = False
        lines.append(f"reduce_fp32=True: DeepSpeed accumulates {precision} gradients in fp32 only under ZeRO-1 with "
                     f"bf16; exported with {precision} gradient reduction")
    return plan.replace(**changes), lines


def _pipeline_gaps(plan: Plan, num_layers: int, changes: dict) -> list[str]:
    """DeepSpeed's pipeline engine runs 1F1B over equal stages, one chunk per rank (TrainSchedule,
    PipelineModule's uniform partition)."""
    lines = []
    if plan.pp == 1:
        return lines
    if plan.virtual_stages > 1:
        changes.update(virtual_stages=1, schedule="1f1b", stage_layers=None)
        lines.append(f"virtual_stages={plan.virtual_stages}: DeepSpeed's pipeline has one stage per rank; exported as "
                     f"1F1B without interleaving")
    elif plan.schedule != "1f1b":
        changes["schedule"] = "1f1b"
        lines.append(f"schedule={plan.schedule!r}: DeepSpeed's pipeline engine runs 1F1B (TrainSchedule); exported as 1F1B")
    counts = plan.chunk_layer_counts(num_layers)
    if plan.stage_layers is not None and len(set(counts)) > 1 and "stage_layers" not in changes:
        changes["stage_layers"] = None
        lines.append(f"stage_layers={list(counts)}: PipelineModule partitions by layer count ('uniform'); exported "
                     f"as an even split")
    return lines


def ds_config(plan: Plan, ctx: ExportContext) -> dict:
    """The DeepSpeed config dict of the (expressed) plan."""
    problem, job = ctx.problem, ctx.problem.job
    element_bytes = 4 if job.precision == "fp32" else 2
    config: dict = {"train_batch_size": job.global_batch, "train_micro_batch_size_per_gpu": plan.micro_batch,
                    "gradient_accumulation_steps": plan.num_micro_batches,
                    # DeepSpeed runs "Adam" as AdamW unless adam_w_mode is false; the job's optimizer is Adam.
                    "optimizer": {"type": "Adam", "params": {"lr": 3e-4, "betas": [0.9, 0.999], "eps": 1e-8,
                                                             "weight_decay": 0.0, "adam_w_mode": False}},
                    "gradient_clipping": 0.0}
    if job.precision in ("bf16", "fp16"):
        config[job.precision] = {"enabled": True}
    stage = plan.zero_level if plan.dp > 1 else 0
    if plan.reduce_fp32 and job.precision == "bf16":  # express() keeps it only on ZeRO-1 (its BF16_Optimizer)
        config.update({"data_types": {"grad_accum_dtype": "fp32"}, "communication_data_type": "fp32"})
        element_bytes = 4
    zero: dict = {"stage": stage, "overlap_comm": plan.dp > 1, "contiguous_gradients": True,
                  "reduce_bucket_size": max(1, plan.bucket_size_bytes // element_bytes)}
    if stage == 3:
        from cost_models.memory import layer_params_per_device

        zero["stage3_prefetch_bucket_size"] = max(1, plan.prefetch_depth) * int(layer_params_per_device(problem.model,
                                                                                                        tp=plan.tp))
        if plan.param_cache == "secondary":
            zero["zero_hpz_partition_size"] = dp_ranks_per_node(plan, problem)
    config["zero_optimization"] = zero
    if plan.tp > 1:
        config["tensor_parallel"] = {"autotp_size": plan.tp}
    if plan.recompute != "none":
        config["activation_checkpointing"] = {"partition_activations": plan.tp > 1,
                                              "contiguous_memory_optimization": False, "cpu_checkpointing": False}
    if plan.pp > 1:
        config["pipeline"] = {"stages": plan.pp, "partition": "uniform",
                              "activation_checkpoint_interval": 1 if plan.recompute == "full" else 0}
    return config


def hf_moe_type(model) -> str:
    """The HF MoE architecture of an MoE model (its attention and shared expert decide), or Refused."""
    moe_type = ("qwen3_moe" if model.qk_norm and not model.qkv_bias and not model.shared_expert_ffn_hidden_size
                else "qwen2_moe" if model.qkv_bias and not model.qk_norm and model.shared_expert_gate
                else "mixtral" if not (model.qk_norm or model.qkv_bias or model.shared_expert_ffn_hidden_size
                                       or model.num_dense_layers or not model.norm_topk_prob) else None)
    why = ("multi-head latent attention" if model.uses_mla else
           "a capacity factor (HF's MoE blocks are dropless)" if model.capacity_factor > 0 else
           "no HF architecture has its mix of attention, shared expert, dense layers and top-k weights"
           if moe_type is None else "")
    if why:
        raise Refused(f"DeepSpeed export of mixture-of-experts model {model.name} is not supported: {why}; "
                      f"export it to megatron")
    return moe_type


def _hf_moe_keys(model, config: dict) -> dict:
    """The MoE keys of the model's HF architecture (hf_moe_type) over its dense llama/qwen config."""
    moe_type = hf_moe_type(model)
    arch = {"mixtral": "MixtralForCausalLM", "qwen2_moe": "Qwen2MoeForCausalLM", "qwen3_moe": "Qwen3MoeForCausalLM"}
    config = dict(config, model_type=moe_type, architectures=[arch[moe_type]], num_experts_per_tok=model.num_experts_per_token,
                  router_aux_loss_coef=model.aux_loss_coeff, output_router_logits=model.aux_loss_coeff > 0)
    config.pop("mlp_bias", None)
    if moe_type == "mixtral":
        return dict(config, num_local_experts=model.num_experts, intermediate_size=model.expert_ffn_hidden_size,
                    sliding_window=None)
    config.update(num_experts=model.num_experts, moe_intermediate_size=model.expert_ffn_hidden_size,
                  norm_topk_prob=model.norm_topk_prob, decoder_sparse_step=1,
                  mlp_only_layers=list(range(model.num_dense_layers)))
    if moe_type == "qwen2_moe":
        config["shared_expert_intermediate_size"] = model.shared_expert_ffn_hidden_size
    return config


def _hf_rope_scaling(model) -> dict | None:
    """The config's rope_scaling: Llama 3.1's llama3 type with its parameters, else none (DeepSpeed's export
    refuses the HF types whose parameters the planner does not keep)."""
    if model.rope_scaling == "none":
        return None
    if model.rope_scaling != "llama3":
        raise Refused(f"DeepSpeed export of {model.name} is not supported: its {model.rope_scaling} rope scaling's "
                      f"parameters are not kept by the planner; export it to megatron")
    return {"rope_type": "llama3", "factor": model.rope_scaling_factor, "low_freq_factor": model.rope_low_freq_factor,
            "high_freq_factor": model.rope_high_freq_factor,
            "original_max_position_embeddings": model.rope_original_max_positions}


def hf_config(model) -> dict:
    """The model as an HF transformers config.json (llama, qwen2, qwen3, mixtral, qwen2_moe, qwen3_moe or gpt2),
    the model definition DeepSpeed scripts load: Qwen2's q/k/v biases are model_type qwen2, Qwen3's
    query/key head norms qwen3, each with its architecture's own keys (export_deepspeed refuses both at once:
    no HF architecture has them); an MoE model the HF MoE architecture of its attention (hf_moe_type)."""
    if model.is_moe:
        return _hf_moe_keys(model, hf_config(dense_view(model)))
    if model.arch == "llama":
        config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": model.hidden_size,
                  "intermediate_size": model.ffn_hidden_size, "num_hidden_layers": model.num_layers,
                  "num_attention_heads": model.num_heads, "num_key_value_heads": model.num_kv_heads,
                  "head_dim": model.head_dim, "vocab_size": model.vocab_size,
                  "max_position_embeddings": model.max_seq_len, "rope_theta": model.rope_theta,
                  "rope_scaling": _hf_rope_scaling(model),
                  "rms_norm_eps": model.norm_eps, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
                  "attention_dropout": 0.0, "tie_word_embeddings": model.tied_embeddings}
        if model.qk_norm:
            del config["mlp_bias"]
            config.update(model_type="qwen3", architectures=["Qwen3ForCausalLM"], use_sliding_window=False)
        elif model.qkv_bias:
            for key in ("mlp_bias", "attention_bias", "head_dim"):  # Qwen2: biases always, head_dim = h / heads
                del config[key]
            config.update(model_type="qwen2", architectures=["Qwen2ForCausalLM"], use_sliding_window=False)
        return config
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "n_embd": model.hidden_size,
            "n_layer": model.num_layers, "n_head": model.num_heads, "n_inner": model.ffn_hidden_size,
            "n_positions": model.max_seq_len, "vocab_size": model.vocab_size,
            "activation_function": "gelu" if model.gelu_approximation == "none" else "gelu_new",
            "layer_norm_epsilon": model.norm_eps, "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0,
            "tie_word_embeddings": model.tied_embeddings}


def _launch_script(plan: Plan, ctx: ExportContext) -> str:
    cluster = ctx.problem.cluster
    lines = launch_header(VERSION, plan, ctx.problem)
    lines += ["# train.py is your training script (see the notes); HOSTFILE lists the nodes as 'host slots=N'.",
              'cd "$(dirname "$0")"']
    hosts = "" if cluster.num_nodes == 1 else '--hostfile "${HOSTFILE:-hostfile}" '
    lines.append(f"deepspeed {hosts}--num_nodes {cluster.num_nodes} --num_gpus {cluster.devices_per_node} "
                 f"train.py --deepspeed --deepspeed_config ds_config.json --model-config config.json")
    return "\n".join(lines) + "\n"
