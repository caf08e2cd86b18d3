"""This machine's defaults (planner/machine.py): one process count for every local command, and the cached
profile of this host for that count, measured on first use and again when it was measured with another
count, on other cores or on another device type."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from planner import machine
from profilers.profile import PROFILER_VERSION
from runners.launch import num_cores
from specs.errors import PlannerError
from specs.hardware import PRESETS, resolve_hardware


def _measured(nproc: int, *, cores: int | None = None):
    return dataclasses.replace(PRESETS["cpu"], name="measured", source="profile", measured_processes=nproc,
                               measured_cores=num_cores() if cores is None else cores,
                               profiler_version=PROFILER_VERSION)


def test_one_default_process_count_for_every_local_command(monkeypatch):
    monkeypatch.setattr(machine, "num_cores", lambda: 2)
    assert machine.default_nproc() == 2
    monkeypatch.setattr(machine, "num_cores", lambda: 16)
    assert machine.default_nproc() == 4
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 8)
    assert machine.default_nproc() == 8
    from planner.run_command import RunRequest, resolve_request
    from planner.tune import TuneSettings
    from planner.validate import ValidateSettings

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(machine, "num_cores", lambda: 2)
    assert resolve_request(RunRequest(), {})[0].nproc == TuneSettings().nproc == 2
    assert ValidateSettings(hardware="cpu").nproc == 2


def test_the_cached_profile_is_used_for_its_process_count_and_measured_for_another(tmp_path, monkeypatch):
    measured = []

    def fake_measure(options, *, progress):
        measured.append(options.nproc)
        progress("compute", 1, None, "gemm")
        return _measured(options.nproc)

    monkeypatch.setattr("planner.profiling.measure_profile", fake_measure)
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    path, reused = machine.local_profile(2)
    assert (reused, measured) == (False, [2]) and resolve_hardware(path).measured_processes == 2
    assert machine.local_profile(2) == (path, True) and measured == [2]  # cached: not measured again
    assert machine.local_hardware(2) == path
    path4 = machine.local_hardware(4)  # another count: its own profile, measured now
    assert measured == [2, 4] and path4 != path and resolve_hardware(path4).measured_processes == 4
    # A cache entry measured with another count, or on other cores, is measured again.
    _measured(3).save(machine.cached_profile_path(2))
    assert "measured with 3 processes" in machine.stale_reason(machine.cached_profile_path(2), nproc=2)
    _measured(2, cores=num_cores() + 6).save(machine.cached_profile_path(2))
    assert "cores" in machine.stale_reason(machine.cached_profile_path(2), nproc=2)
    # One measured by another version of the profiler (its collectives timed another way) too.
    dataclasses.replace(_measured(2), profiler_version=PROFILER_VERSION - 1).save(machine.cached_profile_path(2))
    assert "profiler version" in machine.stale_reason(machine.cached_profile_path(2), nproc=2)
    machine.local_profile(2)
    assert measured == [2, 4, 2]
    machine.cached_profile_path(2).write_text("{not json")
    assert "unreadable" in machine.stale_reason(machine.cached_profile_path(2), nproc=2)
    assert machine.local_profile(2, refresh=True)[1] is False and measured == [2, 4, 2, 2]
    # Inside a torchrun worker nothing is measured: the cpu preset, with a warning.
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path / "empty"))
    assert machine.local_hardware(2, measure=False) == "cpu" and measured == [2, 4, 2, 2]
    with pytest.raises(PlannerError, match="give --hardware"):
        machine.local_profile(1024)


def test_a_gpu_node_uses_its_cached_gpu_profile_else_its_preset(tmp_path, monkeypatch):
    monkeypatch.setenv("PLANNER_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda _i=0: "NVIDIA H100 80GB HBM3")
    _measured(8).save(machine.cached_profile_path(8))  # a CPU profile is no GPU node's
    assert machine.local_hardware(8) == "h100"
    gpu = dataclasses.replace(PRESETS["h100"], source="profile", measured_processes=8, measured_cores=num_cores(),
                              profiler_version=PROFILER_VERSION)
    gpu.save(machine.cached_profile_path(8))
    assert machine.local_hardware(8) == str(machine.cached_profile_path(8))
    assert machine.local_hardware(1024) == "h100"  # a cluster-sized job is priced on the preset
