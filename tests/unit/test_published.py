"""The GPU side of the cost model: the public validation set, engine-aware pricing, calibration from a
cluster's own runs, the memory headroom and the GPU mechanisms (waves, contention, runtime memory)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models.compute import contended, gemm_efficiency
from cost_models.estimate import estimate
from cost_models.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_COMMUNICATOR
from planner.published import (DEFAULT_CSV, LOSO_SCALES, _scale_curves, fit_compute_scale, leave_one_source_out,
                               load_published, price)
from specs.cluster import Cluster
from specs.errors import PlannerError
from specs.hardware import PRESETS as HW
from specs.job import Job
from specs.model import PRESETS
from specs.plan import Plan

RUNS_HEADER = ("model,gpus_per_node,num_gpus,engine,tp,pp,dp,micro_batch,global_batch,seq_len,sharding,recompute,"
               "precision,step_time_s,peak_memory_gib\n")


def test_the_published_set_is_large_cited_and_from_independent_sources():
    runs, skipped = load_published()
    assert len(runs) >= 40
    sources = {r.source_id.split("_")[0] for r in runs}
    assert len(sources) >= 4, sources
    assert {"a100-80gb", "a100-40gb", "h100-sxm"} <= {r.hardware for r in runs}
    text = DEFAULT_CSV.read_text()
    assert "llm-foundry" in text and "github.com" in text  # every row carries its citation columns
    assert all(line.startswith("row ") for line in skipped)


def test_each_row_is_priced_as_its_engine_runs_it():
    runs, _ = load_published()
    engines = {r.engine for r in runs}
    assert {"megatron", "fsdp", "deepspeed", "torchtitan"} <= engines
    megatron = next(r for r in runs if r.engine == "megatron" and r.plan.tp > 1)
    # The same plan priced as this project's engine runs it: no TP overlap, eager kernels, another time.
    ours = estimate(megatron.plan, model=megatron.model, cluster=megatron.cluster, job=megatron.job, engine="ours")
    assert ours.step_time_s != pytest.approx(price(megatron), rel=1e-3)


def test_leave_one_source_out_fits_only_on_the_other_sources():
    runs, _ = load_published()
    runs = [r for r in runs if r.source_id in ("megatron_readme_h100", "nemo_perf_2407", "megatron_bridge_perf")]
    curves = _scale_curves(runs)
    assert curves.shape == (len(runs), len(LOSO_SCALES))
    # Slower compute, slower steps.
    assert np.all(np.diff(curves, axis=1) >= -1e-12)
    measured = np.array([r.measured_step_time_s for r in runs])
    # A fit to measurements that are the model's own at scale 1.2 finds 1.2.
    assert fit_compute_scale(curves, curves[:, LOSO_SCALES.index(1.2)]) == pytest.approx(1.2, rel=0.01)
    mean, per_source = leave_one_source_out(runs, curves)
    assert set(per_source) == {r.source_id for r in runs} and mean == pytest.approx(np.mean(list(per_source.values())))
    assert all(v >= 0 for v in per_source.values()) and measured.min() > 0


def _main(argv, monkeypatch, capsys):
    from planner.cli import main

    monkeypatch.setattr(sys, "argv", ["planner", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def test_validate_published_reports_the_agreement_as_json(monkeypatch, capsys, tmp_path):
    subset = tmp_path / "subset.csv"
    lines = DEFAULT_CSV.read_text().splitlines()
    header = next(i for i, line in enumerate(lines) if not line.startswith("#"))
    keep = [line for line in lines[header + 1:] if line.startswith(("megatron_readme_h100", "nemo_perf_2407"))]
    subset.write_text("\n".join([lines[header], *keep]) + "\n")
    code, out, _ = _main(["validate", "--published", str(subset), "--format", "json"], monkeypatch, capsys)
    assert code == 0
    report = json.loads(out)
    for key in ("num_rows", "mape", "kendall_tau", "regret", "loso_mape"):
        assert key in report
    assert report["num_rows"] == 16 and 0 <= report["mape"] < 1 and report["loso_mape"] is not None
    # `--published` alone prices the repo's set (the flag takes an optional CSV).
    code, out, _ = _main(["validate", "--published", "--no-loso", "--format", "json"], monkeypatch, capsys)
    assert code == 0 and json.loads(out)["num_rows"] >= 40


def _runs_csv(tmp_path, rows: list[str]) -> Path:
    path = tmp_path / "runs.csv"
    path.write_text(RUNS_HEADER + "".join(r + "\n" for r in rows))
    return path


def _synthetic_runs(scale: float) -> list[str]:
    """Runs of llama3-8b on 16 H100 whose 'measured' time is the model's own at compute_time_scale `scale`."""
    out = []
    for tp, mb, rc, zero in ((1, 1, "selective", "zero3"), (2, 1, "none", "zero1"), (4, 2, "none", "zero1"),
                             (1, 2, "full", "zero3"), (2, 2, "selective", "zero2")):
        dp = 16 // tp
        run_line = f"llama3-8b,8,16,megatron,{tp},1,{dp},{mb},{dp * mb * 4},4096,{zero},{rc},bf16,1.0,"
        out.append(run_line)
    return out


def test_calibrate_from_runs_recovers_the_compute_rate_and_writes_a_profile(tmp_path, monkeypatch, capsys):
    lines = _synthetic_runs(1.0)
    path = _runs_csv(tmp_path, lines)
    runs, _ = load_published(path, hardware=HW["h100"], strict=True)
    truth = {"compute_time_scale": 1.3}
    measured = [price(r, calibration=truth) for r in runs]
    lines = [line.replace(",1.0,", f",{t!r},") for line, t in zip(lines, measured)]
    path = _runs_csv(tmp_path, lines)
    out = tmp_path / "h100-ours.json"
    code, stdout, err = _main(["calibrate", "--from-runs", str(path), "--hardware", "h100", "--out", str(out),
                               "--parameters", "compute_time_scale", "--format", "json"], monkeypatch, capsys)
    assert code == 0, err
    result = json.loads(stdout)
    assert result["calibration"]["compute_time_scale"] == pytest.approx(1.3, rel=0.02)
    assert result["held_out_after"]["mape"] < 0.01 < result["held_out_before"]["mape"]
    profile = json.loads(out.read_text())
    assert profile["calibrated_from_runs"] == len(result["fit_labels"])


@pytest.mark.parametrize("row,message", [
    ("llama4-9000b,8,16,megatron,1,1,16,1,16,4096,zero1,none,bf16,1.0,", "unknown model"),
    ("llama3-8b,8,16,jax,1,1,16,1,16,4096,zero1,none,bf16,1.0,", "engine"),
    ("llama3-8b,8,16,megatron,3,1,16,1,16,4096,zero1,none,bf16,1.0,", "row 1"),
    ("llama3-8b,8,16,megatron,1,1,16,1,16,4096,zero1,none,bf16,-2,", "positive"),
])
def test_calibrate_from_runs_refuses_a_bad_row_in_one_line(tmp_path, monkeypatch, capsys, row, message):
    path = _runs_csv(tmp_path, [row])
    code, _, err = _main(["calibrate", "--from-runs", str(path), "--hardware", "h100", "--out",
                          str(tmp_path / "x.json")], monkeypatch, capsys)
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and message in lines[0], err
    assert not (tmp_path / "x.json").exists()


def test_calibrate_needs_one_source_of_measurements(monkeypatch, capsys):
    code, _, err = _main(["calibrate", "--hardware", "h100"], monkeypatch, capsys)
    assert code == 2 and "--measurements" in err and "--from-runs" in err


# --- memory ---------------------------------------------------------------------------------------------------
def test_every_gpu_plan_keeps_the_memory_headroom():
    model, cluster = PRESETS["llama3-8b"], Cluster(num_nodes=1, devices_per_node=8, hardware=HW["h100"])
    plan = Plan(dp=8, num_micro_batches=4, param_shard=8, grad_shard=8, optim_shard=8, recompute="full")
    default = estimate(plan, model=model, cluster=cluster, job=Job(global_batch=32, seq_len=4096))
    assert default.memory_limit_bytes == int(0.9 * HW["h100"].memory_bytes)
    loose = estimate(plan, model=model, cluster=cluster, job=Job(global_batch=32, seq_len=4096, memory_headroom=0.0))
    assert loose.memory_limit_bytes == HW["h100"].memory_bytes
    cpu = Cluster(num_nodes=1, devices_per_node=2, hardware=HW["cpu"])
    tiny = estimate(Plan(dp=2, num_micro_batches=1), model=PRESETS["tiny"], cluster=cpu,
                    job=Job(global_batch=2, seq_len=64, precision="fp32"))
    assert tiny.memory_limit_bytes == HW["cpu"].memory_bytes  # CPU hosts: the measured reserve covers it
    with pytest.raises(ValueError, match="headroom"):
        Job(global_batch=2, seq_len=64, memory_headroom=0.95)


def test_search_keeps_the_headroom(monkeypatch, capsys):
    code, out, _ = _main(["search", "--model", "llama3-8b", "--hardware", "h100", "--gpus", "8", "--global-batch", "32",
                          "--seq-len", "4096", "--memory-headroom", "0.2", "--top", "3", "--format", "json"],
                         monkeypatch, capsys)
    assert code == 0
    plans = json.loads(out)["plans"]
    assert plans and all(p["estimate"]["peak_memory_bytes"] <= 0.8 * HW["h100"].memory_bytes for p in plans)


def test_gpu_runtime_memory_counts_context_communicators_and_fragmentation():
    model, cluster = PRESETS["llama3-8b"], Cluster(num_nodes=2, devices_per_node=8, hardware=HW["h100"])
    job = Job(global_batch=16, seq_len=2048)
    dp_only = estimate(Plan(dp=16, num_micro_batches=1, param_shard=16, grad_shard=16, optim_shard=16),
                       model=model, cluster=cluster, job=job).breakdown
    tp_pp = estimate(Plan(dp=2, tp=4, pp=2, num_micro_batches=8, sequence_parallel=True),
                     model=model, cluster=cluster, job=job).breakdown
    transient = dp_only["activations_bytes"] + dp_only["buffers_bytes"]
    assert dp_only["framework_reserve_bytes"] == pytest.approx(
        CUDA_CONTEXT_BYTES + 2 * NCCL_BYTES_PER_COMMUNICATOR + 0.1 * transient)
    # Two more communicators (TP and PP) hold their own NCCL buffers.
    transient = tp_pp["activations_bytes"] + tp_pp["buffers_bytes"]
    assert tp_pp["framework_reserve_bytes"] == pytest.approx(
        CUDA_CONTEXT_BYTES + 4 * NCCL_BYTES_PER_COMMUNICATOR + 0.1 * transient)


def test_megatron_keeps_fp32_main_gradients():
    model, cluster = PRESETS["llama3-8b"], Cluster(num_nodes=1, devices_per_node=8, hardware=HW["h100"])
    plan, job = Plan(dp=8, num_micro_batches=4, grad_shard=8, optim_shard=8), Job(global_batch=32, seq_len=2048)
    megatron = estimate(plan, model=model, cluster=cluster, job=job, engine="megatron").breakdown
    ours = estimate(plan, model=model, cluster=cluster, job=job).breakdown
    assert megatron["grads_bytes"] == pytest.approx(4 * model.num_params(), rel=0.05)
    assert ours["grads_bytes"] < megatron["grads_bytes"] / 8


# --- GPU mechanisms -------------------------------------------------------------------------------------------
def test_compute_beside_a_collective_runs_on_the_sms_nccl_leaves():
    hw = HW["h100"]
    busy = contended(hw)
    assert busy.sms_held == hw.nccl_ctas
    # A GEMM of exactly one wave on the whole device needs two beside a collective: it nearly doubles.
    one_wave = dict(m=128 * 12, n=256 * 11, k=8192, dtype="bf16")
    assert gemm_efficiency(hw, **one_wave) / gemm_efficiency(busy, **one_wave) > 1.5
    # A long GEMM loses about the share of SMs taken.
    big = dict(m=65536, n=8192, k=8192, dtype="bf16")
    ratio = gemm_efficiency(hw, **big) / gemm_efficiency(busy, **big)
    assert ratio == pytest.approx(hw.num_sms / (hw.num_sms - busy.sms_held), rel=0.05)
    assert contended(HW["cpu"]) is HW["cpu"]


def test_sc21_engine_reduces_after_the_pipeline_and_megatron_beside_the_sends():
    """Megatron-LM of 2021 all-reduced gradients after the pipeline schedule returned; today's Megatron
    reduces on the DP group's own stream, which never holds a pipeline send: neither cascades the
    reduction down the pipeline the way one ordered stream would."""
    model = PRESETS["gpt3-145b"]
    cluster = Cluster(num_nodes=192, devices_per_node=8, hardware=HW["a100"])
    plan = Plan(dp=24, tp=8, pp=8, num_micro_batches=96, recompute="full")
    job = Job(global_batch=2304, seq_len=2048)
    ours = estimate(plan, model=model, cluster=cluster, job=job).breakdown["bubble_s"]
    for engine in ("megatron-sc21", "megatron"):
        theirs = estimate(plan, model=model, cluster=cluster, job=job, engine=engine).breakdown["bubble_s"]
        assert theirs < ours, engine


def test_a_plan_file_keeps_its_headroom():
    job = Job(global_batch=8, seq_len=64, memory_headroom=0.25)
    assert Job.from_dict(json.loads(json.dumps(job.to_dict()))) == job


def test_runs_csv_without_a_model_column_needs_the_shape(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text("engine,num_gpus,tp\nmegatron,8,1\n")
    with pytest.raises(PlannerError):
        load_published(path, hardware=HW["h100"], strict=True)
    path.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(PlannerError):
        load_published(path)


def test_h100_power_capped_rows_are_kept_out_with_a_reason():
    import csv

    lines = [line for line in DEFAULT_CSV.read_text().splitlines() if not line.startswith("#")]
    rows = list(csv.DictReader(lines))
    excluded = [r for r in rows if r["use"] != "yes"]
    assert excluded and all(r["exclusion_reason"].strip() for r in excluded)
    assert not any(r["use"] == "yes" and "500W" in r["notes"].replace(" ", "") and r["hardware"] == "h100-sxm"
                   for r in rows)


def test_long_context_rows_are_priced_with_their_context_parallel_layout():
    from planner.published import PUBLISHED_DIR

    runs, skipped = load_published(PUBLISHED_DIR / "long_context_runs.csv")
    with_cp = [r for r in runs if r.plan.cp > 1]
    assert with_cp and all(r.plan.world_size == r.cluster.num_devices for r in runs)
    # NeMo's Llama 3 70B row: TP4 PP4 CP2 on 64 GPUs, so DP2; the distributed optimizer shards over dp x cp.
    row = next(r for r in with_cp if r.model.name == "LLAMA3-70B")
    assert (row.plan.dp, row.plan.cp, row.plan.tp, row.plan.pp) == (2, 2, 4, 4)
    assert row.plan.optim_shard == 4 and row.plan.cp_kind == "ring"
    assert all(line.startswith("row ") for line in skipped)


def test_a_local_batch_source_multiplies_by_the_data_parallel_ranks():
    from planner.published import _batch

    row = {"source_id": "torchtitan_bench_h100_2412", "model_name": "Llama 3.1 405B", "global_batch": "",
           "micro_batch": ""}
    assert _batch(row, dp=4, pp=8) == (1, 32)  # local batch 8 per DP rank, in pipeline micro-batches of 1
    row = {**row, "model_name": "Llama 3.1 8B"}
    assert _batch(row, dp=2, pp=1) == (1, 2)


def test_an_unpriced_cp_comm_type_is_refused_in_one_line(tmp_path):
    path = tmp_path / "runs.csv"
    path.write_text(RUNS_HEADER.strip() + ",cp,cp_comm_type\n"
                    "llama3-8b,8,8,megatron,1,1,4,1,8,8192,,none,bf16,1.0,,2,allgather\n")
    with pytest.raises(PlannerError, match="cp_comm_type 'allgather'"):
        load_published(path, hardware=HW["h100"], strict=True)


@pytest.mark.parametrize("name", ["dense_runs.csv", "long_context_runs.csv"])
def test_every_published_run_that_states_its_recomputation_fits_the_memory_it_ran_in(name):
    """A run that ran fit its GPUs: the memory model (as its engine keeps activations: flash kernels keep
    no s x s tensor, fused kernels keep 16-bit norm inputs) must not say otherwise. Sources that do not
    state the recomputation are left out (their plan's recompute is a guess)."""
    import csv

    from planner.published import PUBLISHED_DIR

    path = PUBLISHED_DIR / name
    rows = list(csv.DictReader(line for line in path.read_text().splitlines() if not line.startswith("#")))
    unstated = {r["source_id"] for r in rows if not r["recompute"].strip()}
    runs = [r for r in load_published(path)[0] if r.source_id not in unstated]
    assert len(runs) >= 40
    for run in runs:
        e = estimate(run.plan, model=run.model, cluster=run.cluster, job=run.job, engine=run.priced_engine)
        assert e.peak_memory_bytes <= run.cluster.hardware.memory_bytes, (run.label, e.peak_memory_bytes / 2**30)


def test_megatron_core_flops_match_the_moe_zoo_step_time():
    from planner.published import megatron_core_flops_per_step

    qwen = PRESETS["qwen3-235b-a22b"]  # 94 layers, h 4096, 64 heads x 128, 4 KV heads, 8 of 128 experts x 1536
    L, h, q, s = 94, 4096, 64 * 128, 4096
    per_token = (12 * h * 1.5 * L * 8 * 1536 + 12 * L * h * q * (1 + 4 / 64) + 6 * L * s * q
                 + 6 * h * qwen.vocab_size)
    flops = megatron_core_flops_per_step(qwen, global_batch=2048, seq_len=s)
    assert flops == pytest.approx(2048 * s * per_token)
    # The Qwen3 zoo prints 19.7 s and 245 TFLOP/s per GPU on 256 H100s for this batch: the causal count
    # agrees within 1%, the full square (twice the 6 L s q term) would be 13% off.
    assert flops / (256 * 19.7) == pytest.approx(245e12, rel=0.01)


def test_moe_rows_are_priced_with_their_dispatcher_and_overlap():
    from planner.published import PUBLISHED_DIR, load_published

    runs, _ = load_published(PUBLISHED_DIR / "moe_runs.csv")
    zoo = [r for r in runs if r.source_id == "mcore_moe_modelzoo_qwen3"]
    overlap = [r for r in zoo if r.measured_step_time_s == 17.6 and r.plan.pp == 8]
    assert len(overlap) == 1 and overlap[0].priced_engine.moe_a2a_overlap
    assert overlap[0].priced_engine.moe_dispatcher == "deepep"
    assert all(r.source_id != "nemo_automodel_perf" for r in runs)  # use=no: its engine has no pricing


def test_moe_rows_price_imbalance_only_where_the_source_says_dropless():
    moe_csv = Path(DEFAULT_CSV).with_name("moe_runs.csv")
    runs, _ = load_published(moe_csv)
    balancing = {r.model.load_balancing for r in runs if r.model.is_moe}
    # The zoo's dropless rows route with Qwen3's own balancing loss; NeMo's and Megatron-Bridge's forced
    # ones, and the zoo's table that does not say, are priced exactly balanced.
    assert balancing == {"aux_loss", "forced"}
    pairs = {}
    for r in runs:
        if r.source_id == "mcore_moe_modelzoo_qwen3" and r.job.seq_len >= 16384:
            pairs.setdefault(r.job.seq_len, {})[r.model.load_balancing] = price(r)
    assert len(pairs) == 4
    for seq_len, pair in pairs.items():
        assert pair["aux_loss"] > pair["forced"], seq_len


def test_named_recompute_modules_reach_the_priced_engine():
    moe_csv = Path(DEFAULT_CSV).with_name("moe_runs.csv")
    runs, _ = load_published(moe_csv)
    modules = {r.recompute_modules for r in runs}
    # GPT-OSS's recipe (layernorm, moe_act), the zoo's "norm, act" shorthand for the same, and its
    # long-context command's layernorm moe; rows without a partial cell keep the engine's attention core.
    assert modules == {(), ("layernorm", "moe_act"), ("layernorm", "moe")}
    named = next(r for r in runs if r.recompute_modules == ("layernorm", "moe"))
    assert named.priced_engine.recompute_modules == ("layernorm", "moe") and named.plan.recompute == "selective"
