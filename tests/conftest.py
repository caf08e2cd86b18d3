"""Every test runs against its own profile cache (PLANNER_CACHE_DIR), seeded with stand-ins for this host's
measured profiles, so a command that defaults to this machine's profile (planner/machine.py) prices with it
instead of spending a minute measuring one; tests of the measuring itself point the cache elsewhere."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest


def seed_profile_cache(directory: Path, *, counts=range(1, 9)) -> None:
    """Write a stand-in profile (the cpu preset, marked as measured here with that many processes) for
    each process count into `directory`, where planner.machine looks for this host's profiles."""
    from planner.machine import cached_profile_path
    from runners.launch import num_cores
    from specs.hardware import PRESETS

    for n in counts:
        standin = dataclasses.replace(PRESETS["cpu"], name=f"cpu-standin-n{n}", measured_processes=n,
                                      measured_cores=num_cores())
        standin.save(cached_profile_path(n, directory=str(directory)))


@pytest.fixture(scope="session", autouse=True)
def profile_cache(tmp_path_factory):
    directory = tmp_path_factory.mktemp("profile-cache")
    seed_profile_cache(directory)
    before = os.environ.get("PLANNER_CACHE_DIR")
    os.environ["PLANNER_CACHE_DIR"] = str(directory)
    yield directory
    if before is None:
        os.environ.pop("PLANNER_CACHE_DIR", None)
    else:
        os.environ["PLANNER_CACHE_DIR"] = before
