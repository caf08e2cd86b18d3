"""benchmarks/in_step_collectives.py refuses group shapes it cannot lay out, with one line (exit 2), before any
process starts; a run over one 4-rank group is measured by hand (README, the loop from defaults)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "in_step_collectives.py"


def _bench():
    spec = importlib.util.spec_from_file_location("in_step_collectives", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("argv", [["--group-size", "3"], ["--nproc", "6", "--group-size", "4"], ["--nproc", "3"],
                                  ["--group-size", "0"]])
def test_bad_group_shapes_are_refused_before_anything_starts(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        _bench().main(argv)
    assert exit_info.value.code == 2
    assert "must be even" in capsys.readouterr().err
