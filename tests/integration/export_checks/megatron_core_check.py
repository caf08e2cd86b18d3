"""Check planner's Megatron-LM exports with megatron-core 0.16.1's own classes (the part of Megatron-LM that
installs from PyPI on Python 3.11); run by tests/integration/test_exports_accepted.py in its own process.

    python megatron_core_check.py DIR...    # each DIR: launch.sh from `planner export --to megatron`

For each DIR, one JSON line: {"dir", "ok", "error", "num_micro_batches"}. The exported arguments become the
TransformerConfig that Megatron-LM's training builds from them (core_transformer_config_from_args), whose
__post_init__ checks heads and query groups against TP, sequence parallelism, the pipeline layout and
virtual stages, recomputation and precision; and the micro-batch calculator checks the batch split. The
argument-level rules (validate_args, not in the wheel) are planner/exports/megatron_rules.py, tested
against outcomes recorded from Megatron-LM's own code.
"""

from __future__ import annotations

import json
import shlex
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from megatron.core.num_microbatches_calculator import ConstantNumMicroBatchesCalculator
from megatron.core.transformer import TransformerConfig


def parse_launch(text: str) -> tuple[dict, int]:
    """The pretrain_gpt.py arguments of an exported launch.sh (flag -> value, True for a switch) and the world size."""
    command = text[text.index("torchrun"):].replace("\\\n", " ")
    tokens = shlex.split(command)
    world = int(tokens[tokens.index("--nproc-per-node") + 1]) * int(tokens[tokens.index("--nnodes") + 1])
    args, rest = {}, tokens[tokens.index("pretrain_gpt.py") + 1:]
    for i, token in enumerate(rest):
        if token.startswith("--"):
            following = rest[i + 1] if i + 1 < len(rest) else None
            args[token] = following if following is not None and not following.startswith("--") else True
    return args, world


def transformer_config(args: dict) -> TransformerConfig:
    dtype = torch.bfloat16 if "--bf16" in args else torch.float16 if "--fp16" in args else torch.float32
    pp = int(args.get("--pipeline-model-parallel-size", 1))
    layout = args.get("--pipeline-model-parallel-layout")
    stages = len(layout.split("|")) if layout else pp
    return TransformerConfig(
        num_layers=int(args["--num-layers"]), hidden_size=int(args["--hidden-size"]),
        ffn_hidden_size=int(args["--ffn-hidden-size"]), num_attention_heads=int(args["--num-attention-heads"]),
        num_query_groups=int(args["--num-query-groups"]) if "--group-query-attention" in args else None,
        kv_channels=int(args["--kv-channels"]), gated_linear_unit="--swiglu" in args,
        activation_func=F.silu if "--swiglu" in args else F.gelu,
        normalization=args.get("--normalization", "LayerNorm"), layernorm_epsilon=float(args["--norm-epsilon"]),
        add_bias_linear="--disable-bias-linear" not in args, attention_dropout=float(args["--attention-dropout"]),
        hidden_dropout=float(args["--hidden-dropout"]), bf16="--bf16" in args, fp16="--fp16" in args,
        params_dtype=dtype, pipeline_dtype=dtype if pp > 1 else None,
        tensor_model_parallel_size=int(args["--tensor-model-parallel-size"]), pipeline_model_parallel_size=pp,
        virtual_pipeline_model_parallel_size=stages // pp if stages // pp > 1 else None,
        pipeline_model_parallel_layout=layout, sequence_parallel="--sequence-parallel" in args,
        recompute_granularity=args.get("--recompute-granularity"), recompute_method=args.get("--recompute-method"),
        recompute_num_layers=int(args["--recompute-num-layers"]) if "--recompute-num-layers" in args else None,
        bias_activation_fusion=False, apply_rope_fusion=False)


def check(folder: Path) -> dict:
    args, world = parse_launch((folder / "launch.sh").read_text())
    transformer_config(args)
    model_parallel = int(args["--tensor-model-parallel-size"]) * int(args.get("--pipeline-model-parallel-size", 1))
    dp = world // model_parallel
    n = ConstantNumMicroBatchesCalculator(int(args["--global-batch-size"]), int(args["--micro-batch-size"]), dp,
                                          False, 0).get()
    return {"ok": True, "num_micro_batches": n}


def main() -> None:
    for arg in sys.argv[1:]:
        try:
            result = check(Path(arg))
        except Exception as exc:  # noqa: BLE001 - any rejection is reported, not raised
            result = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
        print(json.dumps({"dir": arg, **result}), flush=True)


if __name__ == "__main__":
    main()
