"""A dozen plans every exporter is tested on (tests/unit/test_export.py, and through the targets' own
config code in tests/integration/test_exports_accepted.py): dense 8B to 405B, pipelines with equal,
unequal and interleaved stages, DDP, ZeRO-1/2/3 and HSDP, TP with and without SP, recomputation, a Lins
mix, MAZ3 tiers and commshift, a tied-embedding model, a GPT-3 model, and long-context plans with ring,
all-to-all and hierarchical context parallelism (which DeepSpeed's config cannot express), and MoE plans
with expert parallelism (DeepSpeed's exporter replicates the experts and refuses MoE under TP, both refuse
DeepSeek-V3's latent attention),
and dense Qwen2 / Qwen3 models (torchtitan's exporter refuses Qwen2's q/k/v biases)."""

from __future__ import annotations

from dataclasses import dataclass

from specs.plan import Plan, zero_degrees
from specs.problem import Problem, make_problem


@dataclass(frozen=True)
class ExportCase:
    name: str
    model: str
    gpus: int
    global_batch: int
    seq_len: int
    plan: dict
    hardware: str = "h100"
    precision: str | None = None
    # Targets expected to refuse the plan (the message names the closest plan they accept).
    refused_by: tuple[str, ...] = ()

    def problem(self) -> Problem:
        return make_problem(model=self.model, hardware=self.hardware, gpus=self.gpus, gpus_per_node=8,
                            global_batch=self.global_batch, seq_len=self.seq_len, precision=self.precision)

    def build_plan(self) -> Plan:
        values = dict(self.plan)
        zero = values.pop("zero", None)
        if zero is not None:
            degree = values["dp"] * values.get("cp", 1)  # CP ranks shard with DP's
            values.update(zip(("param_shard", "grad_shard", "optim_shard"), zero_degrees(zero, degree)))
        return Plan(**values)


CASES = (
    ExportCase("1b-ddp", "llama3.2-1b", 8, 64, 8192, dict(dp=8, micro_batch=1, num_micro_batches=8, recompute="full")),
    ExportCase("8b-zero1", "llama3-8b", 16, 64, 4096, dict(dp=16, micro_batch=1, num_micro_batches=4, zero=1,
                                                          recompute="full")),
    ExportCase("8b-tp8-sp-zero2", "llama3-8b", 64, 128, 8192, dict(dp=8, tp=8, micro_batch=2, num_micro_batches=8,
                                                                  sequence_parallel=True, zero=2)),
    ExportCase("70b-fsdp-tp8", "llama3-70b", 64, 64, 4096, dict(dp=8, tp=8, micro_batch=1, num_micro_batches=8,
                                                               sequence_parallel=True, zero=3, recompute="full")),
    ExportCase("70b-pp4-equal", "llama3-70b", 256, 256, 4096,
               dict(dp=8, tp=8, pp=4, micro_batch=1, num_micro_batches=32, sequence_parallel=True, zero=1,
                    recompute="selective")),
    ExportCase("70b-pp4-unequal", "llama3-70b", 128, 128, 4096,
               dict(dp=4, tp=8, pp=4, micro_batch=1, num_micro_batches=32, stage_layers=(19, 21, 21, 19), zero=1)),
    ExportCase("70b-pp4-interleaved", "llama3-70b", 64, 64, 4096,
               dict(dp=2, tp=8, pp=4, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1,
                    num_micro_batches=32, sequence_parallel=True, zero=1, recompute="selective")),
    ExportCase("405b-pp8-interleaved", "llama3-405b", 1024, 512, 8192,
               dict(dp=16, tp=8, pp=8, virtual_stages=2, schedule="interleaved-1f1b", micro_batch=1,
                    num_micro_batches=32, sequence_parallel=True, zero=1, recompute="full")),
    ExportCase("405b-hsdp", "llama3-405b", 1024, 1024, 4096,
               dict(dp=128, tp=8, micro_batch=1, num_micro_batches=8, sequence_parallel=True, param_shard=8,
                    grad_shard=8, optim_shard=8, recompute="full")),
    ExportCase("70b-lins-mix", "llama3-70b", 64, 64, 4096,
               dict(dp=8, tp=8, micro_batch=1, num_micro_batches=8, sequence_parallel=True, param_shard=4,
                    grad_shard=8, optim_shard=8, param_cache="host", recompute="full")),
    ExportCase("8b-pp2-zero3-maz3-commshift", "llama3-8b", 16, 64, 8192,
               dict(dp=8, pp=2, micro_batch=1, num_micro_batches=8, zero=3, param_cache="device", commshift=True,
                    recompute="full"), refused_by=("deepspeed",)),
    ExportCase("1b-tied-pp2", "llama3.2-1b", 16, 64, 8192, dict(dp=8, pp=2, micro_batch=1, num_micro_batches=8,
                                                               zero=1), refused_by=("torchtitan",)),
    ExportCase("gpt3-175b-pp8", "gpt3-175b", 512, 512, 2048,
               dict(dp=8, tp=8, pp=8, micro_batch=1, num_micro_batches=64, sequence_parallel=True, zero=1,
                    recompute="full", schedule="gpipe"), hardware="a100", refused_by=("torchtitan",)),
    ExportCase("8b-128k-tp8-cp8-ring", "llama3.1-8b", 64, 8, 131072,
               dict(dp=1, tp=8, cp=8, micro_batch=1, num_micro_batches=8, sequence_parallel=True, zero=3,
                    recompute="full"), refused_by=("deepspeed",)),
    ExportCase("8b-32k-tp4-cp2-a2a", "llama3.1-8b", 16, 8, 32768,
               dict(dp=2, tp=4, cp=2, cp_kind="all-to-all", micro_batch=1, num_micro_batches=4,
                    sequence_parallel=True, zero=1, recompute="selective"), refused_by=("deepspeed",)),
    ExportCase("70b-64k-tp4-cp4-hierarchical", "llama3.1-70b", 64, 16, 65536,
               dict(dp=4, tp=4, cp=4, cp_kind="hierarchical", micro_batch=1, num_micro_batches=4,
                    sequence_parallel=True, zero=3, recompute="full"), refused_by=("deepspeed",)),
    # MoE: Mixtral-8x22B EP8 over TP2 x DP16 (expert-DP 4; DeepSpeed's AutoTP has no SP); DeepSeek-V3 with MLA,
    # its 3 dense layers and EP64 across nodes; Qwen3-30B-A3B with qk norm and EP8 inside a node, and with CP2.
    ExportCase("mixtral-8x22b-ep8-tp2-pp8", "mixtral-8x22b", 256, 1024, 4096,
               dict(dp=16, tp=2, pp=8, ep=8, micro_batch=1, num_micro_batches=64, sequence_parallel=True, zero=1,
                    recompute="full"), refused_by=("deepspeed",)),
    ExportCase("deepseek-v3-ep64-pp16", "deepseek-v3", 1024, 1024, 4096,
               dict(dp=64, pp=16, ep=64, micro_batch=1, num_micro_batches=16, stage_layers=(3,) + (4,) * 14 + (2,),
                    zero=1, recompute="full"), refused_by=("torchtitan", "deepspeed")),
    ExportCase("qwen3-30b-a3b-ep8", "qwen3-30b-a3b", 16, 64, 4096,
               dict(dp=16, ep=8, micro_batch=1, num_micro_batches=4, zero=1, recompute="selective")),
    # Context parallelism beside the experts: each CP rank routes its own tokens, EP 8 folded over dp x cp.
    ExportCase("qwen3-30b-a3b-32k-cp2-ep8", "qwen3-30b-a3b", 16, 16, 32768,
               dict(dp=8, cp=2, ep=8, micro_batch=1, num_micro_batches=2, zero=1, recompute="full"),
               refused_by=("deepspeed",)),
    # Dense Qwen attention: Qwen3-8B (head_dim 128, query/key head norms: torchtitan's qwen3 model) and
    # Qwen2.5-7B (q/k/v biases, which neither torchtitan model has).
    ExportCase("qwen3-8b-tp2-zero1", "qwen3-8b", 16, 64, 4096,
               dict(dp=8, tp=2, micro_batch=1, num_micro_batches=8, sequence_parallel=True, zero=1)),
    ExportCase("qwen2.5-7b-zero3", "qwen2.5-7b", 8, 32, 4096,
               dict(dp=8, micro_batch=2, num_micro_batches=2, zero=3, recompute="selective"), refused_by=("torchtitan",)),
)
