"""The GPU side of the cost model: the public validation set, engine-aware pricing, calibration from a
cluster's own runs, the memory headroom and the GPU mechanisms (waves, contention, runtime memory)."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import numpy as np
import pytest

from cost_models.compute import contended, gemm_efficiency
from cost_models.estimate import estimate
from cost_models.memory import CUDA_CONTEXT_BYTES, NCCL_BYTES_PER_COMMUNICATOR, layer_params_per_device
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


def test_megatron_fsdp_shards_its_fp32_main_gradients():
    """Megatron-FSDP (optim_grads_params) distributes its gradient buffer with the parameters
    (megatron_fsdp/param_and_grad_buffer.py, _init_each_parameter_group_buffers): 4 bytes per parameter over
    the 8 shards, where the distributed optimizer (params whole) keeps all 4."""
    model, cluster = PRESETS["llama3-8b"], Cluster(num_nodes=1, devices_per_node=8, hardware=HW["h100"])
    plan, job = Plan(dp=8, num_micro_batches=4, param_shard=8, grad_shard=8, optim_shard=8), Job(global_batch=32, seq_len=2048)
    fsdp = estimate(plan, model=model, cluster=cluster, job=job, engine="megatron").breakdown
    assert fsdp["grads_bytes"] == pytest.approx(4 * model.num_params() / 8, rel=1e-9)
    assert fsdp["optimizer_bytes"] == pytest.approx(12 * model.num_params() / 8, rel=1e-9)


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


def test_a_row_reduced_in_fp32_moves_twice_the_gradient_bytes(tmp_path):
    """Composer's FSDP 'DEFAULT' mixed precision reduces in fp32 (llm-foundry's H100 and A100 80GB tables),
    'PURE' in bf16: the reduce-scatter of ZeRO-3 on one 8-GPU node moves 7/8 x 2 more bytes per parameter,
    at the H100 preset's 370 GB/s NVLink bus bandwidth (the latency term is the same)."""
    path = tmp_path / "runs.csv"
    row = "llama3-8b,8,8,llm-foundry/composer-fsdp,1,1,8,1,8,2048,zero3,full,bf16,1.0,,"
    path.write_text(RUNS_HEADER.strip() + ",reduce_dtype\n" + row + "fp32\n" + row + "bf16\n")
    fp32, bf16 = load_published(path, hardware=HW["h100"], strict=True)[0]
    assert (fp32.plan.reduce_fp32, bf16.plan.reduce_fp32) == (True, False)
    comm = [estimate(r.plan, model=r.model, cluster=r.cluster, job=r.job, engine=r.priced_engine).breakdown["dp_comm_s"]
            for r in (fp32, bf16)]
    assert comm[0] - comm[1] == pytest.approx(7 / 8 * 2 * PRESETS["llama3-8b"].num_params() / 370e9, rel=1e-9)
    path.write_text(RUNS_HEADER.strip() + ",reduce_dtype\n" + row + "fp8\n")
    with pytest.raises(PlannerError, match="reduce_dtype 'fp8'"):
        load_published(path, hardware=HW["h100"], strict=True)


def test_llm_foundry_rows_reduce_in_the_dtype_their_fsdp_mode_names():
    import csv

    rows = [r for r in csv.DictReader(line for line in DEFAULT_CSV.read_text().splitlines() if not line.startswith("#"))
            if r["source_id"] == "llmfoundry_bench"]
    for r in rows:
        expected = "fp32" if "FSDP MP Mode='DEFAULT'" in r["notes"] else "bf16"
        assert r["reduce_dtype"] == expected, r["location_in_source"]
    assert {r["reduce_dtype"] for r in rows} == {"fp32", "bf16"}


def _optimizer_s_on_one_node(engine: str, hw, *, param_shard: int) -> float:
    """optimizer_s of llama3-8b under dp8 on one 8-GPU node, optimizer states sharded 8 ways."""
    model = PRESETS["llama3-8b"]
    plan = Plan(dp=8, micro_batch=1, num_micro_batches=1, recompute="full", param_shard=param_shard,
                grad_shard=param_shard, optim_shard=8)
    cluster, job = Cluster(num_nodes=1, devices_per_node=8, hardware=hw), Job(global_batch=8, seq_len=2048)
    return estimate(plan, model=model, cluster=cluster, job=job, engine=engine).breakdown["optimizer_s"]


def test_llm_foundry_steps_composer_adamw_in_unfused_passes():
    """Composer's DecoupledAdamW loops over the shards with nine unfused kernels (88 bytes per fp32
    element read + written) and FSDP's clip_grad_norm_ reads and scales every gradient (12): 100 bytes per
    parameter of the optimizer shard at 80% of the H100's 3.35 TB/s, where a fused Adam moves 28."""
    from cost_models.engines import ENGINES

    assert ENGINES["fsdp"].optimizer_bytes_per_param == 8 + 8 + 12 + 8 + 12 + 8 + 8 + 8 + 16 + 4 + 8
    assert ENGINES["megatron"].optimizer_bytes_per_param == 28
    optimizer_s = _optimizer_s_on_one_node("fsdp", HW["h100"], param_shard=8)
    assert optimizer_s == pytest.approx(PRESETS["llama3-8b"].num_params() / 8 * 100 / (3.35e12 * 0.8), rel=1e-9)


def test_llm_foundry_rows_pay_fsdp1s_passes_over_the_whole_unsharded_gradient():
    """FSDP1's post-backward hook works on each flat parameter's unsharded gradient every micro-batch: the
    split's backward writes it (2 + 2 bytes per parameter in bf16), the hook casts it to fp32 under
    Composer's DEFAULT mixed precision (2 + 4) and pre-divides it in place (4 + 4): 18 bytes per parameter
    of the whole layer, not of its 1/8 shard, at 80% of the H100's 3.35 TB/s; PURE (bf16 reduction) skips
    the cast: 8 bytes; one GPU (no reduction) only the concatenation: 4. Other engines pay none of it."""
    from cost_models.engines import ENGINES
    from cost_models.estimate import layer_costs, unsharded_grad_pass_bytes

    assert unsharded_grad_pass_bytes("bf16", reduce_bytes=4, dp=8) == 2 + 2 + 2 + 4 + 4 + 4
    assert unsharded_grad_pass_bytes("bf16", reduce_bytes=2, dp=8) == 2 + 2 + 2 + 2
    assert unsharded_grad_pass_bytes("bf16", reduce_bytes=2, dp=1) == 4
    model, hw = PRESETS["llama3-8b"], HW["h100"]
    cluster, job = Cluster(num_nodes=1, devices_per_node=8, hardware=hw), Job(global_batch=8, seq_len=2048)
    plan = Plan(dp=8, micro_batch=1, num_micro_batches=1, recompute="full", param_shard=8, grad_shard=8,
                optim_shard=8, reduce_fp32=True)
    without = dataclasses.replace(ENGINES["fsdp"], unsharded_grad_passes="")
    with_passes = layer_costs(plan, model=model, cluster=cluster, job=job, engine="fsdp")
    plain = layer_costs(plan, model=model, cluster=cluster, job=job, engine=without)
    extra_s = with_passes.time_s["full"] - plain.time_s["full"]
    assert extra_s == pytest.approx(18 * layer_params_per_device(model, tp=1) / (3.35e12 * 0.8), rel=1e-9)
    assert with_passes.forward_time_s == plain.forward_time_s  # backward-side work only
    assert {name: e.unsharded_grad_passes for name, e in ENGINES.items() if e.unsharded_grad_passes} == {
        "fsdp": "fsdp1", "torchtitan": "fsdp2"}


def test_torchtitan_copies_each_gradient_into_its_fp32_reduce_scatter_input():
    """FSDP2's foreach_reduce copies the per-parameter bf16 gradients into one fp32 reduce-scatter input (2 + 4
    bytes per parameter of the whole layer every micro-batch) and leaves the division to NCCL's average."""
    from cost_models.engines import ENGINES
    from cost_models.estimate import layer_costs, unsharded_grad_pass_bytes

    assert unsharded_grad_pass_bytes("bf16", reduce_bytes=4, dp=8, kind="fsdp2") == 2 + 4
    assert unsharded_grad_pass_bytes("bf16", reduce_bytes=4, dp=1, kind="fsdp2") == 0
    model, hw = PRESETS["llama3-8b"], HW["a100"]
    cluster, job = Cluster(num_nodes=1, devices_per_node=8, hardware=hw), Job(global_batch=8, seq_len=2048)
    plan = Plan(dp=8, micro_batch=1, num_micro_batches=1, recompute="full", param_shard=8, grad_shard=8, optim_shard=8)
    titan = ENGINES["torchtitan"]
    copied = layer_costs(plan, model=model, cluster=cluster, job=job, engine=titan)
    plain = layer_costs(plan, model=model, cluster=cluster, job=job,
                        engine=dataclasses.replace(titan, unsharded_grad_passes=""))
    assert copied.time_s["full"] - plain.time_s["full"] == pytest.approx(
        6 * layer_params_per_device(model, tp=1) / (2.039e12 * 0.8), rel=1e-9)


def test_llm_foundry_flash_path_pays_flash_attns_unpad_and_pad_passes():
    """llm-foundry's flash_attn_fn gathers q, k, v into unpadded rows and scatters the output back on every
    layer (flash_attn.bert_padding): with MHA in bf16, 3 x (2 + 2) + (2 + 2 + 2) = 18 bytes per token and
    hidden element forward, (2 + 2) + 3 x (2 + 2 + 2) = 22 backward, at 80% of the H100's 3.35 TB/s. Its
    Triton path (the flash1 rows) and the other engines' flash kernels pay none."""
    from cost_models.compute import layer_compute_times, unpadded_attention_bytes
    from cost_models.engines import ENGINES

    model, hw = PRESETS["gpt3-1.7b"], HW["h100"]
    assert model.kv_dim == model.hidden_size
    tokens_h = 4 * 2048 * model.hidden_size
    assert unpadded_attention_bytes(model, micro_batch=4, seq_len=2048, tp=1, precision="bf16") == (
        18 * tokens_h, 22 * tokens_h)
    dims = dict(micro_batch=4, seq_len=2048, tp=1, sequence_parallel=False, precision="bf16")
    fsdp = ENGINES["fsdp"]
    packed = layer_compute_times(model, hw, **dims, engine=fsdp)
    plain = layer_compute_times(model, hw, **dims, engine=dataclasses.replace(fsdp, unpadded_attention=False))
    assert packed.forward_s - plain.forward_s == pytest.approx(18 * tokens_h / (3.35e12 * 0.8), rel=1e-9)
    assert packed.backward_s - plain.backward_s == pytest.approx(22 * tokens_h / (3.35e12 * 0.8), rel=1e-9)
    triton = dataclasses.replace(fsdp, attention="flash1")
    assert layer_compute_times(model, hw, **dims, engine=triton) == layer_compute_times(
        model, hw, **dims, engine=dataclasses.replace(triton, unpadded_attention=False))
    assert [name for name, e in ENGINES.items() if e.unpadded_attention] == ["fsdp"]


def test_the_bloom_prequel_rows_carry_the_vocabulary_their_size_column_implies():
    """chronicles-prequel.md sizes its models as l (12 h^2 + 13 h) + v h + s h + 2 h: with the 250k BigScience
    vocabulary 72 x 14336 comes to the table's 181B and 96 x 12288 to its 177B (GPT-2's 50257: 178B, 175B)."""
    runs = [r for r in load_published()[0] if r.source_id == "bloom_tr11_prequel"]
    assert len(runs) == 21
    for run in runs:
        l, h, v = run.model.num_layers, run.model.hidden_size, run.model.vocab_size
        size_billion = (l * (12 * h**2 + 13 * h) + v * h + 2048 * h + 2 * h) / 1e9
        assert v == 250680
        assert round(size_billion) == {72: 181, 96: 177}[l]


def test_a_row_with_16_bit_gradients_keeps_no_fp32_main_gradients(tmp_path):
    """Megatron-DeepSpeed before its BF16 optimizer accumulated and all-reduced 16-bit gradients (the BLOOM
    prequel's 02-25 rows): 2 bytes per parameter held where the engine's default keeps 4 (ZeRO-1 does not
    shard them), and the step-end all-reduce over one 8-GPU node moves 2 x 7/8 x 2 bytes per parameter less
    at the H100 preset's 370 GB/s."""
    path = tmp_path / "runs.csv"
    row = "llama3-8b,8,8,deepspeed,1,1,8,1,8,2048,zero1,full,bf16,1.0,,"
    path.write_text(RUNS_HEADER.strip() + ",reduce_dtype\n" + row + "fp16\n" + row + "\n")
    half, default = load_published(path, hardware=HW["h100"], strict=True)[0]
    n = PRESETS["llama3-8b"].num_params()
    est = [estimate(r.plan, model=r.model, cluster=r.cluster, job=r.job, engine=r.priced_engine) for r in (half, default)]
    assert [e.breakdown["grads_bytes"] / n for e in est] == [2.0, 4.0]
    assert est[1].step_time_s - est[0].step_time_s == pytest.approx(2 * 7 / 8 * 2 * n / 370e9, rel=1e-6)


def test_this_engine_steps_adam_as_its_runner_does():
    """runners/sharding/adam.py: the 2-byte gradient copied to fp32 (6 bytes per element), lerp_ 12, mul_ 8,
    addcmul_ 12, sqrt 8, / 8, add_ 8, addcdiv_ 16, the compute-dtype slice refreshed (6): 84 bytes per
    parameter of the optimizer shard, at 80% of the A100's 2.039 TB/s."""
    from cost_models.engines import ENGINES

    assert ENGINES["ours"].optimizer_bytes_per_param == 84
    optimizer_s = _optimizer_s_on_one_node("ours", HW["a100"], param_shard=1)
    assert optimizer_s == pytest.approx(PRESETS["llama3-8b"].num_params() / 8 * 84 / (2.039e12 * 0.8), rel=1e-9)


def _llama405b_middle_rank_params(*, tp: int) -> float:
    """Parameters of a middle pipeline rank of Llama 3.1 405B on pp8 v8, by hand from Megatron's
    compute_weight_and_optimizer_memory terms: per layer 2h^2 + 2h kv (attention, GQA) + 3hf (SwiGLU) split
    over TP, 2h of RMSNorm weights replicated; 126 layers in 64 chunks with the first and last one layer short
    (account_for_embedding/loss_in_pipeline_split), so ranks 1-6 hold 8 chunks of 2 layers. Their 16 layers
    outweigh rank 0's 15 and the embedding (16032 x 16384 < one layer's 398M), and they peak."""
    h, kv, f = 16384, 8 * 128, 53248
    return 16 * ((2 * h * h + 2 * h * kv + 3 * h * f) / tp + 2 * h)


def test_a_megatron_rank_holds_6_plus_12_over_dp_cp_bytes_per_parameter():
    """Megatron-LM's report_theoretical_memory prices bf16 params, fp32 main gradients and the distributed
    optimizer's fp32 master and moments at 6 + 12 / N bytes per parameter of the most loaded shard; the
    optimizer shards over data parallel with context parallel (megatron/core/distributed/
    distributed_data_parallel.py: intra_dp_cp_group), N = dp x cp. Llama 3.1 405B, dp8 cp2 tp8 pp8 v8, its
    peak (middle) rank."""
    model, cluster = PRESETS["llama3-405b"], Cluster(num_nodes=128, devices_per_node=8, hardware=HW["h100"])
    plan = Plan(dp=8, cp=2, tp=8, pp=8, virtual_stages=8, schedule="interleaved-1f1b", num_micro_batches=64,
                sequence_parallel=True, grad_shard=16, optim_shard=16)
    b = estimate(plan, model=model, cluster=cluster, job=Job(global_batch=512, seq_len=8192), engine="megatron").breakdown
    n = _llama405b_middle_rank_params(tp=8)
    assert b["weights_bytes"] + b["grads_bytes"] + b["optimizer_bytes"] == pytest.approx((6 + 12 / 16) * n, rel=1e-9)


def test_megatron_bridges_fp8_recipe_holds_fp8_weights_and_a_bf16_gradient_buffer():
    """Megatron-Bridge's fp8 performance recipes (perf_recipes/_common.py, _perf_precision: fp8_param_gather
    from bf16_with_fp8_current_scaling_mixed, grad_reduce_in_fp32=False): fp8 weight + transpose 2 bytes,
    the whole 16-bit gradient buffer 2, and over dp x cp = 16 the fp32 master and moments 12 plus the fp32
    copy of the reduced gradient shard 4 (distrib_optimizer.py, _copy_model_grads_to_main_grads):
    (2 + 2 + 16 / 16) bytes per parameter of the peak rank, where the default Megatron run holds 3 + 4 + 12 / 16."""
    from cost_models.engines import ENGINES

    model, cluster = PRESETS["llama3-405b"], Cluster(num_nodes=128, devices_per_node=8, hardware=HW["h100"])
    plan = Plan(dp=8, cp=2, tp=8, pp=8, virtual_stages=8, schedule="interleaved-1f1b", num_micro_batches=64,
                sequence_parallel=True, grad_shard=16, optim_shard=16)
    job, n = Job(global_batch=512, seq_len=8192, precision="fp8"), _llama405b_middle_rank_params(tp=8)
    recipe = dataclasses.replace(ENGINES["megatron"], reduce_fp32=False, main_grads_fp32=False, fp8_param_gather=True)
    b = estimate(plan, model=model, cluster=cluster, job=job, engine=recipe).breakdown
    assert (b["weights_bytes"], b["grads_bytes"], b["optimizer_bytes"]) == pytest.approx((2 * n, 2 * n, n), rel=1e-9)
    d = estimate(plan, model=model, cluster=cluster, job=job, engine="megatron").breakdown
    assert (d["weights_bytes"], d["grads_bytes"], d["optimizer_bytes"]) == pytest.approx((3 * n, 4 * n, 0.75 * n), rel=1e-9)


def test_rows_of_recipes_with_fp8_weights_read_the_column_and_gather_one_byte(tmp_path):
    """The fp8_param_gather column turns the engine's fp8 weights on; the distributed optimizer's parameter
    all-gather then moves the 1-byte fp8 buffer, not the bf16 copy."""
    path = tmp_path / "runs.csv"
    row = "llama3-8b,8,8,megatron,1,1,8,1,8,2048,distributed-optimizer,full,fp8,1.0,,bf16,"
    path.write_text(RUNS_HEADER.strip() + ",reduce_dtype,fp8_param_gather\n" + row + "true\n" + row + "\n")
    fp8, bf16_copy = load_published(path, hardware=HW["h100"], strict=True)[0]
    assert (fp8.priced_engine.fp8_param_gather, bf16_copy.priced_engine.fp8_param_gather) == (True, False)
    est = [estimate(r.plan, model=r.model, cluster=r.cluster, job=r.job, engine=r.priced_engine) for r in (fp8, bf16_copy)]
    # One byte less per parameter (the embedding and head too: bf16 there, 2 bytes, with no fp8 cast).
    assert est[1].breakdown["weights_bytes"] - est[0].breakdown["weights_bytes"] == pytest.approx(
        PRESETS["llama3-8b"].num_params(), rel=1e-9)
    assert est[0].breakdown["weights_bytes"] == pytest.approx(
        2 * PRESETS["llama3-8b"].num_layers * layer_params_per_device(PRESETS["llama3-8b"], tp=1)
        + 2 * (PRESETS["llama3-8b"].num_params() - PRESETS["llama3-8b"].num_layers
               * layer_params_per_device(PRESETS["llama3-8b"], tp=1)), rel=1e-9)
    path.write_text(RUNS_HEADER.strip() + ",reduce_dtype,fp8_param_gather\n" + row + "yes\n")
    with pytest.raises(PlannerError, match="fp8_param_gather must be"):
        load_published(path, hardware=HW["h100"], strict=True)


def test_the_recipes_that_keep_fp8_weights_and_bf16_gradients_say_so():
    """Megatron-Bridge's perf recipes and Megatron-LM's examples/llama/train_llama3_8b_h100_fp8.sh
    (--grad-reduce-in-bf16 --fp8-param-gather) run every fp8 row of those two sources that way."""
    import csv

    from planner.published import PUBLISHED_DIR

    for name in ("dense_runs.csv", "long_context_runs.csv"):
        rows = list(csv.DictReader(line for line in (PUBLISHED_DIR / name).read_text().splitlines()
                                   if not line.startswith("#")))
        for r in rows:
            recipe = r["source_id"] in ("megatron_bridge_perf", "megatron_examples_llama") and r["precision"] == "fp8"
            assert (r["reduce_dtype"], r["fp8_param_gather"]) == (("bf16", "true") if recipe else (r["reduce_dtype"], "")), \
                r["location_in_source"]


def test_moe_rows_price_imbalance_only_where_the_source_says_dropless():
    moe_csv = Path(DEFAULT_CSV).with_name("moe_runs.csv")
    runs, _ = load_published(moe_csv)
    balancing = {r.model.load_balancing for r in runs if r.model.is_moe}
    # The zoo's dropless rows route with Qwen3's own balancing loss; NeMo's and Megatron-Bridge's forced
    # ones, and the zoo's table that does not say, are priced on random routing (its sampling spread only).
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


def test_megatron_bridge_moe_rows_run_their_release_branches_recipes():
    """Two Megatron-Bridge MoE rows as their release branches' recipes ran them (SOURCES.md): GPT-OSS-120B
    in 25.11 at micro-batch 1 with layernorm + moe_act recomputation (the printed MBS 4 without it would
    not fit an H100 in this memory model), Qwen3-30B-A3B in 26.02.01 with DeepEP and the EP overlap."""
    moe_csv = Path(DEFAULT_CSV).with_name("moe_runs.csv")
    runs = [r for r in load_published(moe_csv)[0] if r.source_id == "megatron_bridge_perf"]
    gpt_oss = [r for r in runs if r.model.name == "GPT-OSS-120B"]
    assert len(gpt_oss) == 2
    for run in gpt_oss:  # both containers' recipes: MBS 1, selective layernorm + moe_act
        assert run.plan.micro_batch == 1 and run.priced_engine.recompute_modules == ("layernorm", "moe_act")
        e = estimate(run.plan, model=run.model, cluster=run.cluster, job=run.job, engine=run.priced_engine)
        assert e.peak_memory_bytes <= run.cluster.hardware.memory_bytes, (run.label, e.peak_memory_bytes / 2**30)
    old = next(r for r in gpt_oss if r.plan.global_batch == 512)
    printed = dataclasses.replace(old.plan, micro_batch=4, num_micro_batches=8, recompute="none")
    e = estimate(printed, model=old.model, cluster=old.cluster, job=old.job, engine="megatron")
    assert e.peak_memory_bytes > old.cluster.hardware.memory_bytes
    qwen = {r.plan.virtual_stages: r for r in runs if r.model.name == "qwen3-30b-a3b" and r.plan.pp == 2}
    assert qwen[12].priced_engine.moe_dispatcher == "deepep" and qwen[12].priced_engine.moe_a2a_overlap
    assert qwen[24].moe_dispatcher == "" and qwen[24].moe_a2a_overlap is None  # 25.11: left as printed
