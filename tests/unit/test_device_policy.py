"""The CUDA/NCCL choices of issue 11, checked on a CPU-only machine with a faked CUDA where they need one:
which device and backend a worker takes (one GPU shared by several ranks), bf16 as a GPU run's default,
TF32 for fp32, NCCL timeouts that raise instead of aborting, `planner profile --nproc 1`, the GEMM sweep
and probe shapes on CUDA, the probe fitted on CUDA, and separate process groups per stream."""

from __future__ import annotations

import os
import types

import pytest
import torch
import torch.distributed as dist

from specs.errors import PlannerError
from specs.hardware import PRESETS, LayerProbePoint
from specs.job import GPU_MEMORY_HEADROOM


def fake_cuda(monkeypatch, *, count: int, name: str = "NVIDIA H200") -> list:
    """torch.cuda as a machine with `count` GPUs named `name` shows it; returns the set_device calls."""
    calls: list = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: count)
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: name)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda *a, **k: True)
    return calls


@pytest.mark.parametrize("local_rank,local_world,count,want", [
    (1, 2, 1, ("cuda:0", "gloo")),  # two ranks on one GPU: LOCAL_RANK is no ordinal, NCCL refuses the pair
    (3, 4, 1, ("cuda:0", "gloo")),
    (1, 8, 8, ("cuda:1", "nccl")),  # a GPU per rank
    (0, 1, 1, ("cuda:0", "nccl")),
])
def test_a_worker_takes_an_existing_gpu_and_a_backend_that_works_there(monkeypatch, local_rank, local_world,
                                                                          count, want):
    from runners.launch import pick_device

    calls = fake_cuda(monkeypatch, count=count)
    monkeypatch.setenv("LOCAL_RANK", str(local_rank))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(local_world))
    device, backend = pick_device()
    assert (str(device), backend) == want
    assert calls == [device]


class _Stop(Exception):
    pass


@pytest.mark.parametrize("worker", ["profilers.comm", "runners.probe", "runners.train"])
def test_every_worker_uses_that_policy_on_a_one_gpu_machine(monkeypatch, worker):
    """Rank 1 of 2 on one GPU: the collective benchmark used to call set_device(LOCAL_RANK) = 1 (an invalid
    ordinal); every worker must take GPU 0 and gloo before it creates its process group."""
    import importlib

    import runners.faults

    calls = fake_cuda(monkeypatch, count=1)
    monkeypatch.setenv("LOCAL_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("WORLD_SIZE", "2")
    backends: list[str] = []

    def stop(backend, **kwargs):
        backends.append(backend)
        raise _Stop

    monkeypatch.setattr(dist, "init_process_group", stop)
    monkeypatch.setattr(runners.faults, "init_distributed", stop)
    module = importlib.import_module(worker)
    spec = _worker_spec(worker)
    with pytest.raises(_Stop):
        module.run_task(spec)
    assert calls == [torch.device("cuda", 0)] and backends == ["gloo"]


def _worker_spec(worker: str) -> dict:
    from specs.model import PRESETS as MODELS

    if worker == "profilers.comm":
        from profilers.comm import CommSpec, plan_groups

        return CommSpec(sizes_bytes=(1024, 4096), collectives=("all_reduce",),
                        groups=tuple(plan_groups(world_size=2, ranks_per_node=2, quick=True)),
                        budget_s_per_point=0.1, max_repeats=3, timeout_s=10).to_dict()
    if worker == "runners.probe":
        return {"model": MODELS["tiny"].to_dict(), "budget_s": 0.1}
    from runners.config import RunConfig
    from specs.job import Job
    from specs.plan import Plan

    return RunConfig(plan=Plan(dp=2), model=MODELS["tiny"], job=Job(global_batch=2, seq_len=8)).to_dict()


def test_a_gpu_run_defaults_to_bf16_and_its_gpus_preset(monkeypatch):
    from planner.run_command import RunRequest, build_run

    cpu = build_run(RunRequest(nproc=2), {})
    assert cpu.job.precision == "fp32"
    fake_cuda(monkeypatch, count=1)
    gpu = build_run(RunRequest(nproc=2), {})
    assert gpu.job.precision == "bf16"  # was fp32 whatever the device, while search and estimate said bf16
    # The GPU preset less the default memory headroom every GPU plan keeps (specs/job.py).
    assert gpu.predicted["memory_limit_bytes"] == int(PRESETS["h200"].memory_bytes * (1 - GPU_MEMORY_HEADROOM))
    assert build_run(RunRequest(nproc=2, precision="fp32"), {}).job.precision == "fp32"


def test_torch_engine_refuses_fp16_in_one_line():
    from planner.run_command import RunRequest, build_run

    with pytest.raises(PlannerError, match="no loss scaling"):
        build_run(RunRequest(nproc=2, engine="torch", precision="fp16"), {"zero": 3})


def test_fp32_runs_use_tf32_on_cuda_unless_turned_off():
    from runners.config import RunConfig
    from runners.train import set_matmul_precision

    assert RunConfig.__dataclass_fields__["allow_tf32"].default is True
    before = (torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32)
    try:
        set_matmul_precision(torch.device("cuda", 0), allow_tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        set_matmul_precision(torch.device("cuda", 0), allow_tf32=False)
        assert not torch.backends.cuda.matmul.allow_tf32
        set_matmul_precision(torch.device("cpu"), allow_tf32=True)  # no effect on CPU
        assert not torch.backends.cuda.matmul.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = before


def test_nccl_timeouts_raise_in_the_rank_instead_of_aborting_it(monkeypatch):
    import runners.faults as faults

    monkeypatch.delenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", raising=False)
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: None)
    faults.init_distributed("nccl", timeout_s=60)
    assert os.environ["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "2"  # clean up only: describe_failure runs
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    assert faults.nccl_failure_env() == {"TORCH_NCCL_ASYNC_ERROR_HANDLING": "1"}  # the user's choice is kept


def test_profile_with_one_process_takes_the_links_from_the_gpus_preset_and_says_so(monkeypatch):
    from profilers.compute import ComputeResult
    from profilers.fit import GemmSample
    from profilers.memory import MemoryResult
    from profilers.profile import ProfileOptions, base_preset, build_hardware, measures_collectives

    options = ProfileOptions(nproc=1)
    assert not measures_collectives(options) and measures_collectives(ProfileOptions(nproc=2))
    with pytest.raises(PlannerError):
        ProfileOptions(nproc=0)
    device = torch.device("cuda", 0)
    assert base_preset(device, "NVIDIA H200").name == "h200"
    assert base_preset(device, "NVIDIA GeForce RTX 4090").name == "h100"
    gemms = [GemmSample(m=d, n=d, k=d, dtype="bf16", time_s=2 * d**3 / (700e12 * d / (d + 100)))
             for d in (256, 1024, 4096, 16384)]
    compute = ComputeResult(device_name="NVIDIA H200", num_threads=16, dtypes=["bf16"], skipped_dtypes={},
                            gemms=gemms)
    memory = MemoryResult(memory_bytes=140 * 2**30, memory_source="x", memory_bandwidth_bytes_per_s=4e12,
                          host_memory_bytes=2**40, host_device_bandwidth_bytes_per_s=5e10)
    # The SM count comes from the device (the wave model prices by it), the tile and NCCL's CTAs from the preset.
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda _d: types.SimpleNamespace(multi_processor_count=114))
    hw = build_hardware(device=device, compute=compute, memory=memory, fits=[], base=base_preset(device, "NVIDIA H200"))
    assert (hw.num_sms, hw.gemm_tile, hw.nccl_ctas) == (114, PRESETS["h200"].gemm_tile, PRESETS["h200"].nccl_ctas)
    assert hw.intra_node == PRESETS["h200"].intra_node and hw.inter_node == PRESETS["h200"].inter_node
    assert hw.links_from == "h200 preset (intra_node, inter_node)"
    assert hw.host_device_bandwidth_bytes_per_s == 5e10  # measured, not the preset's


def test_the_gemm_sweep_and_the_probe_reach_the_shapes_large_models_run_on_cuda():
    from profilers.compute import square_sweep
    from runners.probe import probe_shapes
    from specs.model import PRESETS as MODELS

    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert max(square_sweep(quick=False, device=cuda)) == 16384
    assert max(square_sweep(quick=True, device=cuda)) == 8192
    assert max(square_sweep(quick=False, device=cpu)) == 2048
    assert max(s * b for b, s in probe_shapes(MODELS["llama3.2-1b"], device=cuda)) >= 8192
    assert max(s * b for b, s in probe_shapes(MODELS["llama3.2-1b"], device=cpu)) <= 256


def test_the_layer_probe_is_fitted_on_cuda_with_dispatch_hidden():
    """On CUDA the probe fits compute_time_scale (the engine's layer against the GEMM sweep's prediction)
    with no per-op term: the kernel queue hides dispatch at the shapes training runs."""
    import dataclasses

    from cost_models.compute import layer_compute_times
    from planner.profiling import with_layer_probe
    from specs.model import PRESETS as MODELS

    model, hw = MODELS["llama3.2-1b"], dataclasses.replace(PRESETS["h200"], source="profile")
    slower = dataclasses.replace(hw, calibration={"compute_time_scale": 1.3})  # the engine's layer, say
    points = []
    for b, s in ((1, 1024), (2, 2048), (4, 2048)):
        t = layer_compute_times(model, slower, micro_batch=b, seq_len=s, tp=1, sequence_parallel=False,
                                precision="bf16")
        points.append(LayerProbePoint(micro_batch=b, seq_len=s, dtype="bfloat16", forward_s=t.forward_s,
                                      forward_backward_s=t.forward_s + t.backward_s))
    fitted = with_layer_probe(dataclasses.replace(hw, layer_probe=tuple(points)), model=model).calibration
    assert fitted["compute_time_scale"] == pytest.approx(1.3, rel=1e-3)
    assert fitted["op_overhead_s"] == 0.0
    assert "comm_overlap_efficiency" not in fitted  # one rank: no overlap probe, the GPU default stays


def test_gathers_and_reduce_scatters_over_the_same_ranks_get_separate_groups():
    """NCCL runs one process group's collectives on one stream: ZeRO-3's gathers and reduce-scatters span
    the same ranks and must still be two groups, or the reduce-scatters queue behind the prefetches."""
    from runners.mesh import group_keys
    from specs.plan import Plan

    keys = group_keys(Plan(dp=4, param_shard=4, grad_shard=4, optim_shard=4), ranks_per_node=4)
    groups = {(stream, ranks) for _, stream, ranks in keys}
    assert ("gather", (0, 1, 2, 3)) in groups and ("reduce", (0, 1, 2, 3)) in groups
    kinds = {kind: (stream, ranks) for kind, stream, ranks in keys if 0 in ranks}
    assert kinds["param"] != kinds["grad"]
    assert kinds["grad"] == kinds["dp"]  # one stream, same ranks: one group
