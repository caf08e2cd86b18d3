"""Megatron-LM's argument rules, as its own checks state them, applied to a flag list before it is
exported (Megatron-LM's `megatron.training` is not installable from PyPI, so its `validate_args` cannot
run in this project's tests; these rules are tested against accept/reject outcomes recorded from that
code, tests/fixtures/megatron/validate_args_cases.json).

Sources, Megatron-LM main d98e8a64 (0.20.0, 2026-08-22); the same outcomes on core_v0.16.1:
`megatron/training/arguments.py` validate_args (sizes 424-448, virtual and uneven pipelines 928-1009,
overlap and FSDP 1024-1187, precision 1193-1217, model 1314-1356, recompute 1410-1442,
CUDA_DEVICE_MAX_CONNECTIONS 1453-1479, MoE 1647-1658), `megatron/core/transformer/transformer_config.py`
(heads and query groups 1446-1468, recompute 1901-1932, uneven stages 2294-2368),
`megatron/core/transformer/pipeline_parallel_layer_layout.py` (41-45, 95-110),
`megatron/core/num_microbatches_calculator.py` (381-391) and
`megatron/core/pipeline_parallel/schedules.py` (1160-1180, interleaved micro-batch groups).

    violations = megatron_violations(args, world_size=64, env={"CUDA_DEVICE_MAX_CONNECTIONS": "1"})
"""

from __future__ import annotations

import re

# The GPU architecture the rules assume (compute capability major): Hopper. Before Blackwell (10),
# tensor or context parallelism needs CUDA_DEVICE_MAX_CONNECTIONS=1 unless FSDP is used.
HOPPER = 9


def _int(args: dict, flag: str, default: int | None = None) -> int | None:
    value = args.get(flag, default)
    return None if value is None else int(value)


def parse_layout(layout: str) -> list[list[str]]:
    """A --pipeline-model-parallel-layout as stages of symbols (E embedding, L loss, t decoder layer):
    `|` separates stages, `x*n` and `(...)*n` repeat, commas are cosmetic."""
    text = layout.replace(",", "").replace(" ", "")
    while "(" in text:
        text = re.sub(r"\(([^()]*)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text, count=1)
        if re.search(r"\([^()]*\)(?!\*)", text):
            raise ValueError(f"bad layout {layout!r}")
    stages = []
    for stage in text.split("|"):
        symbols = []
        for sym, count in re.findall(r"([ELtm])(?:\*(\d+))?", stage):
            symbols += [sym] * int(count or 1)
        if "".join(re.findall(r"[ELtm](?:\*\d+)?", stage)) != stage:
            raise ValueError(f"bad layout stage {stage!r} in {layout!r}")
        stages.append(symbols)
    return stages


def _pipeline(args: dict, *, pp: int, num_layers: int, out: list[str]) -> int:
    """The virtual/uneven pipeline rules; returns the virtual stages per rank."""
    lpvs = _int(args, "--num-layers-per-virtual-pipeline-stage")
    vspr = _int(args, "--num-virtual-stages-per-pipeline-rank")
    layout = args.get("--pipeline-model-parallel-layout")
    first, last = _int(args, "--decoder-first-pipeline-num-layers"), _int(args, "--decoder-last-pipeline-num-layers")
    extra = int("--account-for-embedding-in-pipeline-split" in args) + int("--account-for-loss-in-pipeline-split" in args)
    if sum(x is not None for x in (lpvs, vspr, layout)) > 1:
        out.append("only one of --num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank and "
                   "--pipeline-model-parallel-layout may be given")
        return 1
    vpp = 1
    if layout is not None:
        try:
            stages = parse_layout(layout)
        except ValueError as exc:
            out.append(str(exc))
            return 1
        flat = [s for stage in stages for s in stage]
        if len(stages) % pp:
            out.append(f"the layout's {len(stages)} stages are not divisible by pipeline-model-parallel size {pp}")
        if flat.count("E") != 1 or flat.count("L") != 1 or "E" not in stages[0] or "L" not in stages[-1]:
            out.append("the layout needs one E in the first stage and one L in the last")
        if flat.count("t") != num_layers:
            out.append(f"Number of decoder layers {flat.count('t')}must match num_layers {num_layers}")
        if first is not None or last is not None or extra:
            out.append("--pipeline-model-parallel-layout cannot be combined with the first/last stage or account-for flags")
        vpp = max(1, len(stages) // pp)
    elif lpvs is not None:
        if first is not None or last is not None:
            out.append("please use --num-virtual-stages-per-pipeline-rank to specify virtual pipeline parallel degree "
                       "when enable uneven pipeline parallelism")
        elif (num_layers + extra) % pp:
            out.append("number of layers of the model must be divisible pipeline model parallel size")
        elif ((num_layers + extra) // pp) % lpvs:
            out.append("number of layers per pipeline stage must be divisible number of layers per virtual pipeline stage")
        else:
            vpp = (num_layers + extra) // pp // lpvs
    elif vspr is not None:
        vpp = vspr
    if layout is None and pp > 1:
        _uneven(num_layers=num_layers, pp=pp, vpp=vpp, first=first, last=last, extra=extra, out=out)
    if vpp > 1 and pp <= 2 and "--no-overlap-p2p-communication" in args:
        out.append("When interleaved schedule is used and p2p communication overlap is disabled, "
                   "pipeline-model-parallel size should be greater than 2")
    return vpp


def _uneven(*, num_layers: int, pp: int, vpp: int, first: int | None, last: int | None, extra: int,
            out: list[str]) -> None:
    if first is None and last is None:
        if (num_layers + extra) % pp:
            out.append("Number of layers should be divisible by the pipeline-model-parallel size")
        return
    if extra:
        out.append("the first/last stage flags cannot be combined with the account-for flags")
    middle_ranks = pp - (first is not None) - (last is not None)
    middle_layers = num_layers - (first or 0) - (last or 0)
    for name, count in (("first", first), ("last", last)):
        if count is not None and (count <= 0 or count % vpp):
            out.append(f"number of layers at {name} stage: {count}must be divisible by virtual pipelineparallel degree {vpp}")
    if (middle_layers > 0) != (middle_ranks > 0):
        out.append(f"Mismatch: {middle_layers} middle layers remaining but {middle_ranks} middle PP stages available")
    elif middle_ranks and (middle_layers % middle_ranks or (middle_layers // middle_ranks) % vpp):
        out.append(f"number of layers at middle stage: {middle_layers} must be divisible bythe middle pipeline model "
                   f"parallel size {middle_ranks}")


def _sharding(args: dict, env: dict, *, pp: int, ep: int, dp: int, out: list[str]) -> bool:
    """The distributed optimizer and FSDP rules; returns whether FSDP (torch or Megatron) is on."""
    dist_opt = "--use-distributed-optimizer" in args
    mfsdp, tfsdp = "--use-megatron-fsdp" in args, "--use-torch-fsdp2" in args
    if "--overlap-param-gather" in args:
        if not (dist_opt or mfsdp or args.get("--optimizer") == "dist_muon"):
            out.append("--overlap-param-gather only supported with distributed optimizer, megatron fsdp, or dist_muon")
        if "--overlap-grad-reduce" not in args:
            out.append("Must use --overlap-param-gather with --overlap-grad-reduce")
    if tfsdp:
        for bad, message in ((pp != 1, "--use-torch-fsdp2 is not supported with pipeline parallelism"),
                             (ep != 1, "--use-torch-fsdp2 is not supported with expert parallelism"),
                             (dist_opt, "--use-torch-fsdp2 is not supported with MCore's distributed optimizer"),
                             ("--no-gradient-accumulation-fusion" not in args,
                              "--use-torch-fsdp2 is not supported with gradient accumulation fusion"),
                             (args.get("--ckpt-format", "torch_dist") not in ("torch_dist", "torch_dcp"),
                              "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp"),
                             ("--untie-embeddings-and-output-weights" not in args,
                              "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights"),
                             ("--fp16" in args, "--use-torch-fsdp2 not supported with fp16 yet"),
                             (env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1",
                              "FSDP always requires CUDA_DEVICE_MAX_CONNECTIONS value large than one")):
            if bad:
                out.append(message)
    if mfsdp:
        if args.get("--optimizer", "adam") not in ("sgd", "adam"):
            out.append(f"Megatron-FSDP does not support the {args['--optimizer']} optimizer yet.")
        if env.get("CUDA_DEVICE_MAX_CONNECTIONS") == "1":
            out.append("FSDP requires CUDA_DEVICE_MAX_CONNECTIONS > 1 or unset.")
        if args.get("--ckpt-format", "torch_dist") != "fsdp_dtensor":
            out.append("Megatron-FSDP requires the `fsdp_dtensor` checkpointing format.")
    instances = _int(args, "--num-distributed-optimizer-instances", 1)
    if instances > 1 and (not (dist_opt or mfsdp) or dp % instances):
        out.append(f"--num-distributed-optimizer-instances {instances} needs the distributed optimizer and to divide "
                   f"the data-parallel size {dp}")
    return mfsdp or tfsdp


def _model(args: dict, *, tp: int, out: list[str]) -> None:
    for flag in ("--num-layers", "--hidden-size", "--num-attention-heads", "--max-position-embeddings",
                 "--micro-batch-size"):
        if flag not in args:
            out.append(f"{flag} is required")
    heads = _int(args, "--num-attention-heads", 1)
    if heads % tp:
        out.append(f"num_attention_heads ({heads}) must be a multiple of tensor_model_parallel_size ({tp}).")
    if "--num-query-groups" in args and "--group-query-attention" not in args:
        out.append("--num-query-groups is ignored without --group-query-attention")
    groups = _int(args, "--num-query-groups") if "--group-query-attention" in args else None
    if groups is not None and groups % tp and tp % groups:
        out.append(f"num_query_groups ({groups}) must be a multiple or divisor of tensor_model_parallel_size ({tp}).")
    seq, max_pos = _int(args, "--seq-length"), _int(args, "--max-position-embeddings")
    if seq is not None and max_pos is not None and max_pos < seq:
        out.append(f"max_position_embeddings ({max_pos}) must be greater than or equal to seq_length ({seq}).")
    if "--fp16" in args and "--bf16" in args:
        out.append("fp16 and bf16 cannot both be set")


def _recompute(args: dict, *, tp: int, out: list[str]) -> None:
    granularity, method = args.get("--recompute-granularity"), args.get("--recompute-method")
    if granularity == "selective" and method is not None:
        out.append("recompute method is not yet supported for selective recomputing granularity")
    if granularity == "selective" and "--recompute-num-layers" in args:
        out.append("selective recomputation takes no --recompute-num-layers")
    if granularity == "full" and (method not in ("uniform", "block") or "--recompute-num-layers" not in args):
        out.append('Using recompute_granularity: full so recompute_method must be "block" or "uniform"')
    if "--distribute-saved-activations" in args and (tp == 1 or granularity != "full"):
        out.append("--distribute-saved-activations needs tensor parallelism and full recomputation")
    if "--tp-comm-overlap" in args and "--sequence-parallel" not in args:
        out.append("--tp-comm-overlap requires sequence parallelism")


def _moe_and_cp(args: dict, *, cp: int, ep: int, out: list[str]) -> None:
    experts = _int(args, "--num-experts")
    if ep > 1 and not experts:
        out.append("num_experts must be non None to use expert model parallelism")
    elif ep > 1 and experts % ep:
        out.append("Number of experts should be a multiple of expert model parallel_size.")
    if (experts and _int(args, "--moe-router-topk") == 1 and "--moe-router-pre-softmax" not in args
            and args.get("--moe-router-load-balancing-type") != "sinkhorn"):
        out.append("Please use --moe-router-pre-softmax when topk is 1.")
    if "--moe-shared-expert-overlap" in args and args.get("--moe-token-dispatcher-type", "allgather") == "allgather":
        out.append("moe_shared_expert_overlap only works with alltoall or flex token dispatcher.")
    seq = _int(args, "--seq-length")
    if cp > 1 and seq is not None and seq % (2 * cp):
        out.append("seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1.")
    cp_types = args.get("--cp-comm-type", "p2p")
    sizes = args.get("--hierarchical-context-parallel-sizes")
    if "a2a+p2p" in str(cp_types).split():
        if sizes is None:
            out.append("--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm")
        else:
            product = 1
            for s in str(sizes).split():
                product *= int(s)
            if product != cp:
                out.append("the hierarchical context-parallel sizes must multiply to the context-parallel size")


def megatron_violations(args: dict, *, world_size: int, env: dict | None = None, arch: int = HOPPER,
                        runtime: bool = True) -> list[str]:
    """Every rule of Megatron-LM's argument checks that `args` (flag -> value, True for a bare switch)
    breaks on `world_size` ranks with environment `env`, in Megatron's words where it has them.
    `runtime`: also the interleaved schedule's micro-batch rule, which Megatron checks only when the first
    step runs (schedules.py), not when it parses the arguments."""
    env, out = env or {}, []
    tp, pp = _int(args, "--tensor-model-parallel-size", 1), _int(args, "--pipeline-model-parallel-size", 1)
    cp, ep = _int(args, "--context-parallel-size", 1), _int(args, "--expert-model-parallel-size", 1)
    model_size = tp * pp * cp
    if world_size % model_size:
        out.append(f"world size ({world_size}) is not divisible by total_model_size (total_model_size={model_size})")
        return out
    dp = world_size // model_size
    _model(args, tp=tp, out=out)
    vpp = _pipeline(args, pp=pp, num_layers=_int(args, "--num-layers", 0), out=out)
    fsdp = _sharding(args, env, pp=pp, ep=ep, dp=dp, out=out)
    _recompute(args, tp=tp, out=out)
    _moe_and_cp(args, cp=cp, ep=ep, out=out)
    if (tp > 1 or cp > 1) and arch < 10 and not fsdp and env.get("CUDA_DEVICE_MAX_CONNECTIONS") != "1":
        out.append("Using tensor model parallelism or context parallelism require setting the environment variable "
                   "CUDA_DEVICE_MAX_CONNECTIONS to 1")
    mbs = _int(args, "--micro-batch-size", 1)
    gbs = _int(args, "--global-batch-size", mbs * dp)
    if gbs % (mbs * dp):
        out.append(f"global batch size ({gbs}) is not divisible by micro batch size ({mbs}) times data parallel size ({dp})")
    elif vpp > 1 and runtime:
        num_micro = gbs // (mbs * dp)
        if num_micro < pp or num_micro % pp:
            out.append(f"interleaved 1F1B needs the {num_micro} micro-batches to be a multiple of pipeline size {pp} "
                       f"(micro-batch groups of PP per virtual stage)")
    return out
