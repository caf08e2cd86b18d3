"""planner: profile a node, search for the best parallel plan, and train with it.

    planner presets
    planner search --model llama3-70b --hardware h100 --gpus 1024 --global-batch 1024 --seq-len 4096
    planner estimate --model gpt3-1.7b --hardware a100 --gpus 32 --global-batch 512 --tp 1 --pp 1 --recompute full

One typer app; each command is a thin wrapper over a library call. Bad input (PlannerError or ValueError)
becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import sys
from enum import Enum
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from planner.errors import PlannerError

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Auto-tuning planner for distributed LLM training.")
console = Console()


@app.callback()
def _root() -> None:
    """Auto-tuning planner for distributed LLM training: profile, search, estimate, run."""

err_console = Console(stderr=True)


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


# --- shared options (Annotated aliases) -------------------------------------------------------------
ModelOpt = Annotated[str, typer.Option("--model", help="Preset name, HF config.json, or model JSON.")]
HardwareOpt = Annotated[str, typer.Option("--hardware", help="Preset (a100, h100, h200, cpu) or profile JSON.")]
GpusOpt = Annotated[int, typer.Option("--gpus", help="Number of devices in the cluster.")]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option("--gpus-per-node", help="Devices per node (default 8 for GPUs).")]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", help="Sequences per optimizer step.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence (default: min(model max, 2048)).")]
PrecisionOpt = Annotated[Optional[str], typer.Option("--precision", help="bf16, fp16 or fp32 (default: fp32 on CPU, else bf16).")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", help="table or json.")]

DpOpt = Annotated[Optional[int], typer.Option("--dp", help="Data-parallel degree (default: devices / (tp x pp)).")]
TpOpt = Annotated[int, typer.Option("--tp", help="Tensor-parallel degree.")]
PpOpt = Annotated[int, typer.Option("--pp", help="Pipeline-parallel degree.")]
VirtualStagesOpt = Annotated[int, typer.Option("--virtual-stages", help="Model chunks per pipeline rank (interleaved 1F1B).")]
MicroBatchOpt = Annotated[int, typer.Option("--micro-batch", help="Sequences per micro-batch.")]
ScheduleOpt = Annotated[Optional[str], typer.Option("--schedule", help="gpipe, 1f1b or interleaved-1f1b.")]
RecomputeOpt = Annotated[str, typer.Option("--recompute", help="Activation recomputation: none, selective, full.")]
SequenceParallelOpt = Annotated[bool, typer.Option("--sequence-parallel/--no-sequence-parallel", help="Megatron sequence parallelism (needs tp > 1).")]
ZeroOpt = Annotated[Optional[int], typer.Option("--zero", help="ZeRO stage 0-3: shorthand for the three shard degrees.")]
ParamShardOpt = Annotated[Optional[int], typer.Option("--param-shard", help="DP ranks that shard parameters.")]
GradShardOpt = Annotated[Optional[int], typer.Option("--grad-shard", help="DP ranks that shard gradients.")]
OptimShardOpt = Annotated[Optional[int], typer.Option("--optim-shard", help="DP ranks that shard optimizer states.")]
PrefetchOpt = Annotated[int, typer.Option("--prefetch-depth", help="Layers whose parameters are gathered ahead.")]
BucketOpt = Annotated[Optional[float], typer.Option("--bucket-size-mb", help="Gradient bucket size in MiB.")]
ParamCacheOpt = Annotated[str, typer.Option("--param-cache", help="MAZ3 tier: none, device, host, secondary.")]
CommshiftOpt = Annotated[bool, typer.Option("--commshift/--no-commshift", help="Move DP gradient reduction off the pipeline's critical path.")]
PlanFileOpt = Annotated[Optional[str], typer.Option("--plan", help="Plan JSON (from search --out); replaces the plan flags.")]


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
def presets(fmt: FormatOpt = OutputFormat.table) -> None:
    """List the model and hardware presets.

    Example: planner presets --format json
    """
    from planner.model import PRESETS as MODELS
    from profilers.hardware import PRESETS as HARDWARE

    if fmt is OutputFormat.json:
        print_json({"models": {k: v.to_dict() for k, v in MODELS.items()},
                    "hardware": {k: v.to_dict() for k, v in HARDWARE.items()}})
        return
    table = Table(title="Model presets")
    for col in ("name", "arch", "params", "layers", "hidden", "heads", "kv heads", "ffn", "vocab"):
        table.add_column(col, justify="right" if col not in ("name", "arch") else "left", no_wrap=True)
    for spec in MODELS.values():
        table.add_row(spec.name, spec.arch, _count(spec.num_params()), str(spec.num_layers),
                      str(spec.hidden_size), str(spec.num_heads), str(spec.num_kv_heads),
                      str(spec.ffn_hidden_size), str(spec.vocab_size))
    console.print(table)
    hw_table = Table(title="Hardware presets")
    for col in ("name", "device", "bf16 TFLOP/s", "memory GiB", "HBM GB/s", "intra GB/s", "inter GB/s"):
        hw_table.add_column(col)
    for hw in HARDWARE.values():
        hw_table.add_row(hw.name, hw.device_name, f"{hw.peak_flops('bf16') / 1e12:.0f}",
                         f"{hw.memory_bytes / 2**30:.0f}", f"{hw.memory_bandwidth_bytes_per_s / 1e9:.0f}",
                         f"{hw.intra_node.bandwidth_bytes_per_s / 1e9:.0f}",
                         f"{hw.inter_node.bandwidth_bytes_per_s / 1e9:.1f}")
    console.print(hw_table)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def main() -> None:
    """Console-script entry: bad input is one line on stderr and exit code 2, never a traceback.

    Click's standalone mode already turns usage errors into one line and exit 2; errors raised by the
    library calls (PlannerError, ValueError) are caught here.
    """
    try:
        app()
    except (PlannerError, ValueError) as exc:
        err_console.print(f"error: {exc}", markup=False, highlight=False)
        sys.exit(2)


if __name__ == "__main__":
    main()
