"""How each training engine runs a plan: the kernels it launches and how it overlaps communication.

The same plan costs different time in different engines: Megatron-LM fuses its elementwise kernels
and (with Transformer Engine) hides tensor-parallel communication behind GEMMs and reduces fp32 main
gradients; torchtitan (FSDP2) runs eager PyTorch with SDPA and reduces in fp32; llm-foundry's Composer
(FSDP1) the same with FlashAttention-2; the Megatron-LM of SC21 (2021) and the Megatron-DeepSpeed of
BLOOM (2022) predate FlashAttention and materialise the attention scores. `estimate(..., engine=...)`
prices a plan as one of these runs it; "ours" is this project's engine (runners/). Each field is a
mechanism, set from the engine's documentation and source, never fitted to measured runs.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.planfile import ENGINES as ENGINE_NAMES


@dataclass(frozen=True)
class EngineModel:
    name: str
    description: str
    # The attention core: "flash3" (FlashAttention-3 / cuDNN fused attention on Hopper, FlashAttention-2
    # elsewhere), "flash2" (FlashAttention-2 everywhere), "flash1" (FlashAttention-1 or its Triton
    # implementation: llm-foundry's runs before 2024), "materialized" (scores, softmax and dropout
    # in HBM), or "by-arch" (this project's engine on CPU: llama fused, gpt2 materialised).
    attention: str
    # Megatron's fused kernels: LayerNorm/RMSNorm, bias-GeLU / SwiGLU, bias-dropout-add, RoPE in one pass
    # each; otherwise eager PyTorch with a kernel (and a round trip through HBM) per op.
    fused_elementwise: bool
    # Share of tensor-parallel communication hidden behind GEMMs (Transformer Engine's userbuffer
    # overlap, Megatron --tp-comm-overlap): 0 when every TP collective waits in line.
    tp_comm_hidden: float
    # Gradients are reduced in fp32 (Megatron's fp32 main gradients, torchtitan's FSDP2 reduce_dtype),
    # which doubles the DP reduction bytes of bf16 training.
    reduce_fp32: bool
    # Megatron keeps an fp32 main-gradient buffer of every local parameter (not sharded by the
    # distributed optimizer): 4 bytes per parameter where bf16 gradients take 2.
    main_grads_fp32: bool
    # The DP gradient reduction waits until the pipeline has drained (DeepSpeed's pipeline engine),
    # instead of overlapping each bucket with the remaining backward.
    reduce_after_pipeline: bool = False
    # GPT layers with Megatron's hidden dropout (its default 0.1): the bias-dropout-add writes a mask.
    gpt_dropout: bool = True
    # Gradients stay whole on every rank until the accumulation boundary and are reduce-scattered once
    # there (Megatron's distributed optimizer, DeepSpeed ZeRO-1/2), where sharded gradients (this
    # engine, FSDP) are reduce-scattered after every micro-batch.
    reduce_scatter_once: bool = False
    # Context parallelism: whether the engine runs it (Megatron-LM's --context-parallel-size,
    # torchtitan's context_parallel_degree; not the SC21 Megatron nor Megatron-DeepSpeed), and whether a
    # ring's partial blocks run on a fused attention kernel (Transformer Engine, torch's ring over SDPA)
    # rather than the engine's own steps (this engine's log-sum-exp blocks: `ring_blocks_written_out`).
    context_parallel: bool = True
    fused_ring_blocks: bool = True
    # MoE token dispatch (Megatron-Core --moe-token-dispatcher-type / --moe-flex-dispatcher-backend):
    # "alltoall" sends every (token, expert) assignment to its expert's rank, duplicates included (NCCL
    # all-to-all of the permuted rows); "deepep" / "hybridep" (the flex dispatcher) send a token once per
    # destination node over the NIC and fan it out to the node's experts over NVLink (cost_models/moe.py).
    moe_dispatcher: str = "alltoall"
    # Megatron-Core's EP communication overlap (--overlap-moe-expert-parallel-comm, the combined 1F1B
    # schedule): one micro-batch's dispatch and combine run beside another's forward or backward compute.
    moe_a2a_overlap: bool = False
    # Expert GEMMs run at once on one rank (cost_models/moe.concurrent_rounds): Transformer Engine's
    # GroupedLinear spreads the local experts' GEMMs over its 4 compute streams; this project's engine runs
    # them one by one.
    expert_gemm_streams: int = 1
    # HBM bytes the optimizer step moves per parameter of the rank's shard (estimate.ADAM_BYTES_PER_PARAM:
    # one fused pass, 28), more where the engine's optimizer runs one unfused kernel per operation.
    optimizer_bytes_per_param: float = 28.0  # == estimate.ADAM_BYTES_PER_PARAM
    # fp8 weights kept only as fp8 (Megatron's --fp8-param-gather, Megatron-Bridge's fp8 mixed-precision
    # configs' fp8_param_gather=True): no bf16 copy, the fp8 weight and its transpose (memory.py,
    # state_bytes_per_param), and the distributed optimizer all-gathers 1-byte parameters. Off by default:
    # Megatron-LM keeps bf16 weights unless the flag is given; a run's recipe turns it on (planner/published.py).
    fp8_param_gather: bool = False

    # What the selective policy recomputes (Megatron-Core --recompute-modules under --recompute-granularity
    # selective; transformer_config.py): "core_attn" (its default, and every other engine's selective),
    # "layernorm" (the input and pre-MLP norms), "moe_act" (the experts' SwiGLU) and "moe" (the whole MoE
    # layer, its dispatch and combine included: moe_layer.py checkpoints router to combine).
    recompute_modules: tuple[str, ...] = ("core_attn",)
    # Context parallelism in an MoE model: Megatron-Core folds CP into the attention side and the MoE layers
    # route each CP rank's tokens (parallel folding), as this project's engine does (runners/moe.py, which
    # sums a sequence's expert counts over CP) and torchtitan 0.3 does (its qwen3 decoder wraps only the
    # attention core for CP, its token dispatcher takes the seq_len / (cp x tp) tokens CP and SP leave a rank,
    # and its EP folds over dp_shard x cp x tp); the others are not modelled running MoE with CP.
    moe_context_parallel: bool = False
    # What the engine's FSDP does to the whole unsharded gradient every micro-batch before its reduce-scatter
    # (`estimate.unsharded_grad_pass_bytes`): "fsdp1", PyTorch FSDP1 (llm-foundry's Composer): the
    # concatenation of the original parameters' gradients into the flat parameter's, the cast to the reduce
    # dtype and the in-place pre-divide; "fsdp2" (torchtitan): the copy of each gradient into the
    # reduce-scatter input in the reduce dtype (foreach_reduce_scatter_copy_in). Empty where none is priced:
    # Megatron accumulates into its main-gradient buffer inside the wgrad GEMM and scales the bucket once per
    # step; this engine's copies are not priced.
    unsharded_grad_passes: str = ""
    # llm-foundry's `attn_impl: flash` (llmfoundry/models/layers/attention.py, flash_attn_fn) packs q, k and v
    # into unpadded rows before FlashAttention's varlen kernel and scatters the output back, each layer
    # (flash_attn.bert_padding: unpad_input / pad_input, priced in compute.unpadded_attention_bytes); its
    # Triton path (`attn_impl: triton`, the CSV's flash1 rows) calls the kernel on the padded tensors.
    unpadded_attention: bool = False
    # DeepSpeed ZeRO-3's gradient reduction, MiCS's included (deepspeed/runtime/zero/stage3.py,
    # `__reduce_and_partition_ipg_grads`; mics.py, `allreduce_mics_shard_grads`): gradients go bucket by bucket,
    # a bucket being up to `reduce_bucket_size` elements of unsharded gradient (default 5e8,
    # deepspeed/runtime/zero/config.py), reduce-scattered in the shard group and, at the accumulation boundary,
    # the bucket's shard all-reduced across the replication group right after it on the same stream; the last
    # bucket is reduced after the backward (`independent_gradient_partition_epilogue`) and waited for. So the
    # last boundary all-reduce is that bucket's 1/s_g shard. 0: the plan's bucket_size_bytes, counted as this
    # engine counts it (runners/sharding/buckets.py: reduce-scatter buckets of whole gradient, boundary buckets
    # of shard bytes).
    reduce_bucket_elements: int = 0
    # Under sequence parallelism each TP rank sees its own tokens, so the gradients of the TP-replicated
    # parameters (norms, row-parallel biases, learned positions) are summed over the TP group. "micro_batch":
    # one all-reduce per parameter in every micro-batch's backward (this engine: tensor_parallel.
    # sequence_parallel_param, f's backward on the parameter itself); "step": one coalesced all-reduce per
    # step after the last backward (Megatron's finalize_model_grads, _allreduce_layernorm_grads), a few
    # kilobytes, not priced.
    sp_replicated_grad_reduce: str = "step"


# Composer's DecoupledAdamW (composer/optim/decoupled_weight_decay.py, `adamw`), which llm-foundry's MPT yamls
# name (`optimizer: name: decoupled_adamw`), updates each fp32 shard in a Python loop of unfused in-place
# kernels, bytes read + written per element: param.mul_ 8, exp_avg.mul_ 8, exp_avg.add_(grad) 12,
# exp_avg_sq.mul_ 8, exp_avg_sq.addcmul_(grad, grad) 12, exp_avg_sq.sqrt() 8, / sqrt(bias_correction2) 8,
# .add_(eps) 8, param.addcdiv_(exp_avg, denom) 16: 88. The same yamls clip the gradient norm
# (`algorithms: gradient_clipping: clipping_type: norm`), FSDP's clip_grad_norm_: a norm pass (4) and an
# in-place scale (8) over every gradient shard: 12.
COMPOSER_ADAMW_BYTES_PER_PARAM = 88.0 + 12.0
# This project's engine (runners/sharding/adam.py, adam_update) runs torch.optim.Adam's single-tensor
# arithmetic on each unit's fp32 shard: the 2-byte reduced gradient copied to fp32 (optim_grad: 6), then
# exp_avg.lerp_ 12, exp_avg_sq.mul_ 8, .addcmul_ 12, sqrt 8, / 8, .add_(eps) 8, master.addcdiv_ 16 and the
# compute-dtype slice refreshed from the master (6): 84. (Under fp32 gradients the first copy is a no-op:
# 78; not told apart here.)
OURS_ADAM_BYTES_PER_PARAM = 6.0 + 12 + 8 + 12 + 8 + 8 + 8 + 16 + 6


RECOMPUTE_MODULES = ("core_attn", "layernorm", "moe_act", "moe")

ENGINES: dict[str, EngineModel] = {e.name: e for e in (
    EngineModel("ours", "this project's engine (runners/): eager PyTorch, SDPA attention, bf16 reduction",
                attention="by-arch", fused_elementwise=False, tp_comm_hidden=0.0, reduce_fp32=False,
                main_grads_fp32=False, fused_ring_blocks=False, optimizer_bytes_per_param=OURS_ADAM_BYTES_PER_PARAM,
                sp_replicated_grad_reduce="micro_batch", moe_context_parallel=True),
    EngineModel("megatron", "Megatron-LM / NeMo with Transformer Engine (2024+): fused kernels, cuDNN fused "
                "attention, TP communication overlap, distributed optimizer with fp32 main gradients",
                attention="flash3", fused_elementwise=True, tp_comm_hidden=0.8, reduce_fp32=True,
                main_grads_fp32=True, reduce_scatter_once=True, moe_context_parallel=True, expert_gemm_streams=4),
    EngineModel("megatron-sc21", "Megatron-LM of Narayanan et al., SC21 (2021): fused kernels, attention "
                "scores materialised, no TP overlap, fp32 main gradients all-reduced after the pipeline schedule",
                attention="materialized", fused_elementwise=True, tp_comm_hidden=0.0, reduce_fp32=True,
                main_grads_fp32=True, reduce_after_pipeline=True, reduce_scatter_once=True, context_parallel=False),
    EngineModel("deepspeed", "Megatron-DeepSpeed (BLOOM, 2022): Megatron's fused kernels and materialised "
                "attention, DeepSpeed's pipeline engine reducing gradients after the pipeline drains",
                attention="materialized", fused_elementwise=True, tp_comm_hidden=0.0, reduce_fp32=True,
                main_grads_fp32=True, reduce_after_pipeline=True, reduce_scatter_once=True, context_parallel=False),
    # torchtitan calls SDPA, whose default on Hopper is its FlashAttention-2 kernel: PyTorch made the
    # cuDNN backend opt-in after 2.5 (pytorch/pytorch#138522, #138649; default SDPA measured at 329 TFLOP/s
    # against cuDNN's 631 on H100, #142132), and torchtitan asks for cuDNN only on Blackwell
    # (pytorch/torchtitan#1196, 2025-05).
    EngineModel("torchtitan", "torchtitan (FSDP2, eager, SDPA attention, fp32 gradient reduction)",
                attention="flash2", fused_elementwise=False, tp_comm_hidden=0.0, reduce_fp32=True,
                main_grads_fp32=False, unsharded_grad_passes="fsdp2", moe_context_parallel=True),
    EngineModel("fsdp", "PyTorch FSDP1 with FlashAttention-2 (llm-foundry / Composer), eager elementwise",
                attention="flash2", fused_elementwise=False, tp_comm_hidden=0.0, reduce_fp32=False,
                main_grads_fp32=False, gpt_dropout=False, context_parallel=False,
                optimizer_bytes_per_param=COMPOSER_ADAMW_BYTES_PER_PARAM, unsharded_grad_passes="fsdp1",
                unpadded_attention=True),
)}

if tuple(ENGINES) != ENGINE_NAMES:  # the names are declared once, in specs (a plan file records its engine)
    raise RuntimeError(f"cost_models.engines prices {tuple(ENGINES)} but specs.planfile names {ENGINE_NAMES}")


def ring_blocks_written_out(engine: EngineModel, device_type: str) -> bool:
    """Whether `engine`'s ring writes each step's fp32 scores out on `device_type`: this project's engine on
    GPUs; on CPUs its steps run torch's flash kernel, which returns the log-sum-exp the merge needs
    (runners/context_parallel._fused_blocks); the other engines run a fused kernel per step everywhere."""
    return not engine.fused_ring_blocks and device_type != "cpu"


def engine_model(name: str | EngineModel) -> EngineModel:
    """The engine called `name`; an EngineModel is taken as it is (a variant, e.g. an older kernel)."""
    from specs.errors import PlannerError

    if isinstance(name, EngineModel):
        return name
    if name not in ENGINES:
        raise PlannerError(f"unknown engine {name!r}; choose from {', '.join(ENGINES)}")
    return ENGINES[name]
