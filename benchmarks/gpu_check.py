"""Issue 11's one-GPU bring-up check: one command answers every question a first GPU run has to answer.

    bash benchmarks/gpu_check.sh                     # on a one-GPU machine (H200: about 6 minutes)
    bash benchmarks/gpu_check.sh --dry-run           # on CPU: the same steps at tiny sizes (the suite runs it)
    python benchmarks/gpu_check.py --verdicts gpu_check.json   # re-judge a summary written earlier

Steps (each recorded; a step that fails is recorded with its error and the others still run):
  env        torch, CUDA, the device, its count, NCCL
  profile    `planner profile --nproc 1 --model M`: compute, memory, host-device copies and the layer probe
             measured on the GPU, the links taken from its preset (and said so)
  gemm       torch's own large-GEMM rate (8192^3 bf16, CUDA events) against the profile's fitted bf16
             asymptote (target: within 10%)
  recompute  M in bf16 (the run default on a GPU, fp32 master weights) under none, selective and full
             recomputation, one process: measured median step time against the estimate from this GPU's
             profile (15%), torch.cuda.max_memory_allocated against the estimated tensor bytes (10%)
  fp16       M in fp16 with dynamic loss scaling: finite losses, at most a few skipped steps, the first
             loss (before any update) equal to the bf16 run's, training progresses
  exact      several ranks on the one GPU over gloo with CUDA tensors (NCCL refuses two ranks on one
             device), fp32 with TF32 off, the tiny model: ZeRO-3, MAZ3's host tier (pinned host memory,
             copies on a side stream), TP 2, PP 2 (host-staged point to point), ZeRO-3 and HSDP with the
             reducer chained on side streams, Lins (2,2,4); each run's losses against one process on the
             same GPU (1e-4)
  validate   `planner validate --nproc 1` and `planner calibrate` on CUDA
Writes the summary JSON (`--out`, default $OUT/gpu_check.json) and exits 0 only if every verdict passed.
In a dry run the verdicts are computed but only that every step ran is enforced (CPU timings on a
shared host say nothing about a GPU's).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# Targets (issue 11, "Done means").
LIMITS = {"step_time": 0.15, "memory": 0.10, "gemm": 0.10, "exact_loss": 1e-4, "fp16_first_loss": 0.05,
          "fp16_max_skipped": 3}
RECOMPUTE = ("none", "selective", "full")


@dataclass(frozen=True)
class Sizes:
    """What each step runs: the GPU's sizes, or the dry run's tiny ones (the same steps)."""

    model: str
    seq_len: int
    global_batch: int
    micro_batch: int
    steps: int
    exact_seq_len: int
    exact_steps: int
    gemm_dim: int
    profile_quick: bool
    probe_seconds: float | None  # the profile's layer probe per point (None: its default)
    validate_plans: int
    # Validate prices with the profile step's file (the dry run: on CPU the default would measure a second,
    # full profile) rather than this machine's default (on a GPU its preset: no second measurement).
    validate_on_profile: bool
    budget_s: float  # skip the remaining steps once this much time has gone
    step_timeout_s: float  # any one step


GPU = Sizes(model="llama3.2-1b", seq_len=2048, global_batch=8, micro_batch=4, steps=6, exact_seq_len=64,
            exact_steps=4, gemm_dim=8192, profile_quick=False, probe_seconds=None, validate_plans=3, validate_on_profile=False, budget_s=450,
            step_timeout_s=300)
DRY = Sizes(model="tiny", seq_len=32, global_batch=4, micro_batch=2, steps=3, exact_seq_len=32, exact_steps=3,
            gemm_dim=256, profile_quick=True, probe_seconds=0.3, validate_plans=2, validate_on_profile=True, budget_s=3600, step_timeout_s=1200)

# The exactness plans: (name, ranks, plan fields, RunConfig fields).
EXACT = (
    ("zero3", 2, {"dp": 2, "param_shard": 2, "grad_shard": 2, "optim_shard": 2, "micro_batch": 1,
                  "num_micro_batches": 2}, {}),
    ("maz3_host", 2, {"dp": 2, "param_shard": 2, "grad_shard": 2, "optim_shard": 2, "micro_batch": 1,
                      "num_micro_batches": 2, "param_cache": "host"}, {}),
    ("tp2", 2, {"tp": 2, "micro_batch": 2, "num_micro_batches": 1}, {}),
    ("pp2", 2, {"pp": 2, "micro_batch": 1, "num_micro_batches": 2}, {}),
    ("zero3_streams", 2, {"dp": 2, "param_shard": 2, "grad_shard": 2, "optim_shard": 2, "micro_batch": 1,
                          "num_micro_batches": 2}, {"stream_ordered": True}),
    ("lins_2_2_4", 4, {"dp": 4, "param_shard": 2, "grad_shard": 2, "optim_shard": 4, "micro_batch": 1,
                       "num_micro_batches": 1}, {"ranks_per_node": 2}),
    ("hsdp_streams", 4, {"dp": 4, "param_shard": 2, "grad_shard": 2, "optim_shard": 2, "micro_batch": 1,
                         "num_micro_batches": 1}, {"ranks_per_node": 2, "stream_ordered": True}),
)


class StepTimeout(Exception):
    pass


@contextlib.contextmanager
def deadline(seconds: float):
    """Raise StepTimeout in this (main) thread after `seconds`: a launch waiting on a hung worker is then
    stopped by its own cleanup (runners.launch kills the torchrun process group), and the check goes on."""
    def alarm(signum, frame):
        raise StepTimeout(f"step timed out after {seconds:.0f} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.alarm(int(seconds))
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


def log(message: str) -> None:
    print(f"[gpu_check {time.strftime('%H:%M:%S')}] {message}", flush=True)


def planner_cli(args: list[str]) -> str:
    """`planner ARGS` in a subprocess; its stdout. When the step's deadline interrupts the wait, the CLI gets
    SIGINT first, so that its launcher stops the torchrun process group it started (own session), then
    SIGKILL."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.Popen([sys.executable, "-m", "planner.cli", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
    try:
        stdout, stderr = proc.communicate()
    except BaseException:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        raise
    if proc.returncode != 0:
        raise RuntimeError(f"planner {args[0]} exited {proc.returncode}: {stderr.strip()[-600:]}")
    return stdout


# --- the steps: each returns a raw dict ----------------------------------------------------------------------
def step_env() -> dict:
    import torch
    import torch.distributed as dist

    cuda = torch.cuda.is_available()
    return {"torch": torch.__version__, "python": sys.version.split()[0], "cuda": cuda,
            "device": torch.cuda.get_device_name(0) if cuda else "cpu",
            "device_count": torch.cuda.device_count() if cuda else 0,
            "nccl": bool(cuda and dist.is_nccl_available()), "cpu_count": os.cpu_count()}


def step_profile(sizes: Sizes, out_dir: Path) -> dict:
    path = out_dir / "profile.json"
    start = time.perf_counter()
    args = ["profile", "--nproc", "1", "--model", sizes.model, "--out", str(path), "--format", "json"]
    args += ["--quick"] if sizes.profile_quick else []
    planner_cli(args + (["--probe-seconds", str(sizes.probe_seconds)] if sizes.probe_seconds else []))
    data = json.loads(path.read_text())
    dtype = "bf16" if "bf16" in data["peak_flops_per_s"] else "fp32"
    return {"path": str(path), "wall_s": time.perf_counter() - start, "device_name": data["device_name"],
            "gemm_dtype": dtype, "gemm_asymptote_flops_per_s": data["peak_flops_per_s"][dtype] * data["gemm_max_efficiency"],
            "links_from": data.get("links_from", ""), "calibration": data.get("calibration", {}),
            "memory_bandwidth_bytes_per_s": data["memory_bandwidth_bytes_per_s"],
            "host_device_bandwidth_bytes_per_s": data["host_device_bandwidth_bytes_per_s"]}


def step_gemm(sizes: Sizes, *, dtype_name: str) -> dict:
    """torch's own rate on one large square GEMM (3 warm-ups, 10 timed; CUDA events on a GPU)."""
    import torch

    cuda = torch.cuda.is_available()
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_name]
    device = "cuda" if cuda else "cpu"
    n = sizes.gemm_dim
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    for _ in range(3):
        torch.mm(a, b)
    repeats = 10
    if cuda:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(repeats):
            torch.mm(a, b)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / repeats
    else:
        begin = time.perf_counter()
        for _ in range(repeats):
            torch.mm(a, b)
        seconds = (time.perf_counter() - begin) / repeats
    return {"dim": n, "dtype": dtype_name, "torch_flops_per_s": 2 * n**3 / seconds}


def _launch(cfgs: list, *, nproc: int) -> list[dict]:
    """Train RunConfigs in turn in one set of `nproc` processes (runners.train's series mode)."""
    from runners.launch import Where, run_workers

    return run_workers("runners.train", {"runs": [c.to_dict() for c in cfgs]}, where=Where(nproc=nproc))["runs"]


def step_run(sizes: Sizes, out_dir: Path, *, hardware: str | None, recompute: str, precision: str | None) -> dict:
    """`planner run` of model M on one process (precision: the run's default unless given): its metrics,
    measured beside the estimate from `hardware` (this GPU's profile)."""
    path = out_dir / f"run_{recompute}_{precision or 'default'}.json"
    args = ["run", "--model", sizes.model, "--nproc", "1", "--global-batch", str(sizes.global_batch),
            "--seq-len", str(sizes.seq_len), "--micro-batch", str(sizes.micro_batch), "--recompute", recompute,
            "--steps", str(sizes.steps), "--metrics-out", str(path), "--format", "json"]
    args += (["--hardware", hardware] if hardware else []) + (["--precision", precision] if precision else [])
    planner_cli(args)
    metrics = json.loads(path.read_text())
    path.unlink()  # its numbers go into the summary; $OUT brings back only a few files
    return {"plan": f"mb{sizes.micro_batch} rc={recompute}", "metrics": metrics}


def _exact_config(sizes: Sizes, plan_fields: dict, run_fields: dict):
    import dataclasses

    from runners.config import RunConfig
    from specs.job import Job
    from specs.model import PRESETS
    from specs.plan import Plan

    plan = Plan(**plan_fields)
    return RunConfig(plan=plan, model=dataclasses.replace(PRESETS["tiny"]),
                     job=Job(global_batch=plan.global_batch, seq_len=sizes.exact_seq_len, precision="fp32"),
                     steps=sizes.exact_steps, seed=1234, lr=3e-3, timeout_s=120, allow_tf32=False, **run_fields)


def step_exact(sizes: Sizes, *, ranks: int, names: list[str]) -> dict[str, dict]:
    """The plans `names` (all on `ranks` processes) in one launch; each against one process on this device."""
    import torch

    from runners.reference import train_reference

    specs = {name: (plan, run) for name, r, plan, run in EXACT if name in names}
    cfgs = [_exact_config(sizes, *specs[name]) for name in names]
    runs = _launch(cfgs, nproc=ranks)
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    out = {}
    for name, cfg, metrics in zip(names, cfgs, runs):
        ref_losses, _ = train_reference(cfg, device=device)
        out[name] = {"plan": cfg.plan.describe(), "ranks": ranks, "losses": [s["loss"] for s in metrics["steps"]],
                     "reference_losses": ref_losses, "comm_bytes": metrics["summary"]["comm_bytes"],
                     "device": metrics["summary"]["device"]}
    return out


def step_validate(sizes: Sizes, out_dir: Path, *, hardware: str | None) -> dict:
    """`planner validate` of a few one-process plans of the tiny model with this machine's defaults (its
    GPU's preset, bf16, NCCL; `hardware` where given and `sizes.validate_on_profile`), then `planner
    calibrate` of compute_time_scale from its report."""
    report, calibrated = out_dir / "validate.json", out_dir / "calibrated.json"
    on_profile = ["--hardware", hardware] if hardware and sizes.validate_on_profile else []
    planner_cli(["validate", *on_profile, "--nproc", "1", "--top", "0", "--max-plans", str(sizes.validate_plans), "--steps", "3",
                 "--model", "tiny",
                 "--global-batch", "4", "--seq-len", "64", "--out", str(report), "--png", str(out_dir / "validate.png"),
                 "--format", "json"])
    data = json.loads(report.read_text())
    planner_cli(["calibrate", "--measurements", str(report), "--hardware", data["hardware"], "--out", str(calibrated),
                 "--parameters", "compute_time_scale", "--format", "json"])
    rows = [{"label": p["label"], "status": p["status"], "measured_step_time_s": p.get("measured_step_time_s"),
             "predicted_step_time_s": p.get("predicted_step_time_s")} for p in data["plans"]]
    return {"hardware": data["hardware"], "precision": data["precision"], "plans": rows,
            "calibration": json.loads(calibrated.read_text()).get("calibration", {})}


# --- verdicts: pure functions of the raw results (tests/unit/test_gpu_check.py) ---------------------------------
def relative_error(measured: float, predicted: float) -> float:
    return predicted / measured - 1.0


def judge_run(raw: dict) -> dict:
    """A recomputation run's numbers and verdicts from its metrics: measured median step time against the
    estimate, and peak tensor memory (max_memory_allocated on a GPU) against the estimate less the
    framework reserve the estimate adds for memory no tensor holds (on a GPU)."""
    metrics = raw["metrics"]
    summary, predicted = metrics["summary"], metrics.get("predicted") or {}
    out = {"plan": raw["plan"], "precision": summary.get("precision", ""),
           "measured_step_time_s": summary["median_step_time_s"], "measured_peak_bytes": summary["peak_memory_bytes"],
           "losses": [s["loss"] for s in metrics["steps"]]}
    if not predicted:
        return {**out, "ok": False, "why": "no prediction (the cost model could not price the plan)"}
    # On a GPU the run reports max_memory_allocated (tensors only); on CPU the anonymous memory, runtime included.
    gpu = summary.get("device", "cuda") == "cuda"
    reserve = predicted.get("breakdown", {}).get("framework_reserve_bytes", 0.0) if gpu else 0.0
    out.update(predicted_step_time_s=predicted["step_time_s"], predicted_tensor_bytes=predicted["peak_memory_bytes"] - reserve)
    out["step_time_error"] = relative_error(out["measured_step_time_s"], out["predicted_step_time_s"])
    out["memory_error"] = relative_error(out["measured_peak_bytes"], out["predicted_tensor_bytes"])
    out["ok"] = abs(out["step_time_error"]) <= LIMITS["step_time"] and abs(out["memory_error"]) <= LIMITS["memory"]
    return out


def judge_fp16(raw: dict, *, bf16_losses: list[float] | None) -> dict:
    summary = raw["metrics"]["summary"]
    losses = [s["loss"] for s in raw["metrics"]["steps"]]
    finite = all(l == l and abs(l) != float("inf") for l in losses)
    out = {"precision": summary.get("precision", ""), "losses": losses, "skipped_steps": summary.get("skipped_steps", 0),
           "loss_scale": summary.get("loss_scale", 1.0), "finite": finite}
    ok = finite and out["skipped_steps"] <= LIMITS["fp16_max_skipped"] and losses[-1] < losses[0]
    if bf16_losses:
        out["first_loss_vs_bf16"] = abs(losses[0] - bf16_losses[0])
        ok = ok and out["first_loss_vs_bf16"] <= LIMITS["fp16_first_loss"]
    return {**out, "ok": ok}


def judge_exact(raw: dict) -> dict:
    diff = max(abs(a - b) for a, b in zip(raw["losses"], raw["reference_losses"]))
    same_length = len(raw["losses"]) == len(raw["reference_losses"])
    return {**raw, "max_loss_diff": diff, "ok": same_length and diff <= LIMITS["exact_loss"]}


def judge_gemm(profile: dict, gemm: dict) -> dict:
    ratio = profile["gemm_asymptote_flops_per_s"] / gemm["torch_flops_per_s"]
    return {**gemm, "profile_flops_per_s": profile["gemm_asymptote_flops_per_s"], "ratio": ratio,
            "ok": abs(ratio - 1.0) <= LIMITS["gemm"]}


def verdicts(raw: dict, *, enforce: bool) -> dict:
    """The summary: every check with its numbers and `ok`; `passed` when every check ran and (`enforce`,
    on a GPU) every verdict holds. A step that failed or was skipped appears with its error."""
    checks: dict[str, dict] = {}
    errors = raw.get("errors", {})
    if "profile" in raw:
        checks["profile"] = {**raw["profile"], "ok": True}
        if "gemm" in raw:
            checks["gemm_vs_torch"] = judge_gemm(raw["profile"], raw["gemm"])
    for rc in RECOMPUTE:
        if f"run_{rc}" in raw:
            checks[f"bf16_recompute_{rc}"] = judge_run(raw[f"run_{rc}"])
    if "run_fp16" in raw:
        bf16 = checks.get("bf16_recompute_none", {}).get("losses")
        checks["fp16_loss_scaling"] = judge_fp16(raw["run_fp16"], bf16_losses=bf16)
    for name, result in raw.get("exact", {}).items():
        checks[f"exact_{name}"] = judge_exact(result)
    if "validate" in raw:
        plans = raw["validate"]["plans"]
        checks["validate_calibrate"] = {**raw["validate"], "ok": bool(plans) and all(p["status"] == "ok" for p in plans)}
    for name, error in errors.items():
        checks[name] = {"ok": False, "error": error}
    expected = expected_checks()
    missing = [name for name in expected if name not in checks]
    failed = sorted(name for name, c in checks.items() if not c["ok"])
    errored = sorted(errors)
    passed = not missing and not errored and (not enforce or not failed)
    return {"checks": checks, "missing": missing, "failed": failed, "errors": errored, "passed": passed,
            "verdicts_enforced": enforce, "limits": dict(LIMITS)}


def expected_checks() -> list[str]:
    return (["profile", "gemm_vs_torch"] + [f"bf16_recompute_{rc}" for rc in RECOMPUTE] + ["fp16_loss_scaling"]
            + [f"exact_{name}" for name, *_ in EXACT] + ["validate_calibrate"])


# --- the driver -------------------------------------------------------------------------------------------------
def run_all(sizes: Sizes, out_dir: Path) -> dict:
    """Every step in order, each guarded; returns the raw results and the errors by check name."""
    raw: dict = {"errors": {}}
    start = time.perf_counter()

    def guarded(name: str, check_names: list[str], fn):
        if time.perf_counter() - start > sizes.budget_s:
            for check in check_names:
                raw["errors"][check] = f"skipped: the {sizes.budget_s:.0f} s budget was spent"
            log(f"{name}: skipped (budget spent)")
            return None
        log(f"{name} ...")
        begin = time.perf_counter()
        try:
            with deadline(sizes.step_timeout_s):
                value = fn()
        except Exception as exc:  # recorded; the remaining steps still run
            message = f"{type(exc).__name__}: {str(exc).strip()[-800:]}"
            for check in check_names:
                raw["errors"][check] = message
            log(f"{name}: FAILED {message}\n{traceback.format_exc(limit=3)}")
            return None
        log(f"{name}: done in {time.perf_counter() - begin:.1f} s")
        return value

    raw["env"] = guarded("env", ["env"], step_env) or {}
    profile = guarded("profile", ["profile", "gemm_vs_torch"], lambda: step_profile(sizes, out_dir))
    hardware = None
    if profile is not None:
        raw["profile"], hardware = profile, profile["path"]
        gemm = guarded("gemm", ["gemm_vs_torch"], lambda: step_gemm(sizes, dtype_name=profile["gemm_dtype"]))
        if gemm is not None:
            raw["gemm"] = gemm
    for rc in RECOMPUTE:
        result = guarded(f"train {sizes.model} recompute {rc}", [f"bf16_recompute_{rc}"],
                         lambda rc=rc: step_run(sizes, out_dir, hardware=hardware, recompute=rc, precision=None))
        if result is not None:
            raw[f"run_{rc}"] = result
    result = guarded(f"train {sizes.model} fp16", ["fp16_loss_scaling"],
                     lambda: step_run(sizes, out_dir, hardware=hardware, recompute="none", precision="fp16"))
    if result is not None:
        raw["run_fp16"] = result
    raw["exact"] = {}
    groups: dict[int, list[str]] = {}
    for name, ranks, *_ in EXACT:
        groups.setdefault(ranks, []).append(name)
    for ranks, names in groups.items():
        result = guarded(f"exactness on {ranks} ranks ({', '.join(names)})", [f"exact_{n}" for n in names],
                         lambda ranks=ranks, names=names: step_exact(sizes, ranks=ranks, names=names))
        if result is not None:
            raw["exact"].update(result)
    result = guarded("validate + calibrate", ["validate_calibrate"], lambda: step_validate(sizes, out_dir, hardware=hardware))
    if result is not None:
        raw["validate"] = result
    raw["wall_s"] = time.perf_counter() - start
    return raw


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="the same steps at tiny sizes on CPU")
    parser.add_argument("--out", help="summary JSON (default: $OUT/gpu_check.json, else out/gpu_check/gpu_check.json)")
    parser.add_argument("--verdicts", metavar="SUMMARY", help="re-judge the raw results of an earlier summary")
    args = parser.parse_args(argv)
    if args.verdicts:
        data = json.loads(Path(args.verdicts).read_text())
        summary = verdicts(data["raw"], enforce=data["mode"] == "gpu")
        print(json.dumps({k: v for k, v in summary.items() if k != "checks"}, indent=1))
        return 0 if summary["passed"] else 1
    out = Path(args.out or Path(os.environ.get("OUT") or ROOT / "out" / "gpu_check") / "gpu_check.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    import torch

    if not args.dry_run and not torch.cuda.is_available():
        print("error: no CUDA device here; use --dry-run for the CPU rehearsal", file=sys.stderr)
        return 2
    sizes = DRY if args.dry_run else GPU
    raw = run_all(sizes, out.parent)
    summary = verdicts(raw, enforce=not args.dry_run)
    document = {"mode": "dry-run" if args.dry_run else "gpu", "sizes": asdict(sizes), "env": raw.get("env", {}),
                "wall_s": raw["wall_s"], **summary, "raw": raw}
    out.write_text(json.dumps(document, indent=1, default=float) + "\n")
    for name, check in summary["checks"].items():
        numbers = {k: v for k, v in check.items() if k.endswith(("error", "ratio", "diff")) and isinstance(v, float)}
        log(f"{'PASS' if check['ok'] else 'FAIL'} {name} " + " ".join(f"{k}={v:+.3g}" for k, v in numbers.items()))
    log(f"{'PASSED' if summary['passed'] else 'NOT PASSED'} in {raw['wall_s']:.0f} s; summary {out}")
    return 0 if summary["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
