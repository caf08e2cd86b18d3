"""The profile's fits recover known latency, bandwidth and GEMM-efficiency parameters from synthetic curves."""

import numpy as np
import pytest

from specs.errors import PlannerError
from profilers.fit import GemmSample, bus_factor, fit_gemm, fit_latency_bandwidth, predict_gemm_time_s


def test_bus_factor_follows_nccl_tests() -> None:
    assert bus_factor("all_reduce", 4) == pytest.approx(1.5)
    assert bus_factor("all_gather", 4) == pytest.approx(0.75)
    assert bus_factor("reduce_scatter", 2) == pytest.approx(0.5)
    assert bus_factor("all_to_all", 8) == pytest.approx(7 / 8)
    assert bus_factor("broadcast", 8) == 1.0 and bus_factor("p2p", 2) == 1.0
    assert bus_factor("ring_step", 4) == 1.0  # each rank's own message, whatever the ring's size
    with pytest.raises(ValueError):
        bus_factor("all_reduce", 1)


@pytest.mark.parametrize("latency_s,bandwidth", [(5e-5, 1.25e8), (1e-3, 1.25e8), (2e-6, 4.5e11), (0.0, 3e9)])
def test_linear_fit_recovers_latency_and_bandwidth_under_noise(latency_s: float, bandwidth: float) -> None:
    rng = np.random.default_rng(0)
    sizes = np.geomspace(1024, 256 * 2**20, 19)
    times = (latency_s + sizes / bandwidth) * rng.lognormal(0.0, 0.03, sizes.size)
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.bandwidth_bytes_per_s == pytest.approx(bandwidth, rel=0.05)
    assert fit.latency_s == pytest.approx(latency_s, rel=0.15, abs=5e-7)
    assert fit.rms_rel_error < 0.06


def test_linear_fit_keeps_the_rate_behind_a_token_bucket_burst() -> None:
    # A token bucket lets the first `burst` bytes through at line rate: time = (bytes - burst) / rate.
    sizes = np.geomspace(2**20, 64 * 2**20, 7)
    times = (sizes - 64 * 1024) / 1.25e8
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.latency_s == 0.0
    assert fit.bandwidth_bytes_per_s == pytest.approx(1.25e8, rel=1e-6)


def test_linear_fit_is_not_tilted_by_a_burst_hinge() -> None:
    # What a shaped link shows: a fixed cost, then nothing until the burst is spent, then the rate.
    sizes = np.array([1024 * 4**i for i in range(8)], dtype=float)  # 1 KiB .. 16 MiB, the --quick sweep
    times = 1.5e-4 + np.maximum(0.0, sizes - 250e3) / 1.25e8
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.bandwidth_bytes_per_s == pytest.approx(1.25e8, rel=0.02)
    # The smallest messages pay bytes / rate nowhere (inside the burst), so the latency reads a bit low.
    assert fit.latency_s == pytest.approx(1.5e-4, rel=0.2)


def test_linear_fit_reads_the_lower_envelope_not_a_slow_small_median() -> None:
    # The quick sweep of an all-to-all on a busy 2-core host: two of the three smallest sizes' medians
    # caught a descheduled rank. Latency ~0.17 ms, bandwidth ~1.1 GB/s underneath.
    sizes = np.array([1024 * 4**i for i in range(8)], dtype=float) / 2
    times = np.array([0.344, 2.36, 1.91, 0.171, 0.241, 0.457, 3.88, 8.1]) * 1e-3
    fit = fit_latency_bandwidth(sizes, times)
    assert fit.latency_s <= 0.2e-3  # not the 1.35 ms the two smallest medians average to
    clean = 1.7e-4 + sizes / 1.1e9
    assert fit_latency_bandwidth(sizes, clean).latency_s == pytest.approx(1.7e-4, rel=0.05)


def test_linear_fit_rejects_flat_or_tiny_curves() -> None:
    with pytest.raises(PlannerError, match="at least 2 points"):
        fit_latency_bandwidth([1024], [1e-3])
    with pytest.raises(PlannerError, match="do not grow"):
        fit_latency_bandwidth([1024, 2048, 4096], [3e-3, 2e-3, 1e-3])


def _synthetic_gemms(*, asymptotes: dict[str, float], half_dim: float, overhead_s: float,
                     noise: float) -> list[GemmSample]:
    rng = np.random.default_rng(1)
    shapes = [(d, d, d) for d in (16, 32, 64, 128, 256, 512, 1024, 2048)]
    shapes += [(128, 384, 128), (512, 128, 512), (2048, 64, 64), (64, 4096, 256), (1024, 1024, 32)]
    samples = []
    for dtype, asym in asymptotes.items():
        for m, n, k in shapes:
            rate = asym * np.prod([d / (d + half_dim) for d in (m, n, k)])
            t = max(overhead_s, 2 * m * n * k / rate) * rng.lognormal(0, noise)
            samples.append(GemmSample(m=m, n=n, k=k, dtype=dtype, time_s=t))
    return samples


def test_gemm_fit_recovers_efficiency_model() -> None:
    truth = {"fp32": 8e10, "bf16": 2e10}
    samples = _synthetic_gemms(asymptotes=truth, half_dim=48.0, overhead_s=2e-5, noise=0.02)
    fit = fit_gemm(samples)
    assert fit.gemm_half_dim == pytest.approx(48.0, rel=0.15)
    assert fit.kernel_overhead_s == pytest.approx(2e-5, rel=0.1)
    for dtype, asym in truth.items():
        assert fit.asymptote_flops_per_s[dtype] == pytest.approx(asym, rel=0.05)
    assert predict_gemm_time_s(fit, m=8, n=8, k=8, dtype="fp32") == pytest.approx(2e-5, rel=0.1)


def test_gemm_fit_without_floor_or_shape_penalty() -> None:
    samples = _synthetic_gemms(asymptotes={"fp32": 1e12}, half_dim=0.0, overhead_s=0.0, noise=0.0)
    fit = fit_gemm(samples)
    assert fit.gemm_half_dim < 1.0
    assert fit.asymptote_flops_per_s["fp32"] == pytest.approx(1e12, rel=0.02)


def test_group_shapes_cover_intra_inter_and_both() -> None:
    from profilers.comm import plan_groups

    shapes = {s.name: (s.link, s.ranks) for s in plan_groups(world_size=8, ranks_per_node=4, quick=False)}
    assert shapes == {"intra2": ("intra_node", (0, 1)), "intra4": ("intra_node", (0, 1, 2, 3)),
                      "inter2": ("inter_node", (0, 4)), "both8": ("inter_node", tuple(range(8)))}
    quick = [s.name for s in plan_groups(world_size=16, ranks_per_node=8, quick=True)]
    assert quick == ["intra2", "intra8", "inter2", "both16"]
    assert [s.name for s in plan_groups(world_size=2, ranks_per_node=2, quick=True)] == ["intra2"]
    with pytest.raises(ValueError):
        plan_groups(world_size=6, ranks_per_node=4, quick=False)


def test_efficiency_is_measured_against_the_datasheet_peak_when_known() -> None:
    from profilers.fit import GemmFit
    from profilers.profile import efficiency_fields

    fit = GemmFit(asymptote_flops_per_s={"bf16": 7e14, "fp32": 3.5e14}, gemm_half_dim=96, kernel_overhead_s=5e-6,
                  rms_log_error=0.0)
    peaks, efficiency = efficiency_fields(fit, datasheet_peak={"bf16": 989e12, "fp32": 494e12})
    assert efficiency == pytest.approx(7e14 / 989e12)
    assert peaks["bf16"] == 989e12 and peaks["fp32"] * efficiency == pytest.approx(3.5e14)
    peaks, efficiency = efficiency_fields(fit, datasheet_peak=None)
    assert efficiency == 1.0 and peaks == fit.asymptote_flops_per_s


def _probe_points(model, hardware, *, scale: float, op_overhead_s: float):
    """Layer-probe points as the cost model prices them at compute_time_scale `scale` and op_overhead_s."""
    import dataclasses

    from cost_models.compute import layer_compute_times
    from cost_models.estimate import BACKWARD_OPS_PER_FORWARD_OP, num_ops
    from specs.hardware import LayerProbePoint
    from runners.probe import probe_shapes

    hw = dataclasses.replace(hardware, calibration={"compute_time_scale": scale})
    n = num_ops(model)["layer"]
    points = []
    for b, s in probe_shapes(model):
        t = layer_compute_times(model, hw, micro_batch=b, seq_len=s, tp=1, sequence_parallel=False, precision="fp32")
        forward = t.forward_s + n * op_overhead_s
        points.append(LayerProbePoint(micro_batch=b, seq_len=s, dtype="float32", forward_s=forward,
                                      forward_backward_s=forward + t.backward_s + BACKWARD_OPS_PER_FORWARD_OP * n * op_overhead_s))
    return points


@pytest.mark.parametrize("model_name", ["tiny", "gpt3-1.7b"])
@pytest.mark.parametrize("scale,op_overhead_s", [(1.0, 0.0), (2.5, 2e-5), (6.0, 1e-4), (0.8, 5e-6)])
def test_layer_probe_fit_recovers_the_scale_and_the_op_overhead(model_name, scale, op_overhead_s) -> None:
    from specs.model import resolve_model
    from specs.hardware import PRESETS
    from planner.profiling import fit_overheads

    model, hw = resolve_model(model_name), PRESETS["cpu"]
    fit = fit_overheads(model, hw, _probe_points(model, hw, scale=scale, op_overhead_s=op_overhead_s))
    assert fit["compute_time_scale"] == pytest.approx(scale, rel=0.02)
    assert fit["op_overhead_s"] == pytest.approx(op_overhead_s, rel=0.05, abs=2e-7)


def test_the_full_recomputation_point_gives_the_checkpoint_overhead() -> None:
    import dataclasses

    from specs.model import resolve_model
    from specs.hardware import PRESETS
    from planner.profiling import fit_overheads

    model, hw = resolve_model("tiny"), PRESETS["cpu"]
    points = _probe_points(model, hw, scale=2.0, op_overhead_s=1e-5)
    middle = points[1]
    # Full recomputation: the plain forward+backward, the forward again, and 0.3 ms of checkpointing.
    full = dataclasses.replace(middle, recompute="full",
                               forward_backward_s=middle.forward_backward_s + middle.forward_s + 3e-4)
    fit = fit_overheads(model, hw, points + [full])
    assert fit["recompute_overhead_s"] == pytest.approx(3e-4, rel=1e-9)
    assert fit["compute_time_scale"] == pytest.approx(2.0, rel=0.02)  # the full point stays out of this fit
    assert "recompute_overhead_s" not in fit_overheads(model, hw, points)


def test_the_selective_point_gives_the_attention_cores_own_checkpoint_overhead() -> None:
    import dataclasses

    from cost_models.compute import layer_compute_times
    from cost_models.estimate import num_ops
    from specs.model import resolve_model
    from specs.hardware import PRESETS, with_calibration
    from planner.profiling import fit_overheads

    model, hw = resolve_model("tiny"), PRESETS["cpu"]
    points = _probe_points(model, hw, scale=2.0, op_overhead_s=1e-5)
    middle = points[1]
    core = layer_compute_times(model, with_calibration(hw, {"compute_time_scale": 2.0}), micro_batch=middle.micro_batch,
                               seq_len=middle.seq_len, tp=1, sequence_parallel=False,
                               precision="fp32").attention_core_forward_s
    core += num_ops(model)["core"] * 1e-5
    full = dataclasses.replace(middle, recompute="full",
                               forward_backward_s=middle.forward_backward_s + middle.forward_s + 3e-4)
    # Selective: the plain forward+backward, the core's forward again, and 0.1 ms of checkpointing.
    selective = dataclasses.replace(middle, recompute="selective",
                                    forward_backward_s=middle.forward_backward_s + core + 1e-4)
    fit = fit_overheads(model, hw, points + [full, selective])
    assert fit["recompute_overhead_s"] == pytest.approx(3e-4, rel=1e-9)
    assert fit["selective_recompute_overhead_s"] == pytest.approx(1e-4, rel=0.03)
    assert fit["compute_time_scale"] == pytest.approx(2.0, rel=0.02)


def test_selective_recomputation_is_priced_at_its_own_checkpoint_overhead() -> None:
    from cost_models.estimate import estimate
    from specs.cluster import make_cluster
    from specs.hardware import PRESETS, with_calibration
    from specs.job import Job
    from specs.model import resolve_model
    from specs.plan import Plan

    model, job = resolve_model("tiny"), Job(global_batch=8, seq_len=64)
    plan = Plan(dp=1, micro_batch=1, num_micro_batches=8, recompute="selective")

    def step_s(calibration: dict) -> float:
        cluster = make_cluster(hardware=with_calibration(PRESETS["cpu"], calibration), num_devices=1, devices_per_node=1)
        return estimate(plan, model=model, cluster=cluster, job=job).step_time_s

    old = step_s({"recompute_overhead_s": 3e-3})  # a profile before version 3: one price for both regions
    new = step_s({"recompute_overhead_s": 3e-3, "selective_recompute_overhead_s": 1e-3})
    # 8 layers x 8 micro-batches x (3 - 1) ms
    assert old - new == pytest.approx(8 * 8 * 2e-3, rel=1e-6)


def test_probes_calibrate_a_cpu_profile_and_a_cuda_one_without_the_per_op_term() -> None:
    import dataclasses

    from specs.model import resolve_model
    from specs.hardware import PRESETS
    from planner.profiling import with_layer_probe

    model = resolve_model("tiny")
    points = tuple(_probe_points(model, PRESETS["cpu"], scale=3.0, op_overhead_s=3e-5))
    overlap = {"compute_s": 1.0, "comm_s": 0.5, "both_s": 1.7, "efficiency": -0.4}
    cpu = with_layer_probe(dataclasses.replace(PRESETS["cpu"], layer_probe=points, overlap_probe=overlap), model=model)
    assert cpu.calibration["compute_time_scale"] == pytest.approx(3.0, rel=0.02)
    assert cpu.calibration["op_overhead_s"] == pytest.approx(3e-5, rel=0.05)
    assert cpu.calibration["comm_overlap_efficiency"] == -0.4
    assert len(cpu.layer_probe) == len(points) and cpu.overlap_probe == overlap
    # On CUDA the kernel queue hides dispatch: o stays 0 and c alone absorbs the layer's measured time.
    gpu = with_layer_probe(dataclasses.replace(PRESETS["h100"], layer_probe=points, overlap_probe=overlap), model=model)
    assert gpu.calibration["op_overhead_s"] == 0.0 and gpu.calibration["compute_time_scale"] > 0
    assert gpu.calibration["comm_overlap_efficiency"] == -0.4 and len(gpu.layer_probe) == len(points)


def test_the_sharding_probe_sets_the_bookkeeping_keys_on_a_cpu_profile_only() -> None:
    import dataclasses

    from specs.model import resolve_model
    from specs.hardware import PRESETS
    from planner.profiling import with_layer_probe

    model = resolve_model("tiny")
    sharding = {"step_s": 0.03, "units": 7.0, "micro_batches": 4.0, "grad_unit_s": 1.5e-4, "param_unit_s": 4e-4}
    cpu = with_layer_probe(dataclasses.replace(PRESETS["cpu"], sharding_probe=sharding), model=model)
    assert cpu.calibration["shard_grad_unit_s"] == 1.5e-4 and cpu.calibration["shard_param_unit_s"] == 4e-4
    assert cpu.sharding_probe == sharding
    # A GPU's kernel queue hides the host's bookkeeping (cost_models/estimate.sharding_bookkeeping_s).
    gpu = with_layer_probe(dataclasses.replace(PRESETS["h100"], sharding_probe=sharding), model=model)
    assert "shard_grad_unit_s" not in gpu.calibration and "shard_param_unit_s" not in gpu.calibration


def test_the_context_probe_sets_each_measured_kind_and_sizes_scale_on_a_cpu_profile_only() -> None:
    """engine_{kind}_extra_s_{c}: the probe's exchanges less cost_models/context.py's price of the same
    attention's (an earlier extra in the profile does not enter it), per message of the layer."""
    import dataclasses

    from cost_models.context import context_comm
    from cost_models.estimate import collective_time_s
    from planner.profiling import with_layer_probe
    from specs.cluster import make_cluster
    from specs.hardware import PRESETS
    from specs.job import Job
    from specs.model import resolve_model
    from specs.plan import Plan

    model, cpu = resolve_model("tiny"), PRESETS["cpu"]
    cluster = make_cluster(hardware=cpu, num_devices=4, devices_per_node=4)
    job = Job(global_batch=4, seq_len=64, precision="fp32")  # the probe runs fp32 on CPU

    def priced(c: int, kind: str) -> float:
        ctx = context_comm(Plan(dp=4 // c, cp=c, cp_kind=kind), cluster, model=model, job=job, core_forward_s=0.0,
                           core_backward_s=0.0, collective_time_s=collective_time_s)
        return ctx.a2a_forward_s + ctx.a2a_backward_s + sum(m for m, _ in ctx.ring_forward + ctx.ring_backward)

    context = {"seq_len": 64.0, "world": 4.0, "ring2_comm_s": priced(2, "ring") + 4e-3, "ring4_comm_s": 0.0,
               "a2a4_comm_s": priced(4, "all-to-all") + 8e-3, "ring2_local_s": 1e-3}
    stale = dataclasses.replace(cpu, calibration={**cpu.calibration, "engine_ring_extra_s_2": 5.0})
    fitted = with_layer_probe(dataclasses.replace(stale, context_probe=context), model=model).calibration
    assert fitted["engine_ring_extra_s_2"] == pytest.approx(1e-3)  # 4 messages: 1 forward, 1 + 2 backward
    assert fitted["engine_ring_extra_s_4"] == pytest.approx(-priced(4, "ring") / 10)
    assert "engine_a2a_extra_s_2" not in fitted
    assert fitted["engine_a2a_extra_s_4"] == pytest.approx(1e-3)
    gpu = with_layer_probe(dataclasses.replace(PRESETS["h100"], context_probe=context), model=model)
    assert not any(key.startswith("engine_") for key in gpu.calibration)



def test_the_sync_wait_probe_becomes_calibration_keys_on_a_cpu_profile_only() -> None:
    """sync{c}_{us}_s -> sync_wait_s_{c}_{us}, taken as measured; the context probe's all-to-all extras are
    counted beside what the estimate adds for the attention's own waits at the probe's shape."""
    import dataclasses

    from cost_models.comm import sync_waits_s
    from cost_models.compute import FUSED_BACKWARD_RATIO
    from cost_models.context import context_comm
    from cost_models.estimate import collective_time_s
    from planner.profiling import with_layer_probe
    from specs.cluster import make_cluster
    from specs.hardware import PRESETS
    from specs.job import Job
    from specs.model import resolve_model
    from specs.plan import Plan

    model, cpu = resolve_model("tiny"), PRESETS["cpu"]
    sync = {"world": 4.0, "sync2_500_s": 1e-4, "sync2_32000_s": 2e-3, "sync4_500_s": 2e-4, "sync4_32000_s": 9e-3}
    keys = {"sync_wait_s_2_500": 1e-4, "sync_wait_s_2_32000": 2e-3, "sync_wait_s_4_500": 2e-4,
            "sync_wait_s_4_32000": 9e-3}
    cluster = make_cluster(hardware=cpu, num_devices=4, devices_per_node=4)
    ctx = context_comm(Plan(cp=4, cp_kind="all-to-all"), cluster, model=model,
                       job=Job(global_batch=4, seq_len=64, precision="fp32"), core_forward_s=0.0,
                       core_backward_s=0.0, collective_time_s=collective_time_s)
    local = 35e-3  # an attention long enough to wait: 10 ms forward, 25 backward
    waits = sync_waits_s(keys, group_size=4, syncs=2, forward_s=local / (1 + FUSED_BACKWARD_RATIO),
                         backward_s=local * FUSED_BACKWARD_RATIO / (1 + FUSED_BACKWARD_RATIO))
    assert sum(waits) > 0
    context = {"seq_len": 64.0, "world": 4.0, "a2a4_local_s": local,
               "a2a4_comm_s": ctx.a2a_forward_s + ctx.a2a_backward_s + sum(waits) + 8e-3}
    fitted = with_layer_probe(dataclasses.replace(cpu, sync_probe=sync, context_probe=context), model=model)
    assert {k: v for k, v in fitted.calibration.items() if k.startswith("sync_wait_s_")} == keys
    assert fitted.calibration["engine_a2a_extra_s_4"] == pytest.approx(1e-3)
    gpu = with_layer_probe(dataclasses.replace(PRESETS["h100"], sync_probe=sync), model=model)
    assert not any(key.startswith("sync_wait_s_") for key in gpu.calibration)

def test_intra_node_shapes_are_measured_on_every_copy_at_once() -> None:
    from profilers.comm import GroupShape, copies, plan_groups

    shapes = {s.name: s for s in plan_groups(world_size=8, ranks_per_node=4, quick=False)}
    # Every node's (and every in-node) block of consecutive ranks runs the collective together ...
    assert copies(shapes["intra2"], 8) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert copies(shapes["intra4"], 8) == [(0, 1, 2, 3), (4, 5, 6, 7)]
    # ... while a group across nodes is measured alone: its curve is the link's own speed.
    assert copies(shapes["inter2"], 8) == [(0, 4)]
    assert copies(shapes["both8"], 8) == [tuple(range(8))]
    assert copies(GroupShape("odd", "intra_node", (1, 2)), 8) == [(1, 2)]


def test_an_aborted_probe_rank_is_measured_again_once(monkeypatch):
    """A probe rank killed by SIGABRT (a rare gloo abort, profilers.profile.PROBE_ATTEMPTS) reruns the probe
    once; any other failure, or a second abort, is reported as it is."""
    import profilers.profile as profile
    from runners.launch import RunFailed

    result = {"points": [], "overlap": {"efficiency": 0.5}}
    abort = RunFailed("rank 1 failed (killed by signal 6)")
    options = profile.ProfileOptions(quick=True, nproc=2)

    def workers(*outcomes):
        """A run_workers that raises or returns each outcome in turn, recording its calls."""
        calls = []

        def run(module, spec, *, where, on_event=None):
            calls.append(module)
            outcome = outcomes[len(calls) - 1]
            if isinstance(outcome, Exception):
                raise outcome
            return outcome

        return run, calls

    run, calls = workers(abort, result)
    monkeypatch.setattr(profile, "run_workers", run)
    assert profile.run_layer_probe(options) == {"layer_probe": (), "ring_points": (), "attention_points": (),
                                                "overlap_probe": {"efficiency": 0.5}, "sharding_probe": {},
                                                "context_probe": {}, "sync_probe": {}}
    assert calls == ["runners.probe", "runners.probe"]

    run, calls = workers(RunFailed("rank 0 failed (exit code 1)"))
    monkeypatch.setattr(profile, "run_workers", run)
    with pytest.raises(RunFailed, match="exit code 1"):
        profile.run_layer_probe(options)
    assert len(calls) == 1

    run, calls = workers(*[abort] * profile.PROBE_ATTEMPTS)
    monkeypatch.setattr(profile, "run_workers", run)
    with pytest.raises(RunFailed, match="signal 6"):
        profile.run_layer_probe(options)
    assert len(calls) == profile.PROBE_ATTEMPTS


def test_a_point_is_timed_as_the_op_after_compute_less_the_compute_alone(tmp_path, monkeypatch) -> None:
    """profilers.comm.measure_point on one gloo rank, on a clock that only the op and a stall move: an op of
    2 ms comes out at 2 ms a call in every round, although the first matmul-only loop stalled 5 ms (the
    matmuls' time is their fastest loop); one value per round, and the number of calls timed."""
    import types

    import torch
    import torch.distributed as dist

    import profilers.comm as comm

    clock = types.SimpleNamespace(now=0.0, reads=0)

    def perf_counter() -> float:
        clock.reads += 1
        if clock.reads == 4:  # the end of the first matmul-only loop (after the warm-up's 2 reads)
            clock.now += 5e-3
        return clock.now

    calls = []

    def op() -> None:
        calls.append(1)
        clock.now += 2e-3

    monkeypatch.setattr(comm, "time", types.SimpleNamespace(perf_counter=perf_counter))
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        times, timed = comm.measure_point(op, group=None, device=torch.device("cpu"), budget_s=1.0, max_repeats=12)
    finally:
        dist.destroy_process_group()
    assert timed == len(calls) - 2 == 12  # capped by max_repeats; the 2 warm-up calls are not timed
    assert times == pytest.approx([2e-3] * comm.ROUNDS)


def test_the_attention_probe_takes_seven_rounds_at_the_default_budgets_and_three_for_a_short_one(monkeypatch):
    """profilers/profile.attention_rounds: 7 at the default --probe-seconds (1.5 quick, 4 full), 3 at the tests'
    0.3 s, and the spec the probe worker receives carries them with the attention ladder and the sync-wait
    probe's share of its length (profilers/profile.budget_share)."""
    import profilers.profile as profile

    assert [profile.attention_rounds(b) for b in (4.0, 1.5, 0.75, 0.3, 0.01)] == [7, 7, 4, 3, 3]
    specs = []

    def run(module, spec, *, where, on_event=None):
        specs.append(spec)
        return {"points": [], "overlap": {}}

    monkeypatch.setattr(profile, "run_workers", run)
    for seconds in (None, 0.3):
        profile.run_layer_probe(profile.ProfileOptions(quick=True, nproc=2, probe_seconds=seconds))
    assert [s["attention_rounds"] for s in specs] == [7, 3]
    assert [s["sync_share"] for s in specs] == [1.0, pytest.approx(0.2)]  # the sync-wait probe's length
    assert specs[0]["attention_seq_lens"] == list(profile.ATTENTION_SEQ_LENS)
    assert specs[0]["attention_head_dims"] == [8, 64]  # the tiny model's head width, and 64


def test_the_quick_attention_ladder_reaches_the_models_length_up_to_the_full_ladders():
    """profilers/profile.attention_seq_lens: a long-context model's quick profile times its attention at its own
    length (4096 for the CP benchmark's model) instead of extrapolating past 2048; the tiny model's quick ladder
    and every full ladder are unchanged."""
    import dataclasses

    import profilers.profile as profile
    from specs.model import PRESETS

    def lens(max_seq_len, quick=True):
        return profile.attention_seq_lens(dataclasses.replace(PRESETS["tiny"], max_seq_len=max_seq_len), quick=quick)

    assert lens(128) == lens(2048) == lens(3000) == (64, 256, 1024, 2048)
    assert lens(4096) == lens(131072) == (64, 256, 1024, 2048, 4096)
    assert lens(128, quick=False) == profile.ATTENTION_SEQ_LENS_FULL


def test_the_sync_wait_probe_times_a_long_layers_segment_at_the_default_budgets_only():
    """runners/probe.sync_segments: a cp4 layer at 4096 tokens meets its all-to-all group after 47 ms (forward) and
    108 ms (backward) here, past the 32 ms segment; the default budgets (share 1) time 128 ms too, a shorter
    --probe-seconds keeps the four short ones (the tests' profiles)."""
    from cost_models.comm import sync_wait_s
    from runners.probe import SYNC_SEGMENTS_S, sync_segments

    assert sync_segments(1.0) == SYNC_SEGMENTS_S + (0.128,)
    assert sync_segments(0.2) == SYNC_SEGMENTS_S == (0.5e-3, 2e-3, 8e-3, 32e-3)
    calibration = {"sync_wait_s_4_500": 0.0004, "sync_wait_s_4_32000": 0.0029, "sync_wait_s_4_128000": 0.0074}
    assert sync_wait_s(calibration, group_size=4, segment_s=0.080) == pytest.approx(0.0025 + 0.0045 / 2)
    del calibration["sync_wait_s_4_128000"]
    assert sync_wait_s(calibration, group_size=4, segment_s=0.080) == pytest.approx(0.0025)  # held at 32 ms's
