"""Every benchmark script imports: a script the README cites for a figure must not rot when the code it
drives moves (benchmarks/validate_cost_model.py still imported a function the one-house restructure had
removed, and failed on its first line)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

BENCHMARKS = sorted((Path(__file__).resolve().parents[2] / "benchmarks").glob("*.py"))


@pytest.mark.parametrize("path", BENCHMARKS, ids=[p.stem for p in BENCHMARKS])
def test_the_benchmark_imports(path):
    spec = importlib.util.spec_from_file_location(f"benchmark_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # where its dataclasses look themselves up
    try:
        spec.loader.exec_module(module)  # runs nothing: each script's work is under `if __name__ == "__main__"`
    finally:
        sys.modules.pop(spec.name, None)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"
