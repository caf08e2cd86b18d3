"""planner: profile a node, search for the best parallel plan, and train with it.

    planner presets
    planner search --model llama3-70b --hardware h100 --gpus 1024 --global-batch 1024 --seq-len 4096
    planner estimate --model gpt3-1.7b --hardware a100 --gpus 32 --global-batch 512 --tp 1 --pp 1 --recompute full

One typer app; each command is a thin wrapper over a library call. Bad input (PlannerError or ValueError)
becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import json
import os
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


StepsOpt = Annotated[int, typer.Option("--steps", help="Optimizer steps to train.")]


@app.command()
def run(
    model: ModelOpt = "tiny",
    hardware: HardwareOpt = "cpu",
    global_batch: GlobalBatchOpt = 8,
    seq_len: SeqLenOpt = 64,
    steps: StepsOpt = 10,
    nproc: Annotated[int, typer.Option("--nproc", help="Processes on this node (torchrun --nproc-per-node).")] = 2,
    gpus_per_node: GpusPerNodeOpt = None,
    nnodes: Annotated[int, typer.Option("--nnodes", help="Nodes (torchrun).")] = 1,
    node_rank: Annotated[int, typer.Option("--node-rank", help="This node's rank (torchrun).")] = 0,
    rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Text file or folder (byte tokens); default synthetic.")] = None,
    engine: Annotated[str, typer.Option("--engine", help="ours, or torch (DDP/ZeRO/FSDP2/DTensor/pipelining).")] = "ours",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    precision: PrecisionOpt = None,
    plan_file: PlanFileOpt = None,
    dp: DpOpt = None, tp: TpOpt = 1, pp: PpOpt = 1, virtual_stages: VirtualStagesOpt = 1,
    micro_batch: MicroBatchOpt = 1, schedule: ScheduleOpt = None, recompute: RecomputeOpt = "none",
    sequence_parallel: SequenceParallelOpt = False, zero: ZeroOpt = None, param_shard: ParamShardOpt = None,
    grad_shard: GradShardOpt = None, optim_shard: OptimShardOpt = None, prefetch_depth: PrefetchOpt = 1,
    bucket_size_mb: BucketOpt = None, param_cache: ParamCacheOpt = "none", commshift: CommshiftOpt = False,
    metrics_out: Annotated[Optional[str], typer.Option("--metrics-out", help="Write the metrics JSON here.")] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Train with a plan on our engine (launched with torchrun) and report measured beside predicted.

    Examples:
      planner run                                   # tiny model, 2 CPU processes, DP
      planner run --nproc 4 --zero 3 --micro-batch 2
      planner run --nproc 4 --tp 2 --pp 2 --schedule 1f1b --steps 20 --format json
      planner run --plan plan.json --nproc 8 --gpus-per-node 4
    """
    from planner.jsonio import write_json_atomic
    from planner.inputs import PlanFlags
    from planner.run_command import RunRequest, build_run, run_in_this_process, under_torchrun

    request = RunRequest(model=model, hardware=hardware, global_batch=global_batch, seq_len=seq_len,
                         precision=precision, steps=steps, seed=seed, lr=lr, data=data, nproc=nproc, nnodes=nnodes,
                         node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, gpus_per_node=gpus_per_node,
                         engine=engine, plan_file=plan_file)
    flags = PlanFlags(dp=dp, tp=tp, pp=pp, virtual_stages=virtual_stages, micro_batch=micro_batch,
                      schedule=schedule, recompute=recompute, sequence_parallel=sequence_parallel, zero=zero,
                      param_shard=param_shard, grad_shard=grad_shard, optim_shard=optim_shard,
                      prefetch_depth=prefetch_depth, bucket_size_mb=bucket_size_mb, param_cache=param_cache,
                      commshift=commshift)
    cfg = build_run(request, flags)
    if under_torchrun():
        metrics = run_in_this_process(cfg)
        if os.environ.get("RANK", "0") != "0":
            return
    else:
        metrics = _launch_with_progress(cfg, request, quiet=fmt is OutputFormat.json)
    if metrics is None:
        return
    if metrics_out:
        write_json_atomic(metrics_out, metrics)
    if fmt is OutputFormat.json:
        print_json(metrics)
    else:
        _print_run_report(metrics)


def _launch_with_progress(cfg, request, *, quiet: bool):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from runners.launch import RunFailed, launch

    with Progress(TextColumn("[bold]training[/]"), BarColumn(), MofNCompleteColumn(),
                  TextColumn("{task.fields[info]}"), TimeElapsedColumn(), console=err_console,
                  disable=quiet, transient=False) as progress:
        task = progress.add_task("train", total=cfg.steps, info=cfg.plan.describe())

        def on_step(record: dict) -> None:
            progress.update(task, advance=1, info=f"loss {record['loss']:.4f}  {record['step_time_s'] * 1e3:.0f} ms/step")

        try:
            return launch(cfg, nproc=request.nproc, nnodes=request.nnodes, node_rank=request.node_rank,
                          rdzv_endpoint=request.rdzv_endpoint, on_step=on_step)
        except RunFailed as exc:
            err_console.print(f"error: {exc}", markup=False, highlight=False)
            raise typer.Exit(1)


def _print_run_report(metrics: dict) -> None:
    summary, predicted = metrics["summary"], metrics.get("predicted") or {}
    steps = metrics["steps"]
    console.print(f"plan: {_describe_plan(metrics['plan'])}   losses: {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}")
    table = Table(title="Measured beside predicted")
    for col in ("", "measured", "predicted", "measured / predicted"):
        table.add_column(col, justify="right")

    def row(name: str, measured: float, pred: float | None, fmt) -> None:
        ratio = f"{measured / pred:.2f}" if pred else "-"
        table.add_row(name, fmt(measured), fmt(pred) if pred is not None else "-", ratio)

    row("step time", summary["median_step_time_s"], predicted.get("step_time_s"), lambda v: f"{v * 1e3:.1f} ms")
    row("tokens/s", summary["tokens_per_s"], predicted.get("tokens_per_s"), lambda v: f"{v:,.0f}")
    row("peak memory / rank", summary["peak_memory_bytes"], predicted.get("peak_memory_bytes"),
        lambda v: f"{v / 2**20:,.1f} MiB")
    console.print(table)
    comm = summary["comm_bytes"]
    console.print("communication per step (all ranks): " + ", ".join(
        f"{k} {v / 2**20:.2f} MiB" for k, v in comm.items() if v) + f"; waiting {summary['comm_wait_s'] * 1e3:.1f} ms/rank")


def _describe_plan(plan_dict: dict) -> str:
    from planner.plan import Plan

    return Plan.from_dict(plan_dict).describe()


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
