"""planner: profile a node, search for the best parallel plan, and train with it.

    planner presets
    planner search --model llama3-70b --hardware h100 --gpus 1024 --global-batch 1024 --seq-len 4096
    planner estimate --model gpt3-1.7b --hardware a100 --gpus 32 --global-batch 512 --tp 1 --pp 1 --recompute full

One typer app; each command is a thin wrapper over a library call. Bad input (PlannerError or ValueError)
becomes one line on stderr and exit code 2, never a traceback.
"""

from __future__ import annotations

import functools
import inspect
import json
import os
import sys
import warnings
from enum import Enum
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.table import Table

from specs.errors import PlannerError
from specs.plan import PLAN_KNOBS
from specs.planfile import ENGINES

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Auto-tuning planner for distributed LLM training.")
console = Console()


@app.callback()
def _root() -> None:
    """Auto-tuning planner for distributed LLM training: profile, search, estimate, run."""
    warnings.showwarning = _show_warning


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A library warning (an option without effect, a profile of another device) as one line."""
    err_console.print(f"warning: {message}", markup=False, highlight=False, soft_wrap=True)

err_console = Console(stderr=True)


class OutputFormat(str, Enum):
    table = "table"
    json = "json"


# --- shared options (Annotated aliases) -------------------------------------------------------------
ModelOpt = Annotated[str, typer.Option("--model", help="Preset name, HF config.json, or model JSON.")]
HardwareOpt = Annotated[str, typer.Option("--hardware", help="Preset (a100, h100, h200, cpu) or profile JSON.")]
LocalHardwareOpt = Annotated[Optional[str], typer.Option(
    "--hardware", help="Preset (a100, h100, h200, cpu) or profile JSON (default: this machine's profile for that many processes, measured and cached on first use; on a GPU node without one, its GPU's preset).")]
GpusOpt = Annotated[int, typer.Option("--gpus", help="Number of devices in the cluster.")]
GpusPerNodeOpt = Annotated[Optional[int], typer.Option("--gpus-per-node", help="Devices per node (default 8 for GPUs).")]
GlobalBatchOpt = Annotated[int, typer.Option("--global-batch", help="Sequences per optimizer step.")]
SeqLenOpt = Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence (default: the model's context, at most 8192).")]
HeadroomOpt = Annotated[Optional[float], typer.Option(
    "--memory-headroom", help="Share of each device's memory every plan leaves free, 0-0.9 (default 0.1 on GPUs, 0 on CPU).")]
# planner.machine.default_nproc, in words (help text is built before any device is looked at).
NPROC_DEFAULT = "every GPU, or 2 CPU processes (4 on 8 cores or more)"
PrecisionOpt = Annotated[Optional[str], typer.Option("--precision", help="bf16, fp16 or fp32 (default: fp32 on CPU, else bf16).")]
FormatOpt = Annotated[OutputFormat, typer.Option("--format", help="table or json.")]

PlanFileOpt = Annotated[Optional[str], typer.Option("--plan", help="Plan file from `search --out` (it carries the model, hardware, cluster and job; a flag that contradicts it is an error), or a bare plan JSON.")]
# The problem options of commands that also take --plan: a plan file from `search --out` supplies them.
FROM_FILE = " (default: the --plan file's)"
MaybeModelOpt = Annotated[Optional[str], typer.Option("--model", help="Preset name, HF config.json, or model JSON" + FROM_FILE + ".")]
MaybeHardwareOpt = Annotated[Optional[str], typer.Option("--hardware", help="Preset (a100, h100, h200, cpu) or profile JSON" + FROM_FILE + ".")]
MaybeGpusOpt = Annotated[Optional[int], typer.Option("--gpus", help="Number of devices in the cluster" + FROM_FILE + ".")]
MaybeGlobalBatchOpt = Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step" + FROM_FILE + ".")]
PriceEngineOpt = Annotated[str, typer.Option("--engine", help="Price the plan as this engine runs it: " + ", ".join(ENGINES) + " (ours: this project's; cost_models/engines.py says what each prices).")]


def _plan_parameters() -> list[inspect.Parameter]:
    """One option per plan knob the CLI offers (specs.plan.PLAN_KNOBS), and the --zero shorthand."""
    params = []
    for spec in PLAN_KNOBS:
        if not spec.knob.cli:
            continue
        kind = spec.scalar_type
        text = spec.knob.help + (f" In {spec.knob.cli_help_unit}." if spec.knob.cli_help_unit else "")
        if spec.knob.choices:
            text += f" One of: {', '.join(spec.knob.choices)}."
        decls = [f"{spec.flag}/--no-{spec.flag[2:]}"] if kind is bool else [spec.flag]
        option = typer.Option(*decls, help=text, rich_help_panel="Plan")
        params.append(inspect.Parameter(spec.name, inspect.Parameter.KEYWORD_ONLY, default=None,
                                        annotation=Annotated[Optional[kind], option]))
    zero = typer.Option("--zero", help="ZeRO stage 0-3: shorthand for the three shard degrees.", rich_help_panel="Plan")
    params.append(inspect.Parameter("zero", inspect.Parameter.KEYWORD_ONLY, default=None,
                                    annotation=Annotated[Optional[int], zero]))
    return params


def takes_plan_options(func):
    """Give command `func` an option per plan knob; it receives their values (None: not given) as one dict
    `plan_options` (planner.inputs.plan_from_options reads it). A new knob needs no change here."""
    base = inspect.signature(func, eval_str=True)
    own = [p for p in base.parameters.values() if p.name != "plan_options"]
    extra = _plan_parameters()
    names = [p.name for p in extra]

    @functools.wraps(func)
    def wrapper(**kwargs):
        options = {name: kwargs.pop(name) for name in names}
        return func(**kwargs, plan_options=options)

    wrapper.__signature__ = base.replace(parameters=own + extra)
    wrapper.__annotations__ = {p.name: p.annotation for p in own + extra}
    return wrapper


def print_json(data: object) -> None:
    sys.stdout.write(json.dumps(data, indent=2) + "\n")


@app.command()
def presets(fmt: FormatOpt = OutputFormat.table) -> None:
    """List the model and hardware presets.

    Example: planner presets --format json
    """
    from specs.model import PRESETS as MODELS
    from specs.hardware import PRESETS as HARDWARE

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
MtbfOpt = Annotated[Optional[float], typer.Option("--mtbf", help="The job's mean time between failures, seconds: checkpoint at the interval that loses least expected time (Daly's, from the cost model's price of a checkpoint write on this hardware).")]


def _local_hardware(nproc: int, fmt: "OutputFormat") -> str:
    """This machine's profile for `nproc` processes (planner/machine.py), with a progress bar while it is
    measured on first use."""
    from planner.machine import cached_profile_path, local_hardware, stale_reason

    if nproc < 1 or stale_reason(cached_profile_path(nproc), nproc=nproc) is None:
        return local_hardware(nproc)  # cached (or refused with its reason): nothing to show
    bar, update = _stage_progress(fmt is OutputFormat.json)
    with bar:
        return local_hardware(nproc, progress=update)


@app.command()
@takes_plan_options
def run(
    model: Annotated[Optional[str], typer.Option("--model", help="Preset name, HF config.json, or model JSON (default: tiny, or the --plan file's).")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", help="Preset or profile JSON the prediction uses (default: this machine's GPU preset or cpu, or the --plan file's).")] = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Sequences per optimizer step (default: 8, or the --plan file's).")] = None,
    seq_len: Annotated[Optional[int], typer.Option("--seq-len", help="Tokens per sequence (default: 64, or the --plan file's).")] = None,
    steps: StepsOpt = 10,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Processes on this node, torchrun --nproc-per-node (default: " + NPROC_DEFAULT + ", or the --plan file's devices over --nnodes).")] = None,
    gpus_per_node: GpusPerNodeOpt = None,
    nnodes: Annotated[Optional[int], typer.Option("--nnodes", help="Nodes, torchrun --nnodes (default: 1).")] = None,
    node_rank: Annotated[int, typer.Option("--node-rank", help="This node's rank (torchrun).")] = 0,
    rdzv_endpoint: Annotated[Optional[str], typer.Option("--rdzv-endpoint", help="HOST:PORT of the c10d rendezvous.")] = None,
    data: Annotated[Optional[str], typer.Option("--data", help="Text file or folder (byte tokens); default synthetic.")] = None,
    engine: Annotated[str, typer.Option("--engine", help="ours, or torch (DDP, ZeroRedundancyOptimizer, FSDP2, DTensor tensor parallel, torch.distributed.pipelining).")] = "ours",
    seed: Annotated[int, typer.Option("--seed")] = 0,
    lr: Annotated[float, typer.Option("--lr")] = 1e-3,
    precision: PrecisionOpt = None,
    plan_file: PlanFileOpt = None,
    metrics_out: Annotated[Optional[str], typer.Option("--metrics-out", help="Write the metrics JSON here.")] = None,
    checkpoint_dir: Annotated[Optional[str], typer.Option("--checkpoint-dir", help="Save sharded, plan-independent checkpoints here (shared by all nodes).")] = None,
    checkpoint_every: Annotated[int, typer.Option("--checkpoint-every", help="Checkpoint every N steps (0: only after the last step).")] = 0,
    checkpoint_keep: Annotated[int, typer.Option("--checkpoint-keep", help="Complete checkpoints to keep.")] = 2,
    resume: Annotated[bool, typer.Option("--resume/--no-resume", help="Continue from the newest checkpoint in --checkpoint-dir (any plan may have saved it).")] = False,
    max_restarts: Annotated[int, typer.Option("--max-restarts", help="torchrun restarts after a failure; each resumes from the newest checkpoint.")] = 0,
    timeout: Annotated[Optional[float], typer.Option("--timeout", help="Seconds a collective may wait for a peer before the run fails (default: derived from the plan's predicted step time).")] = None,
    elastic: Annotated[Optional[str], typer.Option("--elastic", help="MIN:MAX nodes: when a node is lost or comes back, re-plan for the processes left (the search's best plan for each world size, same global batch) and resume from the newest checkpoint (torchrun's c10d rendezvous; needs --checkpoint-dir and --max-restarts).")] = None,
    cluster: Annotated[bool, typer.Option("--cluster", help="Run across the emulated cluster's nodes (`planner cluster up`), one torchrun per node.")] = False,
    cluster_prefix: Annotated[str, typer.Option("--cluster-prefix", help="Name prefix of the emulated cluster.")] = "planner",
    mtbf: MtbfOpt = None,
    fmt: FormatOpt = OutputFormat.table,
    plan_options: dict | None = None,
) -> None:
    """Train with a plan on our engine (launched with torchrun) and report measured beside predicted.

    Examples:
      planner run                                   # tiny model, 2 CPU processes, DP
      planner run --nproc 4 --zero 3 --micro-batch 2
      planner run --nproc 4 --tp 2 --pp 2 --schedule 1f1b --steps 20 --format json
      planner run --plan local.json                 # a plan file from search --out: no other flag needed
      planner run --nproc 4 --zero 3 --checkpoint-dir ckpt --checkpoint-every 50 --max-restarts 3
      planner run --nproc 4 --tp 2 --checkpoint-dir ckpt --resume   # continue under another plan
      planner run --cluster --elastic 1:2 --hardware cpu --checkpoint-dir ckpt --checkpoint-every 2 --max-restarts 3
    """
    from planner.run_command import RunRequest

    request = RunRequest(model=model, hardware=hardware, global_batch=global_batch, seq_len=seq_len,
                         precision=precision, steps=steps, seed=seed, lr=lr, data=data, nproc=nproc, nnodes=nnodes,
                         node_rank=node_rank, rdzv_endpoint=rdzv_endpoint, gpus_per_node=gpus_per_node,
                         engine=engine, plan_file=plan_file, timeout_s=timeout, checkpoint_dir=checkpoint_dir,
                         checkpoint_every=checkpoint_every, checkpoint_keep=checkpoint_keep, resume=resume,
                         max_restarts=max_restarts, cluster=cluster_prefix if cluster else None, elastic=elastic,
                         mtbf_s=mtbf)
    _run_and_report(request, plan_options or {}, metrics_out=metrics_out, fmt=fmt)


def _run_and_report(request, plan_options: dict, *, metrics_out: str | None, fmt: OutputFormat) -> None:
    """`planner run`'s work once its options are a RunRequest: build, launch (or run as a torchrun
    worker), then write and print the metrics on rank 0."""
    from specs.jsonio import write_json_atomic
    from planner.run_command import build_run, resolve_request, run_in_this_process, under_torchrun

    request, planfile = resolve_request(request, plan_options)
    cfg = build_run(request, plan_options, planfile=planfile)
    if request.mtbf_s is not None and fmt is not OutputFormat.json:
        err_console.print(f"checkpoint every {cfg.checkpoint_every} steps (Daly's interval for an MTBF of "
                          f"{request.mtbf_s:g} s)", markup=False, highlight=False)
    if under_torchrun():
        metrics = run_in_this_process(cfg)
        if os.environ.get("RANK", "0") != "0":
            return
    else:
        metrics = _launch_with_progress(cfg, request, quiet=fmt is OutputFormat.json)
    if metrics is None:
        return
    if metrics_out:
        write_json_atomic(metrics_out, metrics.to_dict())
    if fmt is OutputFormat.json:
        print_json(metrics.to_dict())
    else:
        _print_run_report(metrics)


def _launch_with_progress(cfg, request, *, quiet: bool):
    from runners.launch import RunFailed, launch

    bar, update = _stage_progress(quiet)
    with bar:
        update("training", 0, cfg.steps, cfg.plan.describe())

        def on_step(record: dict) -> None:
            # The step number, not a count: a resumed or restarted run reports from its checkpoint's step.
            update("training", record["step"] + 1, cfg.steps,
                   f"loss {record['loss']:.4f}  {record['step_time_s'] * 1e3:.0f} ms/step")

        def on_change(event) -> None:
            # Printed as it happens (an elastic run's changes), and kept in the metrics' events.
            lost = f", {event.steps_lost} steps lost" if event.kind == "resumed" else ""
            err_console.print(f"[{event.time_s:7.1f} s] {event.kind}: world {event.world_size}, step {event.step}"
                              f"{lost}; {event.detail}", markup=False, highlight=False)

        try:
            return launch(cfg, where=request.where(), on_step=on_step, on_change=on_change)
        except RunFailed as exc:
            err_console.print(f"error: {exc}", markup=False, highlight=False)
            raise typer.Exit(1)


def _print_run_report(metrics) -> None:
    summary, predicted = metrics.summary, metrics.predicted or {}
    losses = metrics.losses
    precision = f"   {summary.precision} on {summary.device}" if summary.precision else ""
    if summary.skipped_steps:
        precision += f" ({summary.skipped_steps} steps skipped on overflow, loss scale {summary.loss_scale:g})"
    console.print(f"plan: {metrics.plan.describe()}   losses: {losses[0]:.4f} -> {losses[-1]:.4f}{precision}")
    table = Table(title="Measured beside predicted")
    for col in ("", "measured", "predicted", "measured / predicted"):
        table.add_column(col, justify="right")

    def row(name: str, measured: float, pred: float | None, fmt) -> None:
        ratio = f"{measured / pred:.2f}" if pred else "-"
        table.add_row(name, fmt(measured), fmt(pred) if pred is not None else "-", ratio)

    row("step time", summary.median_step_time_s, predicted.get("step_time_s"), lambda v: f"{v * 1e3:.1f} ms")
    row("tokens/s", summary.tokens_per_s, predicted.get("tokens_per_s"), lambda v: f"{v:,.0f}")
    row("peak memory / rank", summary.peak_memory_bytes, predicted.get("peak_memory_bytes"),
        lambda v: f"{v / 2**20:,.1f} MiB")
    console.print(table)
    console.print("communication per step (all ranks): " + ", ".join(
        f"{k} {v / 2**20:.2f} MiB" for k, v in summary.comm_bytes.items() if v)
        + f"; waiting {summary.comm_wait_s * 1e3:.1f} ms/rank")


# --- planner search and planner estimate ------------------------------------------------------------
TopOpt = Annotated[int, typer.Option("--top", help="Plans to rank exactly and show.")]


class _BadInput:
    """Turn PlannerError/ValueError into one line on stderr and exit code 2 inside a command, so the
    behaviour is the same under main() and typer's CliRunner (which calls `app`, not main)."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, (PlannerError, ValueError)):
            err_console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
            raise typer.Exit(2)
        return False


# The plan notation of search's table, `Plan.describe()` and `_plan_label` (one legend for --help and the table).
PLAN_NOTATION = (
    "dpD tpT ppP: data-, tensor- and pipeline-parallel degrees; vV: model chunks per pipeline rank (interleaved "
    "1F1B); mbMxN: M sequences per micro-batch, N micro-batches per step on each DP replica; gpipe, 1f1b, "
    "interleaved-1f1b: the pipeline schedule; rc=none|selective|full: recomputation of every layer (per-layer: the "
    "ILP's mix, counted in brackets); sp: sequence parallelism; zero0-3: the ZeRO stage, or shard=(P,G,O): the DP "
    "ranks sharding parameters, gradients and optimizer states (Lins; HSDP when all three are equal and below dp); "
    "cache=device|host|secondary: where a ZeRO-3 layer's gathered parameters wait for backward (MAZ3; per-layer: "
    "one tier per layer); commshift: the DP gradient reduction moved behind the stage's last send; stages=a/b/..: "
    "layers per pipeline chunk; +N alike: N more plans within 1% in step time with the same degrees and micro-batches "
    "(or the same memory), which the cost model cannot tell apart.")

SEARCH_HELP = """Find the fastest plan that fits: degrees, sharding, micro-batches, schedule, recomputation.

Examples:

  planner search --model llama3-70b --hardware h100 --gpus 1024 --gpus-per-node 8 --global-batch 1024 --seq-len 4096

  planner search --model gpt3-175b --hardware a100 --gpus 3072 --global-batch 1536 --top 10 --out plan.json

  planner search --model tiny --hardware cpu --gpus 8 --global-batch 32 --format json

  planner search --model llama3-8b --hardware h100 --gpus 64 --global-batch 256 --engine megatron --out plan.json

  planner search --model gpt3-18b --hardware a100 --gpus 256 --global-batch 1024 --optuna-trials 200 --storage sqlite:///tune.db --study-name gpt3-18b

Notation: """ + PLAN_NOTATION


@app.command("search", help=SEARCH_HELP)
def search_command(
    model: ModelOpt, gpus: GpusOpt, global_batch: GlobalBatchOpt, hardware: LocalHardwareOpt = None,
    gpus_per_node: GpusPerNodeOpt = None, seq_len: SeqLenOpt = None, precision: PrecisionOpt = None,
    memory_headroom: HeadroomOpt = None, top: TopOpt = 5,
    out: Annotated[Optional[str], typer.Option("--out", help="Write the winner as a plan file (plan, model, hardware, cluster, job, estimate) that explain, export, estimate and run --plan read with no other flag.")] = None,
    engine: PriceEngineOpt = "ours",
    optuna_trials: Annotated[int, typer.Option("--optuna-trials", help="TPE trials tuning per-stage knobs around the winner.")] = 0,
    storage: Annotated[Optional[str], typer.Option("--storage", help="Optuna storage, e.g. sqlite:///tune.db, so a search resumes.")] = None,
    study_name: Annotated[Optional[str], typer.Option("--study-name", help="Optuna study to create or resume.")] = None,
    seed: Annotated[int, typer.Option("--seed", help="TPE sampler seed.")] = 0,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    import time

    from specs.planfile import PlanFile, hardware_source
    from specs.problem import make_problem
    from planner.search import SearchOptions, default_cost_model, distinct_plans, search

    with _BadInput():
        if top < 1 or optuna_trials < 0:
            raise PlannerError(f"--top must be at least 1 and --optuna-trials at least 0, got {top} and {optuna_trials}")
        cost = default_cost_model(engine)
        hardware = hardware or _local_hardware(gpus, fmt)
        problem = make_problem(model=model, hardware=hardware, gpus=gpus, gpus_per_node=gpus_per_node,
                               global_batch=global_batch, seq_len=seq_len, precision=precision,
                               memory_headroom=memory_headroom)
        source = hardware_source(hardware)
        start = time.perf_counter()
        with err_console.status("searching") as status:
            # Rank more than --top: plans the cost model cannot tell apart collapse into one row.
            result = search(problem, cost=cost, options=SearchOptions(
                top_k=4 * top, on_progress=lambda n: status.update(f"searching: {n} plans priced")))
            ranked, num_evaluated = list(result.candidates), result.num_evaluated
            if optuna_trials:
                from planner.optuna_search import refined_ranking

                status.update(f"tuning {result.winner.plan.describe()} with {optuna_trials} TPE trials")
                ranked, num_evaluated = refined_ranking(result, problem, num_trials=optuna_trials, seed=seed,
                                                        storage=storage, study_name=study_name, cost=cost)
        search_time_s = time.perf_counter() - start
    winner = ranked[0]
    if out:
        PlanFile(plan=winner.plan, model=problem.model, job=problem.job, cluster=problem.cluster,
                 hardware_source=source, engine=engine, estimate=winner.estimate.to_dict()).save(out)
    shown = distinct_plans((c for c in ranked if c.estimate.fits), limit=top)
    if fmt is OutputFormat.json:
        print_json({"engine": engine, "search_time_s": search_time_s, "num_evaluated": num_evaluated,
                    "plans": [{**d.candidate.to_dict(), "alike": len(d.alike), "alike_differ_in": d.differing_knobs()}
                              for d in shown],
                    "pareto": [c.to_dict() for c in result.pareto]})
        return
    _print_search_report(problem, result, ranked, shown, engine=engine, num_evaluated=num_evaluated,
                         search_time_s=search_time_s, out=out)


def _print_search_report(problem, result, ranked, shown, *, engine: str, num_evaluated: int, search_time_s: float,
                         out: str | None) -> None:
    winner = ranked[0]
    _print_search_table(problem, shown, engine=engine)
    console.print(f"priced {num_evaluated} plans ({result.num_pruned_memory} ruled out by memory before pricing) "
                  f"in {search_time_s:.2f} s", highlight=False)
    if len(shown) > 1:
        console.print(_why_winner(shown[0].candidate, shown[1].candidate), highlight=False)
    unfit = [c for c in ranked if not c.estimate.fits and c.estimate.step_time_s < winner.estimate.step_time_s]
    if unfit:
        # The faster plan that comes closest to fitting: what a little more memory would buy.
        near = min(unfit, key=lambda c: c.estimate.memory_shortfall_bytes)
        console.print(f"faster but does not fit: {_plan_label(near.plan)} ({near.estimate.step_time_s:.4g} s) "
                      f"needs {near.estimate.memory_shortfall_bytes / 2**30:.2f} GiB more per device", highlight=False)
    if out:
        console.print(f"plan file: {out} (explain, export, estimate and run --plan need no other flag)", highlight=False)


def _print_search_table(problem, shown, *, engine: str) -> None:
    priced_for = "" if engine == "ours" else f", priced as {engine} runs them"
    table = Table(title=f"Best plans: {problem.model.name} on {problem.cluster.num_devices} x "
                        f"{problem.cluster.hardware.name}, batch {problem.job.global_batch} x {problem.job.seq_len}"
                        f"{priced_for}", caption=f"Notation: {PLAN_NOTATION}", caption_justify="left")
    for col in ("#", "plan", "step", "tokens/s", "MFU", "TFLOP/s/GPU", "GiB/device"):
        table.add_column(col, justify="left" if col == "plan" else "right", no_wrap=col != "plan")
    for i, d in enumerate(shown, 1):
        c, e = d.candidate, d.candidate.estimate
        label = _plan_label(c.plan) + (f" (+{len(d.alike)} alike in {_knob_groups(d.differing_knobs())})"
                                       if d.alike else "")
        table.add_row(str(i), label, f"{e.step_time_s:.4g} s", f"{e.tokens_per_s:,.0f}", f"{e.mfu:.1%}",
                      f"{e.tflops_per_gpu:.3g}", f"{e.peak_memory_bytes / 2**30:.3g}")
    console.print(table)


def _knob_groups(fields: list[str]) -> str:
    """Plan fields in a few words: the three shard degrees are 'sharding', recompute(_layers) 'recompute'."""
    names = {"param_shard": "sharding", "grad_shard": "sharding", "optim_shard": "sharding",
             "recompute_layers": "recompute", "bucket_size_bytes": "buckets", "param_cache": "cache",
             "prefetch_depth": "prefetch"}
    return ", ".join(dict.fromkeys(names.get(f, f) for f in fields))


def _seconds(value_s: float) -> str:
    return f"{value_s:.3g} s" if value_s >= 0.1 else f"{value_s * 1e3:.3g} ms"


def _plan_label(plan) -> str:
    """Plan.describe() plus what it leaves out: unequal stages and the per-layer recomputation mix."""
    label = plan.describe()
    if plan.recompute_layers is not None:
        mix = {p: plan.recompute_layers.count(p) for p in ("none", "selective", "full")}
        label += " (" + ", ".join(f"{n} {p}" for p, n in mix.items() if n) + ")"
    if plan.stage_layers is not None:
        label += " stages=" + "/".join(map(str, plan.stage_layers))
    return label


def _why_winner(winner, runner_up) -> str:
    """One line: by how much the winner beats the runner-up, the breakdown term it saves most on, and
    the knobs in which the two plans differ."""
    w, r = winner.estimate, runner_up.estimate
    # These add up to the step time (compute, recomputation, exposed communication, bubble, optimizer);
    # totals such as dp_comm_s include communication hidden under compute, so they would mislead.
    additive = ("compute_s", "recompute_s", "exposed_comm_s", "bubble_s", "optimizer_s")
    terms = {k: r.breakdown.get(k, 0.0) - w.breakdown[k] for k in additive if k in w.breakdown}
    saved = max(terms, key=terms.get) if terms else None
    differs = [f for f in winner.plan.__dataclass_fields__ if getattr(winner.plan, f) != getattr(runner_up.plan, f)]
    gain = r.step_time_s - w.step_time_s
    if gain <= 0:
        return f"#1 and #2 tie on predicted step time (they differ in {', '.join(differs)})"
    line = f"#1 beats #2 by {_seconds(gain)}/step ({gain / r.step_time_s:.2%})"
    if saved is not None and terms[saved] > 0:
        line += f": {_seconds(terms[saved])} less {saved.removesuffix('_s').replace('_', ' ')}"
    if differs:
        line += f" (they differ in {', '.join(differs)})"
    return line


@app.command("estimate")
@takes_plan_options
def estimate_command(
    model: MaybeModelOpt = None, hardware: MaybeHardwareOpt = None, gpus: MaybeGpusOpt = None,
    global_batch: MaybeGlobalBatchOpt = None,
    gpus_per_node: GpusPerNodeOpt = None, seq_len: SeqLenOpt = None, precision: PrecisionOpt = None,
    memory_headroom: HeadroomOpt = None, plan_file: PlanFileOpt = None,
    engine: PriceEngineOpt = "ours",
    mtbf: MtbfOpt = None,
    fmt: FormatOpt = OutputFormat.table,
    plan_options: dict | None = None,
) -> None:
    """Price one plan: step time, tokens/s, MFU, memory per device, and where the time and memory go;
    with --mtbf, the checkpoint interval and the expected goodput under that failure rate.

    Examples:
      planner estimate --model gpt3-1.7b --hardware a100 --gpus 32 --global-batch 512 --recompute full
      planner estimate --model llama3-70b --hardware h100 --gpus 64 --global-batch 64 --seq-len 4096 --tp 8 --pp 4 --virtual-stages 2 --zero 1 --sequence-parallel
      planner estimate --plan plan.json --engine megatron --format json      # a plan file from search --out
      planner estimate --model llama3-70b --hardware h100 --gpus 1024 --global-batch 1024 --tp 8 --pp 4 --zero 1 --sequence-parallel --recompute selective --mtbf 14400
    """
    from cost_models.checkpoint import plan_cadence

    from cost_models.estimate import estimate
    from planner.inputs import (ProblemFlags, plan_and_problem, plan_from_options, problem_from_flags,
                                refuse_plan_options_with_file)

    with _BadInput():
        flags = ProblemFlags(model=model, hardware=hardware, gpus=gpus, gpus_per_node=gpus_per_node,
                             global_batch=global_batch, seq_len=seq_len, precision=precision,
                             memory_headroom=memory_headroom)
        if plan_file:
            refuse_plan_options_with_file(plan_options or {})
            plan, problem, _ = plan_and_problem(plan_file, flags)
        else:
            problem = problem_from_flags(flags)
            plan = plan_from_options(plan_options or {}, problem)
        est = estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job, engine=engine)
        cadence = plan_cadence(model=problem.model, cluster=problem.cluster, step_time_s=est.step_time_s,
                               mtbf_s=mtbf) if mtbf is not None else None
    if fmt is OutputFormat.json:
        print_json({"plan": plan.to_dict(), "engine": engine, **est.to_dict(),
                    **({"checkpoint": cadence.to_dict()} if cadence else {})})
        return
    _print_estimate(plan, est, cadence, engine=engine)


def _print_estimate(plan, est, cadence, *, engine: str) -> None:
    console.print(f"plan: {plan.describe()}" + ("" if engine == "ours" else f"   (priced as {engine} runs it)"),
                  highlight=False)
    console.print(f"step {est.step_time_s:.4f} s   {est.tokens_per_s:,.0f} tokens/s   MFU {est.mfu:.1%}   "
                  f"{est.tflops_per_gpu:.0f} TFLOP/s per GPU   memory {est.peak_memory_bytes / 2**30:.2f} of "
                  f"{est.memory_limit_bytes / 2**30:.2f} GiB per device (after the memory headroom)", highlight=False)
    table = Table(title="Breakdown (critical rank's time, worst rank's memory)")
    for col in ("term", "value"):
        table.add_column(col, justify="left" if col == "term" else "right")
    for key, value in est.breakdown.items():
        if key.endswith("_s"):
            table.add_row(key, f"{value * 1e3:,.1f} ms")
        elif key.endswith("_bytes"):
            table.add_row(key, f"{value / 2**30:,.2f} GiB")
        else:
            table.add_row(key, f"{value:g}")
    console.print(table)
    if cadence is not None:
        console.print(f"under an MTBF of {cadence.mtbf_s:g} s: checkpoint every {cadence.every_steps} steps "
                      f"({cadence.every_steps * est.step_time_s:,.1f} s; Daly {cadence.interval_s:,.1f} s) at "
                      f"{cadence.write_s:,.2f} s a write, restart {cadence.restart_s:g} s: expected goodput "
                      f"{cadence.goodput:.1%}", highlight=False)
    if not est.fits:
        console.print(f"does not fit: needs {est.memory_shortfall_bytes / 2**30:.2f} GiB more per device than the "
                      f"{est.memory_limit_bytes / 2**30:.2f} GiB it has", style="bold red", highlight=False)


def _count(n: float) -> str:
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


# --- planner profile and the emulated cluster -------------------------------------------------------
@app.command()
def profile(
    out: Annotated[Optional[str], typer.Option("--out", help="Where to write the Hardware profile JSON (default: this machine's cache entry for --nproc, which every command uses by default; profile.json for an emulated cluster or several nodes).")] = None,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Processes for the collective benchmark (torchrun; 1: no collectives, links from the device's preset; default: " + NPROC_DEFAULT + ").")] = None,
    gpus_per_node: GpusPerNodeOpt = None,
    quick: Annotated[bool, typer.Option("--quick", help="Fewer shapes, messages up to 16 MiB, short repeats.")] = False,
    model: ModelOpt = "tiny",
    sizes: Annotated[Optional[str], typer.Option("--sizes", help="Message sizes, e.g. 1k,64k,1m (overrides the default sweep).")] = None,
    collectives: Annotated[Optional[str], typer.Option("--collectives", help="Comma list (default: all six).")] = None,
    cluster: Annotated[bool, typer.Option("--cluster", help="Run the collectives on the emulated cluster (`planner cluster up`).")] = False,
    cluster_prefix: Annotated[str, typer.Option("--cluster-prefix", help="Name prefix of the emulated cluster.")] = "planner",
    probe_seconds: Annotated[Optional[float], typer.Option("--probe-seconds", help="Seconds the layer probe spends per point (default 1.5 with --quick, else 4); shorter is noisier.")] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Measure compute, memory and collectives here and write a Hardware profile JSON.

    The profile feeds `--hardware profile.json` of search, estimate and run.

    Examples:
      planner profile --quick --out profile.json
      planner profile --nproc 4 --gpus-per-node 2 --out profile.json    # 2 emulated nodes of 2
      planner profile --nproc 1 --model llama3.2-1b --out gpu.json      # one GPU
      planner profile --cluster --quick --out profile.json              # on `planner cluster up`
    """
    from specs.hardware import COLLECTIVES
    from planner.profiling import measure_profile
    from profilers.profile import ProfileOptions, parse_sizes, summary
    from runners.launch import RunFailed

    from planner.machine import cached_profile_path, default_nproc

    nproc = default_nproc() if nproc is None else nproc
    if out is None:
        # One host's processes: the cache entry every command prices with by default; else a file.
        one_host = not cluster and gpus_per_node in (None, nproc)
        out = str(cached_profile_path(nproc)) if one_host else "profile.json"
    options = ProfileOptions(
        nproc=nproc, ranks_per_node=gpus_per_node, quick=quick, model=model,
        sizes_bytes=parse_sizes(sizes) if sizes else None,
        collectives=tuple(c.strip() for c in collectives.split(",")) if collectives else COLLECTIVES,
        cluster_prefix=cluster_prefix if cluster else None, probe_seconds=probe_seconds)
    bar, update = _stage_progress(fmt is OutputFormat.json)
    with bar:
        try:
            hardware = measure_profile(options, progress=update)
        except RunFailed as exc:
            err_console.print(f"error: {exc}", markup=False, highlight=False)
            raise typer.Exit(1)
    hardware.save(out)
    if fmt is OutputFormat.json:
        print_json({"out": out, **summary(hardware)})
        return
    _print_profile(summary(hardware), out=out)


def _print_profile(info: dict, *, out: str) -> None:
    console.print(f"profile of {info['device']} written to {out}")
    console.print("peak: " + ", ".join(f"{d} {v / 1e9:.1f} GFLOP/s" for d, v in info["peak_flops_per_s"].items())
                  + f"; GEMM efficiency {info['gemm_max_efficiency']:.2f}, half dim {info['gemm_half_dim']:.1f}, "
                  f"kernel floor {info['kernel_overhead_s'] * 1e6:.1f} us; memory {info['memory_bytes'] / 2**30:.1f} GiB "
                  f"at {info['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s")
    table = Table(title="Collectives (bus bandwidth)")
    for col in ("collective", "link", "group", "latency us", "GB/s"):
        table.add_column(col, justify="left" if col in ("collective", "link") else "right")
    for f in info["collectives"]:
        table.add_row(f["collective"], f["link"], str(f["group_size"]), f"{f['latency_s'] * 1e6:.1f}",
                      f"{f['bus_bandwidth_bytes_per_s'] / 1e9:.3f}")
    console.print(table)
    for link in ("intra_node", "inter_node"):
        spec = info[link]
        console.print(f"{link}: {spec['bandwidth_bytes_per_s'] / 1e9:.3f} GB/s, {spec['latency_s'] * 1e6:.1f} us")
    if info["links_from"] != "measured":
        console.print(f"links not measured: taken from the {info['links_from']}")


# --- planner validate, calibrate, explain, export, tune (the library sides are planner/<command>.py) ------
OutFileOpt = Annotated[Optional[str], typer.Option("--out", help="Write the result here.")]


def _stage_progress(quiet: bool):
    """A rich progress bar for a long command, and the callback (stage, done, total, label) that drives it."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("[bold]{task.fields[stage]}[/]"), BarColumn(), MofNCompleteColumn(),
                   TextColumn("{task.fields[label]}"), TimeElapsedColumn(), console=err_console, disable=quiet)
    task = bar.add_task("work", total=None, stage="", label="")

    def update(stage: str, done: int, total: int | None, label: str) -> None:
        bar.update(task, completed=done, total=total, stage=stage, label=label)

    return bar, update


def _pct(value) -> str:
    return "-" if value is None else f"{value:.1%}"


def _agreement_table(title: str, columns: dict) -> Table:
    """One column per Agreement (planner.reports)."""
    table = Table(title=title)
    table.add_column("")
    for name in columns:
        table.add_column(name, justify="right")
    for key, label in (("num_ok", "plans"), ("mape", "step time MAPE"), ("max_error", "max error"),
                       ("kendall_tau", "Kendall tau"), ("regret", "regret of top pick"), ("memory_mape", "memory MAPE")):
        cells = []
        for stats in columns.values():
            value = getattr(stats, key)
            cells.append("-" if value is None else str(value) if key == "num_ok" else
                         f"{value:.3f}" if key == "kendall_tau" else _pct(value))
        table.add_row(label, *cells)
    return table


@app.command("validate")
def validate_command(
    model: ModelOpt = "tiny", hardware: LocalHardwareOpt = None,
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Local processes every plan runs on (default: " + NPROC_DEFAULT + ").")] = None,
    global_batch: GlobalBatchOpt = 16, seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 64,
    precision: PrecisionOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="Steps per run (the first is a warm-up).")] = 8,
    rounds: Annotated[int, typer.Option("--rounds", help="Runs per plan, interleaved across plans; medians.")] = 1,
    timing_rounds: Annotated[Optional[int], typer.Option("--timing-rounds", help="Rounds of the batched, interleaved timing run (default: rounds are added until the top pick and the fastest plan are separable, at most 16; 0: time from the runs).")] = None,
    top: Annotated[int, typer.Option("--top", help="The search's top plans to include.")] = 3,
    max_plans: Annotated[Optional[int], typer.Option("--max-plans", help="Run at most this many plans.")] = None,
    spread: Annotated[bool, typer.Option("--spread/--no-spread", help="Add the deliberate spread (DP, ZeRO-1/2/3, TP, PP, micro-batches).")] = True,
    out: Annotated[str, typer.Option("--out", help="The JSON report.")] = "validate.json",
    png: Annotated[Optional[str], typer.Option("--png", help="Predicted-vs-measured scatter (default: next to --out).")] = None,
    cluster: Annotated[bool, typer.Option("--cluster", help="Run every plan across the emulated cluster's nodes (`planner cluster up`) instead of --nproc local processes.")] = False,
    cluster_prefix: Annotated[str, typer.Option("--cluster-prefix", help="Name prefix of the emulated cluster.")] = "planner",
    published: Annotated[Optional[str], typer.Option("--published", help="Instead of running plans, price published measured GPU runs: the repo's set (benchmarks/published/dense_runs.csv) or this CSV.")] = None,
    loso: Annotated[bool, typer.Option("--loso/--no-loso", help="With --published: also the leave-one-source-out MAPE (prices every row at several compute scales).")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Run a spread of plans for real and compare measured with predicted step time and memory.

    Reports MAPE, max error, Kendall tau and the regret of the model's top pick; failed runs are listed.
    With --published, prices published measured runs (each as its engine runs it) instead.

    Examples:
      planner validate --nproc 4 --hardware profile.json --out validate.json
      planner validate --nproc 2 --top 1 --max-plans 3 --steps 4 --format json
      planner validate --nproc 4 --rounds 3 --png scatter.png
      planner validate --nproc 4 --timing-rounds 6      # on a loaded host: one interleaved batched timing run
      planner validate --cluster --hardware cluster-profile.json --max-plans 6   # on `planner cluster up`
      planner validate --published --format json        # the cost model against published GPU runs
      planner validate --published runs.csv --no-loso
    """
    from specs.jsonio import write_json_atomic
    from planner.validate import ValidateSettings, validate, write_scatter_png

    if published is not None:
        _validate_published(published, loso=loso, fmt=fmt)
        return

    with _BadInput():
        settings = ValidateSettings(model=model, hardware=hardware, nproc=nproc, global_batch=global_batch,
                                    seq_len=seq_len, precision=precision, steps=steps, rounds=rounds, top_k=top,
                                    spread=spread, max_plans=max_plans, timing_rounds=timing_rounds,
                                    cluster=cluster_prefix if cluster else None)
        bar, update = _stage_progress(fmt is OutputFormat.json)
        with bar:
            report = validate(settings, progress=lambda done, total, label: update("validate", done, total, label))
    write_json_atomic(out, report.to_dict())
    png = png or os.path.splitext(out)[0] + ".png"
    write_scatter_png(report, png)
    if fmt is OutputFormat.json:
        print_json(report.to_dict())
        return
    where = f"emulated cluster {cluster_prefix}, {report.nproc} processes" if cluster else f"{report.nproc} processes"
    _print_validate_report(report, where=where, out=out, png=png)


# A host-speed change beyond this (between the profile's calibration and a validate) is warned about.
HOST_SPEED_WARN = 0.1


def _print_validate_report(report, *, where: str, out: str, png: str) -> None:
    speed = "at the host's speed now" if report.at_host_speed else "at the profile's speed"
    table = Table(title=f"Measured against predicted ({report.hardware_name}, {where}; predictions {speed})")
    for col in ("plan", "", "predicted", "measured", "IQR", "error", "memory error"):
        table.add_column(col, justify="left" if col in ("plan", "") else "right")
    for r in report.plans:
        predicted = r.predicted_step_time_s * report.host_speed_for(r)
        if not r.ok:
            table.add_row(r.label, r.describe, f"{predicted * 1e3:.1f} ms", "failed", "", r.error or "", "")
            continue
        quartiles = r.measured_quartiles_s
        iqr = f"{quartiles[0] * 1e3:.1f}-{quartiles[1] * 1e3:.1f}" if quartiles else "-"
        table.add_row(r.label, r.describe, f"{predicted * 1e3:.1f} ms", f"{r.measured_step_time_s * 1e3:.1f} ms", iqr,
                      f"{predicted / r.measured_step_time_s - 1:+.1%}", f"{r.memory_error:+.1%}")
    console.print(table)
    agree = report.agreement
    console.print(_agreement_table("Agreement", {"all plans": agree}))
    noise = (f" (within the measured noise of each other: regret {_pct(agree.raw_regret)} as measured, counted 0)"
             if agree.top_pick_within_noise else "")
    console.print(f"top pick {agree.top_pick}, best measured {agree.best_measured}{noise}; {report.timing_rounds} "
                  f"interleaved timing rounds; report {out}, scatter {png}", highlight=False)
    _print_host_speed(report)


def _print_host_speed(report) -> None:
    """The host's speed line: what the predictions were scaled by and the MAPE at the profile's speed."""
    factor = report.host_speed_factor
    if factor is None:
        console.print("host speed: no plan the profile's calibration timed ran here (an uncalibrated profile, "
                      "or another process count): predictions at the profile's speed", highlight=False)
        return
    pace, times = ("slower", factor) if factor >= 1 else ("faster", 1 / factor)
    ratios = ", ".join(f"{ratio:.2f}" for _, ratio in report.host_speed_ratios)
    raw = report.agreement_at_profile_speed
    taken = ("predictions above are taken at that speed, each reference's from the others'" if report.at_host_speed
             else "too few to take the predictions at that speed")
    console.print(f"host speed: {report.host_speed_plans} calibration plan(s) timed in the same run ran {times:.2f}x "
                  f"{pace} than during the calibration ({ratios}); {taken}; at the profile's speed MAPE "
                  f"{_pct(raw.mape)}, max {_pct(raw.max_error)}", highlight=False)
    if abs(factor - 1) > HOST_SPEED_WARN:
        err_console.print(f"warning: this host runs {times:.2f}x {pace} than when its profile was calibrated (other "
                          "load, another clock); `planner tune --recalibrate` fits the profile again", highlight=False)


def _validate_published(path: str, *, loso: bool, fmt: OutputFormat) -> None:
    from planner.published import DEFAULT_CSV, validate_published

    with _BadInput(), err_console.status("pricing published runs"):
        report = validate_published(DEFAULT_CSV if path == PUBLISHED_DEFAULT else path, loso=loso)
    if fmt is OutputFormat.json:
        print_json(report.to_dict())
        return
    table = Table(title="Published measured runs against the cost model (each priced as its engine runs it)")
    for col in ("source", "rows", "MAPE", "mean error", "LOSO MAPE"):
        table.add_column(col, justify="left" if col == "source" else "right")
    for source, stats in report.per_source.items():
        loso_cell = _pct(stats["loso_mape"]) if "loso_mape" in stats else "-"
        table.add_row(source, str(stats["num_rows"]), _pct(stats["mape"]), f"{stats['mean_error']:+.1%}", loso_cell)
    console.print(table)
    tau = "-" if report.kendall_tau is None else f"{report.kendall_tau:.3f}"
    regret = "-" if report.regret is None else _pct(report.regret)
    loso_all = "-" if report.loso_mape is None else _pct(report.loso_mape)
    console.print(f"{report.num_rows} rows: MAPE {_pct(report.mape)}, within-model Kendall tau {tau}, worst top-pick "
                  f"regret {regret}, leave-one-source-out MAPE {loso_all}", highlight=False)
    for line in report.skipped:
        err_console.print(f"skipped {line}", markup=False, highlight=False, soft_wrap=True)


@app.command("calibrate")
def calibrate_command(
    measurements: Annotated[Optional[str], typer.Option("--measurements", help="A `planner validate --out` report.")] = None,
    from_runs: Annotated[Optional[str], typer.Option("--from-runs", help="A CSV of a GPU cluster's past training runs (any engine; columns in planner/published.py) to fit --hardware's free parameters to.")] = None,
    hardware: Annotated[Optional[str], typer.Option("--hardware", help="Profile to start from (default: the report's; required with --from-runs).")] = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Calibrated profile (default: overwrite --hardware's file).")] = None,
    held_out_every: Annotated[int, typer.Option("--held-out-every", help="Hold out every k-th plan by measured time.")] = 2,
    parameters: Annotated[Optional[str], typer.Option("--parameters", help="Comma list of step-time parameters to fit (default: all).")] = None,
    memory: Annotated[bool, typer.Option("--memory/--no-memory", help="Also fit framework_reserve_bytes.")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Fit the cost model's free parameters to measured runs and write them into the hardware profile.

    The fit uses part of the plans; the agreement is reported on the plans held out of it.

    Examples:
      planner calibrate --measurements validate.json --hardware profile.json
      planner calibrate --measurements validate.json --hardware cpu --out calibrated.json --format json
      planner calibrate --measurements validate.json --parameters op_overhead_s,collective_overhead_s --held-out-every 3
      planner calibrate --from-runs runs.csv --hardware h100 --out h100-cluster.json
    """
    from planner.calibrate import calibrate_from_runs, calibrate_measurements

    with _BadInput(), err_console.status("fitting"):
        names = tuple(p.strip() for p in parameters.split(",")) if parameters else None
        if (measurements is None) == (from_runs is None):
            raise PlannerError("give one of --measurements (a planner validate report) or --from-runs (a runs CSV)")
        if from_runs is not None:
            if hardware is None:
                raise PlannerError("--from-runs needs --hardware: the GPU preset or profile the runs ran on")
            target, result = calibrate_from_runs(from_runs, hardware=hardware, out=out, held_out_every=held_out_every,
                                                 parameters=names, fit_memory=memory)
        else:
            target, result = calibrate_measurements(
                measurements, hardware=hardware, out=out, held_out_every=held_out_every, fit_memory=memory,
                parameters=names)
    if fmt is OutputFormat.json:
        print_json({"out": target, **result.to_dict()})
        return
    console.print(_agreement_table("Held-out plans (not used by the fit)",
                                   {"before": result.held_out_before, "after": result.held_out_after}))
    console.print(_agreement_table("Fitted plans", {"before": result.fit_before, "after": result.fit_after}))
    console.print("calibration: " + ", ".join(f"{k} {v:.4g}" for k, v in result.calibration.items())
                  + f"; written to {target}", highlight=False)


@app.command("explain")
def explain_command(
    plan_file: Annotated[str, typer.Option("--plan", help="Plan file from `search --out` (needs no other flag), or a bare plan JSON with --model and --hardware.")],
    model: MaybeModelOpt = None, hardware: MaybeHardwareOpt = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="Devices (default: the plan file's, or the plan's dp x cp x tp x pp).")] = None,
    gpus_per_node: GpusPerNodeOpt = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Default: the plan file's, or the plan's.")] = None,
    seq_len: SeqLenOpt = None, precision: PrecisionOpt = None,
    measured: Annotated[Optional[str], typer.Option("--measured", help="`planner run --metrics-out` file of the same plan.")] = None,
    png: Annotated[str, typer.Option("--png", help="The timeline picture.")] = "explain.png",
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Draw one training step per pipeline rank as the cost model sees it, with a text breakdown.

    Examples:
      planner explain --plan plan.json                      # a plan file from search --out
      planner explain --plan plan.json --png step.png --format json
      planner run --nproc 4 --pp 2 --metrics-out m.json && planner explain --plan m.json --model tiny --hardware cpu --seq-len 64 --measured m.json
    """
    from planner.explain import breakdown_lines, explain, load_measured, write_timeline_png
    from planner.inputs import ProblemFlags, plan_and_problem

    with _BadInput():
        plan, problem, _ = plan_and_problem(plan_file, ProblemFlags(
            model=model, hardware=hardware, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
            seq_len=seq_len, precision=precision))
        metrics = load_measured(measured, plan) if measured else None
        ex = explain(plan, problem)
    write_timeline_png(ex, png, metrics=metrics)
    if fmt is OutputFormat.json:
        print_json({"plan": plan.to_dict(), "estimate": ex.estimate.to_dict(), "png": png,
                    "critical_rank": ex.critical_rank, "busiest_rank": ex.busiest_rank,
                    "measured_step_time_s": metrics.summary.median_step_time_s if metrics else None,
                    "spans": [{"rank": s.rank, "kind": s.kind, "chunk": s.chunk, "micro_batch": s.micro_batch,
                               "start_s": s.start_s, "end_s": s.end_s} for s in ex.spans]})
        return
    for line in breakdown_lines(ex, metrics=metrics):
        console.print(line, highlight=False, soft_wrap=True)
    console.print(f"timeline: {png}", highlight=False)


@app.command("export")
def export_command(
    plan_file: Annotated[str, typer.Option("--plan", help="Plan file from `search --out` (needs no other flag), or a bare plan JSON with --model and --hardware.")],
    to: Annotated[str, typer.Option("--to", help="torchtitan, megatron or deepspeed.")],
    engine: Annotated[Optional[str], typer.Option("--engine", help="Price the exported plan as this engine runs it (default: the --to target; ours, megatron, torchtitan or deepspeed).")] = None,
    model: MaybeModelOpt = None, hardware: MaybeHardwareOpt = None,
    gpus: Annotated[Optional[int], typer.Option("--gpus", help="Devices (default: the plan file's, or the plan's dp x cp x tp x pp).")] = None,
    gpus_per_node: GpusPerNodeOpt = None,
    global_batch: Annotated[Optional[int], typer.Option("--global-batch", help="Default: the plan file's, or the plan's.")] = None,
    seq_len: SeqLenOpt = None, precision: PrecisionOpt = None,
    out: Annotated[Optional[str], typer.Option("--out", help="Folder to write the files into (the config, the model where the target takes one, launch.sh).")] = None,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Write the config and launch script that run the same plan in torchtitan 0.3.0, Megatron-LM (main 0.20.0)
    or DeepSpeed 0.19.8, and the predicted step time and memory of the plan as that engine runs it.

    Each knob the target cannot express is one line (with what is exported instead); a plan the target would
    reject is refused, naming the closest plan it accepts.

    Examples:
      planner export --plan plan.json --to megatron
      planner export --plan plan.json --to torchtitan --out titan/
      planner export --plan plan.json --to deepspeed --format json
    """
    from pathlib import Path

    from planner.exports import describe_price, export_plan
    from planner.inputs import ProblemFlags, plan_and_problem

    with _BadInput():
        plan, problem, _ = plan_and_problem(plan_file, ProblemFlags(
            model=model, hardware=hardware, gpus=gpus, gpus_per_node=gpus_per_node, global_batch=global_batch,
            seq_len=seq_len, precision=precision))
        result, price = export_plan(plan, problem, target=to, engine=engine)
    if out:
        folder = Path(out)
        try:
            folder.mkdir(parents=True, exist_ok=True)
            for name, text in result.files.items():
                (folder / name).write_text(text)
            (folder / "launch.sh").chmod(0o755)
        except OSError as exc:
            err_console.print(f"error: cannot write {out}: {exc.strerror or exc}", markup=False, highlight=False)
            raise typer.Exit(2)
    engine = engine or result.target
    if fmt is OutputFormat.json:
        print_json({**result.to_dict(), "engine": engine, "estimate": price.to_dict()})
        return
    if not out:
        sys.stdout.write(result.files[result.main])
        if result.main != "launch.sh":
            sys.stdout.write("\n# --- launch.sh ---\n" + result.files["launch.sh"])
    report = [f"exported for {result.version}" + (f": {', '.join(sorted(result.files))} in {out}" if out else ""),
              f"as {engine} runs it: {result.expressed.describe()}: {describe_price(price)}"]
    report += [f"cannot express: {line}" for line in result.cannot_express]
    report += [f"note: {line}" for line in result.notes]
    for line in report:
        err_console.print(line, markup=False, highlight=False, soft_wrap=True)


@app.command("tune")
def tune_command(
    model: ModelOpt = "tiny",
    nproc: Annotated[Optional[int], typer.Option("--nproc", help="Local processes to profile and train on (default: " + NPROC_DEFAULT + ").")] = None,
    global_batch: GlobalBatchOpt = 8,
    seq_len: Annotated[int, typer.Option("--seq-len", help="Tokens per sequence.")] = 64,
    precision: PrecisionOpt = None,
    steps: Annotated[int, typer.Option("--steps", help="Steps to train the best plan.")] = 8,
    profile_file: Annotated[Optional[str], typer.Option("--profile", help="Use this profile instead of the cache.")] = None,
    refresh_profile: Annotated[bool, typer.Option("--refresh-profile", help="Measure the profile again.")] = False,
    calibrate: Annotated[bool, typer.Option("--calibrate/--no-calibrate",
                                            help="Fit a never-calibrated profile to a few timed plans first.")] = True,
    recalibrate: Annotated[bool, typer.Option("--recalibrate", help="Fit the profile to timed plans again.")] = False,
    host_check: Annotated[bool, typer.Option("--host-check/--no-host-check",
                                             help="Time the winner again beside calibration plans: the host's speed now against the calibration's.")] = True,
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Profile (or reuse the cached profile), calibrate it once, search, train the best plan, report measured
    against predicted.

    With no arguments: the tiny model on 2 local CPU processes.

    Examples:
      planner tune
      planner tune --nproc 4 --global-batch 16 --steps 10
      planner tune --profile calibrated.json --format json
    """
    from planner.tune import TuneSettings, report_lines, tune
    from runners.launch import RunFailed

    with _BadInput():
        settings = TuneSettings(model=model, nproc=nproc, global_batch=global_batch, seq_len=seq_len,
                                precision=precision, steps=steps, profile=profile_file, refresh_profile=refresh_profile,
                                calibrate=calibrate, recalibrate=recalibrate, host_check=host_check)
        bar, update = _stage_progress(fmt is OutputFormat.json)
        try:
            with bar:
                report = tune(settings, progress=update,
                              on_step=lambda r: update("train", r["step"] + 1, steps, f"loss {r['loss']:.4f}"))
        except RunFailed as exc:
            err_console.print(f"error: {exc}", markup=False, highlight=False)
            raise typer.Exit(1)
    if fmt is OutputFormat.json:
        print_json(report.to_dict())
        return
    for line in report_lines(report):
        console.print(line, highlight=False, soft_wrap=True)


cluster_app = typer.Typer(no_args_is_help=True, help="An emulated multi-node cluster (network namespaces + tc; needs root).")
app.add_typer(cluster_app, name="cluster")
PrefixOpt = Annotated[str, typer.Option("--prefix", help="Name prefix of the namespaces (several clusters can coexist).")]


@cluster_app.command("up")
def cluster_up(
    nodes: Annotated[int, typer.Option("--nodes", help="Emulated nodes (network namespaces).")] = 2,
    procs_per_node: Annotated[int, typer.Option("--procs-per-node", help="Processes torchrun starts per node.")] = 2,
    inter_node_bandwidth: Annotated[Optional[str], typer.Option("--inter-node-bandwidth", help="Per-node NIC rate, e.g. 1gbit (unshaped if omitted).")] = None,
    inter_node_latency: Annotated[Optional[str], typer.Option("--inter-node-latency", help="One-way delay, e.g. 1ms (needs sch_netem).")] = None,
    prefix: PrefixOpt = "planner",
    fmt: FormatOpt = OutputFormat.table,
) -> None:
    """Create the emulated cluster.

    Example: planner cluster up --nodes 2 --procs-per-node 2 --inter-node-bandwidth 1gbit --inter-node-latency 1ms
    """
    from runners.netns_cluster import up

    state = up(num_nodes=nodes, procs_per_node=procs_per_node, inter_node_bandwidth=inter_node_bandwidth,
               inter_node_latency=inter_node_latency, prefix=prefix)
    if fmt is OutputFormat.json:
        print_json(state.to_dict())
        return
    if state.inter_node_latency_s > 0 and not state.latency_emulated:
        err_console.print("warning: this kernel has no sch_netem; the inter-node latency is not emulated")
    console.print(f"cluster {prefix!r} up: {nodes} nodes x {procs_per_node} procs, node 0 at {state.address(0)}")


@cluster_app.command("down")
def cluster_down(prefix: PrefixOpt = "planner") -> None:
    """Remove every namespace, link and process of the emulated cluster (also after a crash).

    Example: planner cluster down
    """
    from runners.netns_cluster import check_prerequisites, down

    check_prerequisites()
    removed = down(prefix=prefix)
    console.print(f"removed {', '.join(removed)}" if removed else "nothing to remove")


@cluster_app.command("status")
def cluster_status(prefix: PrefixOpt = "planner", fmt: FormatOpt = OutputFormat.table) -> None:
    """Show the emulated cluster's nodes, addresses, shaping and processes.

    Example: planner cluster status --format json
    """
    from runners.netns_cluster import status

    info = status(prefix=prefix)
    if fmt is OutputFormat.json:
        print_json(info)
        return
    rate = info["inter_node_bandwidth_bits_per_s"]
    console.print(f"inter-node: {f'{rate / 1e9:g} Gbit/s' if rate else 'unshaped'}, latency "
                  f"{info['inter_node_latency_s'] * 1e3:g} ms{'' if info['latency_emulated'] else ' (not emulated)'}")
    table = Table()
    for col in ("node", "namespace", "address", "up", "processes"):
        table.add_column(col)
    for node in info["nodes"]:
        table.add_row(str(node["node"]), node["namespace"], node["address"], str(node["up"]), str(node["num_processes"]))
    console.print(table)


@cluster_app.command("exec", context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def cluster_exec(
    ctx: typer.Context,
    node: Annotated[int, typer.Option("--node", help="Node index to run in.")] = 0,
    prefix: PrefixOpt = "planner",
) -> None:
    """Run a command inside one node's namespace (with GLOO_SOCKET_IFNAME and MASTER_ADDR set).

    Example: planner cluster exec --node 1 -- python -c "import socket; print(socket.gethostname())"
    """
    import subprocess

    from runners.netns_cluster import exec_argv, load_state

    if not ctx.args:
        raise PlannerError("give the command after --, e.g. planner cluster exec --node 1 -- ip addr")
    raise typer.Exit(subprocess.call(exec_argv(load_state(prefix), node, ctx.args)))


PUBLISHED_DEFAULT = "@repo"


def _default_published_value(argv: list[str]) -> None:
    """`planner validate --published` with no CSV after it means the repo's set (click options cannot
    take an optional value): give it the sentinel value."""
    for i, arg in enumerate(argv):
        if arg == "--published" and (i + 1 == len(argv) or argv[i + 1].startswith("-")):
            argv.insert(i + 1, PUBLISHED_DEFAULT)
            return


def main() -> None:
    """Console-script entry: bad input is one line on stderr and exit code 2, never a traceback.

    Click's standalone mode already turns usage errors into one line and exit 2; errors raised by the
    library calls (PlannerError, ValueError) are caught here.
    """
    # typer >= 0.25 vendors click as typer._click; its exceptions are not re-exported publicly.
    try:
        from typer._click import exceptions as click_errors
    except ImportError:  # older typer on click
        from click import exceptions as click_errors

    _default_published_value(sys.argv)
    try:
        # Not standalone: click's own usage errors come back here and are printed as one line too
        # (standalone mode would draw a multi-line rich box).
        code = app(standalone_mode=False)
    except click_errors.NoArgsIsHelpError as exc:
        sys.stdout.write(exc.ctx.get_help() + "\n")
        sys.exit(2)
    except click_errors.UsageError as exc:
        where = f"{exc.ctx.command_path}: " if exc.ctx is not None else ""
        message = " ".join(exc.format_message().split())
        err_console.print(f"error: {where}{message} (see --help)", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    except click_errors.ClickException as exc:  # e.g. a file option that cannot be opened
        err_console.print(f"error: {' '.join(exc.format_message().split())}", markup=False, highlight=False,
                          soft_wrap=True)
        sys.exit(exc.exit_code)
    except typer.Abort:
        err_console.print("aborted", markup=False, highlight=False)
        sys.exit(130)
    except (PlannerError, ValueError) as exc:
        # soft_wrap: rich would otherwise break a long message at the console width (80 off a TTY).
        err_console.print(f"error: {exc}", markup=False, highlight=False, soft_wrap=True)
        sys.exit(2)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
