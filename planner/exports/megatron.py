"""A plan as Megatron-LM's `pretrain_gpt.py` arguments and its torchrun launch script.

Flag names, defaults and rules from Megatron-LM main d98e8a64 (0.20.0, 2026-08-22), every flag also
present in core_v0.16.1 (tests/fixtures/megatron/flags_*.json); the rules are planner/exports/megatron_rules.py.

- Model: --num-layers, --hidden-size, --ffn-hidden-size, --num-attention-heads, --group-query-attention
  with --num-query-groups, --kv-channels, --seq-length, --max-position-embeddings; llama: rope with
  --rotary-base (the model's RoPE base), RMSNorm, --swiglu, --disable-bias-linear; --norm-epsilon; dropout 0
  (the engine has none); --untie-embeddings-and-output-weights for untied models; the vocabulary as
  NullTokenizer + --vocab-size over mock data, padded only as far as Megatron must (TP).
- Plan: --tensor-model-parallel-size, --context-parallel-size with --cp-comm-type (ring p2p, all-to-all
  a2a, hierarchical a2a+p2p with --hierarchical-context-parallel-sizes "a2a ring", Megatron's inner-first
  order as the plan's mesh), --sequence-parallel, --pipeline-model-parallel-size with
  --pipeline-model-parallel-layout (every stage split, equal, unequal or interleaved, exactly), the
  micro and global batch, recomputation (full: uniform, one layer per checkpoint; selective: the
  attention core), sharding (ZeRO-1 the distributed optimizer, over groups of g with
  --num-distributed-optimizer-instances dp/g; ZeRO-2/3 Megatron-FSDP optim_grads / optim_grads_params),
  --overlap-grad-reduce / --overlap-param-gather, --ddp-bucket-size; Adam as the job's (betas, eps, no
  weight decay, no clipping).
- MoE models: --num-experts, --moe-ffn-hidden-size, --moe-router-topk, --moe-layer-freq for leading dense
  layers, --moe-shared-expert-intermediate-size (with --moe-shared-expert-gate for Qwen2-MoE),
  --moe-aux-loss-coeff with --moe-router-load-balancing-type seq_aux_loss (the engine's per-sequence
  loss), --moe-expert-capacity-factor with --moe-token-drop-policy position (earliest positions kept) or
  dropless, the alltoall dispatcher, grouped GEMMs and an fp32 router; Qwen3's --qk-layernorm, Qwen2's
  --add-qkv-bias, DeepSeek-V3's --multi-latent-attention with its ranks and head dims; the plan's
  --expert-model-parallel-size and --expert-tensor-parallel-size (Megatron-Core folds them as the plan does).
- Environment: CUDA_DEVICE_MAX_CONNECTIONS=1 with tensor parallelism on pre-Blackwell GPUs (Megatron
  asserts it), and unset under Megatron-FSDP (which asserts the opposite).
"""

from __future__ import annotations

from specs.errors import PlannerError
from specs.plan import Plan
from planner.exports.common import (Export, ExportContext, cover_sharding, knob_table_gaps, launch_header,
                                    sharding_name, uniform_recompute)
from planner.exports.megatron_rules import megatron_violations

VERSION = "Megatron-LM main 0.20.0 (d98e8a64, 2026-08-22; every flag also in core_v0.16.1)"


def export_megatron(plan: Plan, ctx: ExportContext) -> Export:
    problem = ctx.problem
    changes, lines = knob_table_gaps(plan, "megatron")
    recompute, recompute_lines = uniform_recompute(plan, "megatron")
    changes.update(recompute)
    lines += recompute_lines
    if plan.pp > 1 and plan.schedule == "gpipe":
        changes["schedule"] = "1f1b"
        lines.append("schedule='gpipe': Megatron runs 1F1B (the same bubble, fewer micro-batches in flight); exported as 1F1B")
    shard, shard_lines = _sharding(plan)
    changes.update(zip(("param_shard", "grad_shard", "optim_shard"), shard))
    lines += shard_lines
    expressed = plan.replace(**changes)
    args = _arguments(expressed, ctx)
    env = _environment(expressed, args)
    violations = megatron_violations(args, world_size=problem.cluster.num_devices, env=env)
    if violations:
        raise PlannerError(f"{VERSION} would reject the exported arguments: {violations[0]}")
    text = _launch_script(expressed, ctx, args, env)
    notes = ["data: the script trains on --mock-data with a NullTokenizer of the model's vocabulary; for real data give "
             "--data-path and --tokenizer-type HuggingFaceTokenizer --tokenizer-model <path>",
             "--train-iters and --lr are placeholders: set your schedule"]
    model = problem.model
    if model.rope_scaling == "llama3" and (model.rope_low_freq_factor, model.rope_high_freq_factor,
                                           model.rope_original_max_positions) != (1.0, 4.0, 8192):
        notes.append("RoPE: Megatron-Core's llama3 scaling fixes low_freq_factor 1, high_freq_factor 4 and "
                     "original_max_position_embeddings 8192 (RotaryEmbedding._apply_scaling); the model's "
                     f"{model.rope_low_freq_factor:g}, {model.rope_high_freq_factor:g}, "
                     f"{model.rope_original_max_positions} are not exported")
    elif model.rope_scaling not in ("none", "llama3"):
        notes.append(f"RoPE: the model's {model.rope_scaling} scaling is not exported (unscaled RoPE)")
    if model.gelu_approximation == "tanh":
        notes.append("GELU: Megatron-Core's GPT model runs exact (erf) GELU; its --openai-gelu (the model's tanh "
                     "approximation) reaches only the legacy model, so the export trains exact GELU")
    return Export(target="megatron", version=VERSION, files={"launch.sh": text}, main="launch.sh", expressed=expressed,
                  cannot_express=tuple(lines), notes=tuple(notes), settings={"args": args, "env": env})


def _sharding(plan: Plan) -> tuple[tuple[int, int, int], list[str]]:
    """The Megatron point for the plan's sharding (module docstring), and a line when it differs."""
    dp = plan.dp_cp  # Megatron's data-parallel group with CP: gradients and optimizer shards over dp x cp
    points = [(1, 1, 1), (1, dp, dp), (dp, dp, dp)] + [(1, 1, g) for g in range(2, dp + 1) if dp % g == 0]
    chosen = cover_sharding(plan, points)
    if chosen == plan.shard_degrees:
        return chosen, []
    return chosen, [f"{sharding_name(plan.shard_degrees, dp)}: Megatron shards parameters and gradients only over "
                    f"all of DP (Megatron-FSDP) and the optimizer over groups (distributed optimizer); exported as "
                    f"{sharding_name(chosen, dp)}, which shards each at least as much"]


def vocab_divisor(vocab: int, tp: int) -> int:
    """The largest --make-vocab-size-divisible-by (Megatron's default 128, halved) that leaves the vocabulary
    unpadded: Megatron pads it to a multiple of divisor x TP."""
    for divisor in (128, 64, 32, 16, 8, 4, 2, 1):
        if vocab % (divisor * tp) == 0:
            return divisor
    return 1


def _model_arguments(ctx: ExportContext) -> dict:
    model, job = ctx.problem.model, ctx.problem.job
    args: dict = {"--num-layers": model.num_layers, "--hidden-size": model.hidden_size,
                  "--ffn-hidden-size": model.ffn_hidden_size, "--num-attention-heads": model.num_heads}
    if model.num_kv_heads != model.num_heads:
        args.update({"--group-query-attention": True, "--num-query-groups": model.num_kv_heads})
    args["--kv-channels"] = model.head_dim
    args["--seq-length"] = job.seq_len
    args["--max-position-embeddings"] = model.max_seq_len if model.learned_positions else max(model.max_seq_len,
                                                                                              job.seq_len)
    if model.arch == "llama":
        args.update({"--position-embedding-type": "rope", "--rotary-base": int(model.rope_theta), "--normalization": "RMSNorm",
                     "--swiglu": True, "--disable-bias-linear": True})
    if model.rope_scaling == "llama3":  # gpt_builders.py: rope_scaling=args.use_rope_scaling, and its factor
        args.update({"--use-rope-scaling": True, "--rope-scaling-factor": model.rope_scaling_factor})
    args.update({"--norm-epsilon": model.norm_eps, "--attention-dropout": 0.0, "--hidden-dropout": 0.0})
    if not model.tied_embeddings:
        args["--untie-embeddings-and-output-weights"] = True
    args.update(_attention_variant_arguments(model))
    if model.is_moe:
        args.update(_moe_arguments(model))
    return args


def _attention_variant_arguments(model) -> dict:
    args: dict = {}
    if model.qk_norm:
        args["--qk-layernorm"] = True
    if model.qkv_bias:
        args["--add-qkv-bias"] = True
    if model.uses_mla:
        args.update({"--multi-latent-attention": True, "--kv-lora-rank": model.kv_lora_rank,
                     "--qk-head-dim": model.qk_nope_head_dim, "--qk-pos-emb-head-dim": model.qk_rope_head_dim,
                     "--v-head-dim": model.v_head_dim})
        if model.q_lora_rank:
            args["--q-lora-rank"] = model.q_lora_rank
    return args


def _moe_arguments(model) -> dict:
    """The MoE layers as the engine runs them (runners/moe.py; module docstring)."""
    args: dict = {"--num-experts": model.num_experts, "--moe-ffn-hidden-size": model.expert_ffn_hidden_size,
                  "--moe-router-topk": model.num_experts_per_token, "--moe-token-dispatcher-type": "alltoall",
                  "--moe-grouped-gemm": True, "--moe-router-dtype": "fp32"}
    if not model.norm_topk_prob:  # softmax over all experts, the chosen k's probabilities not renormalised
        args["--moe-router-pre-softmax"] = True
    if model.num_dense_layers:
        args["--moe-layer-freq"] = f"([0]*{model.num_dense_layers}+[1]*{model.num_moe_layers})"
    if model.shared_expert_ffn_hidden_size:
        args["--moe-shared-expert-intermediate-size"] = model.shared_expert_ffn_hidden_size
        if model.shared_expert_gate:
            args["--moe-shared-expert-gate"] = True
    if model.aux_loss_coeff > 0:
        args.update({"--moe-router-load-balancing-type": "seq_aux_loss", "--moe-aux-loss-coeff": model.aux_loss_coeff})
    else:
        args["--moe-router-load-balancing-type"] = "none"
    if model.capacity_factor > 0:
        args.update({"--moe-expert-capacity-factor": model.capacity_factor, "--moe-token-drop-policy": "position"})
    return args


def _arguments(plan: Plan, ctx: ExportContext) -> dict:
    model, job = ctx.problem.model, ctx.problem.job
    args = _model_arguments(ctx)
    args.update({"--tokenizer-type": "NullTokenizer", "--vocab-size": model.vocab_size,
                 "--make-vocab-size-divisible-by": vocab_divisor(model.vocab_size, plan.tp), "--mock-data": True})
    args.update({"--tensor-model-parallel-size": plan.tp, "--pipeline-model-parallel-size": plan.pp})
    if model.is_moe:
        args.update({"--expert-model-parallel-size": plan.ep, "--expert-tensor-parallel-size": plan.etp})
    args.update(_context_arguments(plan, ctx))
    if plan.sequence_parallel:
        args["--sequence-parallel"] = True
    if plan.pp > 1:
        args["--pipeline-model-parallel-layout"] = pipeline_layout(plan, model.num_layers)
    args.update({"--micro-batch-size": plan.micro_batch, "--global-batch-size": job.global_batch})
    if plan.recompute == "full":
        args.update({"--recompute-granularity": "full", "--recompute-method": "uniform", "--recompute-num-layers": 1})
    elif plan.recompute == "selective":
        args.update({"--recompute-granularity": "selective", "--recompute-modules": "core_attn"})
    args.update(_sharding_arguments(plan, job))
    if job.precision in ("bf16", "fp16"):
        args[f"--{job.precision}"] = True
        # Megatron accumulates and reduces bf16 gradients in fp32 unless told otherwise, fp16 ones in fp16.
        if job.precision == "bf16" and not plan.reduce_fp32:
            args["--grad-reduce-in-bf16"] = True
        elif job.precision == "fp16" and plan.reduce_fp32:
            args["--accumulate-allreduce-grads-in-fp32"] = True
    args.update({"--optimizer": "adam", "--adam-beta1": 0.9, "--adam-beta2": 0.999, "--adam-eps": 1e-8,
                 "--weight-decay": 0.0, "--clip-grad": 0.0, "--lr": 3e-4, "--train-iters": 1000})
    return args


def _context_arguments(plan: Plan, ctx: ExportContext) -> dict:
    """--context-parallel-size and --cp-comm-type; the hierarchical kind with its (all-to-all, ring) sizes
    as the plan's cluster places them (Plan.cp_split)."""
    if plan.cp == 1:
        return {}
    args: dict = {"--context-parallel-size": plan.cp}
    if plan.cp_kind == "ring":
        args["--cp-comm-type"] = "p2p"
    elif plan.cp_kind == "all-to-all":
        args["--cp-comm-type"] = "a2a"
    else:
        a2a, ring = plan.cp_split(ranks_per_node=ctx.problem.cluster.devices_per_node)
        args.update({"--cp-comm-type": "a2a+p2p", "--hierarchical-context-parallel-sizes": f"{a2a} {ring}"})
    return args


def _sharding_arguments(plan: Plan, job) -> dict:
    dp, (s_p, s_g, s_os) = plan.dp_cp, plan.shard_degrees
    args: dict = {}
    if s_g > 1:
        args.update({"--use-megatron-fsdp": True,
                     "--data-parallel-sharding-strategy": "optim_grads_params" if s_p > 1 else "optim_grads",
                     "--ckpt-format": "fsdp_dtensor"})
    elif s_os > 1:
        args["--use-distributed-optimizer"] = True
        if s_os < dp:
            args["--num-distributed-optimizer-instances"] = dp // s_os
    if dp > 1:
        args["--overlap-grad-reduce"] = True
        if s_os > 1:
            args["--overlap-param-gather"] = True
        # Megatron counts its buckets in gradient elements, the plan in bytes.
        grad_bytes = 4 if job.precision == "fp32" or plan.reduce_fp32 else 2
        args["--ddp-bucket-size"] = max(1, plan.bucket_size_bytes // grad_bytes)
    return args


def pipeline_layout(plan: Plan, num_layers: int) -> str:
    """The --pipeline-model-parallel-layout of the plan's chunks: one stage per chunk in Megatron's
    interleaved order (chunk c on rank c % pp, as in the plan), E on the first, L on the last."""
    stages = []
    counts = plan.chunk_layer_counts(num_layers)
    for c, count in enumerate(counts):
        stage = f"t*{count}" if count > 1 else "t"
        if c == 0:
            stage = "E" + stage
        if c == len(counts) - 1:
            stage += "L"
        stages.append(stage)
    return "|".join(stages)


def _environment(plan: Plan, args: dict) -> dict:
    """What Megatron asserts of CUDA_DEVICE_MAX_CONNECTIONS (megatron_rules; the value "" means unset)."""
    if "--use-megatron-fsdp" in args:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": ""}
    if plan.tp > 1 or plan.cp > 1:
        return {"CUDA_DEVICE_MAX_CONNECTIONS": "1"}
    return {}


def _launch_script(plan: Plan, ctx: ExportContext, args: dict, env: dict) -> str:
    cluster = ctx.problem.cluster
    lines = launch_header(VERSION, plan, ctx.problem)
    lines += ["# Run from a Megatron-LM checkout on every node, with NODE_RANK, MASTER_ADDR and MASTER_PORT set."]
    for name, value in env.items():
        if value == "":
            lines.append(f"unset {name}  # Megatron-FSDP asserts it is not 1")
        else:
            lines.append(f"export {name}={value}  # Megatron asserts it with tensor or context parallelism before Blackwell")
    parts = [f"torchrun --nproc-per-node {cluster.devices_per_node} --nnodes {cluster.num_nodes} "
             f'--node-rank "${{NODE_RANK:-0}}" --master-addr "${{MASTER_ADDR:-localhost}}" '
             f'--master-port "${{MASTER_PORT:-6000}}"', "pretrain_gpt.py"]
    for flag, value in args.items():
        parts.append(flag if value is True else f"{flag} {_shell_value(value)}")
    return "\n".join(lines) + "\n" + " \\\n    ".join(parts) + "\n"


def _shell_value(value) -> str:
    text = repr(value) if isinstance(value, float) else str(value)
    return f"'{text}'" if "|" in text or "*" in text else text
