"""This machine as every command sees it by default: how many local processes a job runs on, and the
measured, cached hardware profile its predictions use.

    planner run / validate / tune / profile     # all take default_nproc() processes and the cached profile

A profile measured with N processes describes what one of N processes sharing this host can do (on a CPU
host they share its cores, memory bandwidth and the loopback link), so it is cached per host and process
count (`profile-<host>-n<N>.json` under ~/.cache/planner, or $PLANNER_CACHE_DIR) and records the count and
cores it was measured with (Hardware.measured_processes, measured_cores). A command that runs another
count uses, or measures on first use, that count's profile; one whose cached profile was measured on
another number of cores measures it again. `planner calibrate` and `planner tune` write their fits into
the cached file, and every later command prices with them.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Callable

from runners.launch import num_cores
from specs.errors import PlannerError

log = logging.getLogger(__name__)

Progress = Callable[[str, int, "int | None", str], None]

# The most local processes a command measures a profile for: beyond it a CPU host is oversubscribed so far
# that the profile would describe contention, not the plan; such problems need --hardware.
MAX_LOCAL_PROCESSES = 16


def _no_progress(stage: str, done: int, total: int | None, label: str) -> None:
    pass


def default_nproc() -> int:
    """The processes a local job runs on when none is given, the same for run, validate, tune and profile:
    every GPU, or on a CPU host 2 (up to 4 on 8 cores or more: each process keeps two cores to itself)."""
    import torch

    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return max(2, min(4, num_cores() // 2))


def cache_dir(override: str | None = None) -> Path:
    return Path(override or os.environ.get("PLANNER_CACHE_DIR") or Path.home() / ".cache" / "planner")


def cached_profile_path(nproc: int, *, directory: str | None = None) -> Path:
    """The cache entry for this host and process count."""
    host = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in socket.gethostname()) or "host"
    return cache_dir(directory) / f"profile-{host}-n{nproc}.json"


def stale_reason(path: Path, *, nproc: int) -> str | None:
    """Why the cached profile at `path` cannot be used for `nproc` processes here (missing, unreadable,
    measured with another process count or on another number of cores), or None."""
    from specs.hardware import resolve_hardware

    if not path.exists():
        return "none cached"
    try:
        hardware = resolve_hardware(str(path))
    except PlannerError as exc:
        return f"the cached one is unreadable ({exc})"
    import torch

    here = "cuda" if torch.cuda.is_available() else "cpu"
    if hardware.device_type != here:
        return f"the cached one was measured on {hardware.device_type}, this host runs on {here}"
    if hardware.measured_processes and hardware.measured_processes != nproc:
        return f"the cached one was measured with {hardware.measured_processes} processes"
    if hardware.device_type == "cpu" and hardware.measured_cores and hardware.measured_cores != num_cores():
        return f"the cached one was measured on {hardware.measured_cores} cores, this host has {num_cores()}"
    from profilers.profile import PROFILER_VERSION

    if hardware.source == "profile" and hardware.profiler_version != PROFILER_VERSION:
        return (f"the cached one was measured by profiler version {hardware.profiler_version}, this is "
                f"version {PROFILER_VERSION}")
    return None


def local_profile(nproc: int, *, model: str = "tiny", refresh: bool = False, directory: str | None = None,
                  progress: Progress = _no_progress) -> tuple[str, bool]:
    """(path, reused): this host's profile for `nproc` local processes, measured now (quick, with progress)
    when none usable is cached or `refresh` asks for it."""
    if not 1 <= nproc <= MAX_LOCAL_PROCESSES:
        raise PlannerError(f"this machine's profile is measured with 1 to {MAX_LOCAL_PROCESSES} local processes, "
                           f"not {nproc}; give --hardware (a preset or a profile of the cluster)")
    path = cached_profile_path(nproc, directory=directory)
    reason = "--refresh-profile" if refresh else stale_reason(path, nproc=nproc)
    if reason is None:
        return str(path), True
    from planner.profiling import measure_profile
    from profilers.profile import ProfileOptions

    log.warning("measuring this machine's profile for %d processes (%s); cached in %s", nproc, reason, path)
    hardware = measure_profile(ProfileOptions(nproc=nproc, quick=True, model=model), progress=progress)
    hardware.save(path)
    return str(path), False


def local_hardware(nproc: int, *, measure: bool = True, progress: Progress = _no_progress) -> str:
    """The hardware a job of `nproc` local processes is priced on by default: this host's cached profile
    for that count; on a CPU host measured now when there is none (local_profile; with `measure` False,
    as inside a torchrun worker, the `cpu` preset with a warning); on a GPU node without one, its GPU's
    datasheet preset (matched by name; an unknown GPU is priced as an h100, with a warning)."""
    import torch

    path = cached_profile_path(nproc)
    if 1 <= nproc <= MAX_LOCAL_PROCESSES and stale_reason(path, nproc=nproc) is None:
        return str(path)
    if not torch.cuda.is_available():
        if measure:
            return local_profile(nproc, progress=progress)[0]
        log.warning("no profile of this host for %d processes is cached: pricing with the cpu preset "
                    "(`planner profile --nproc %d` measures one)", nproc, nproc)
        return "cpu"
    from specs.hardware import preset_for_device

    name = torch.cuda.get_device_name(0)
    preset = preset_for_device(name)
    if preset is not None:
        return preset.name
    log.warning("no hardware preset for %s: pricing with h100's datasheet; `planner profile` measures it", name)
    return "h100"


def local_precision() -> str:
    """The compute precision of a run on this machine by default: bf16 on a GPU that has it (with fp32
    master weights), fp32 on CPU (where bf16 is emulated on most cores)."""
    import torch

    return "bf16" if torch.cuda.is_available() and torch.cuda.is_bf16_supported() else "fp32"
