"""benchmarks/context_parallel.py's fit rule, on made-up memory curves (the benchmark's runs happen once,
by hand): the doubling ladder, the longest sequence the prediction fits, and the step down the ladder
while a run measures more than the budget."""

import importlib.util
import sys
from pathlib import Path

import pytest

PATH = Path(__file__).resolve().parents[2] / "benchmarks" / "context_parallel.py"
spec = importlib.util.spec_from_file_location("context_parallel_bench", PATH)
bench = importlib.util.module_from_spec(spec)
sys.modules["context_parallel_bench"] = bench
spec.loader.exec_module(bench)


def test_doubling_ladder():
    assert bench.doubling_ladder(512, 4096) == (512, 1024, 2048, 4096)
    assert bench.doubling_ladder(512, 4095) == (512, 1024, 2048)
    assert bench.doubling_ladder(7, 7) == (7,)
    with pytest.raises(ValueError):
        bench.doubling_ladder(0, 8)


def test_longest_fitting_is_the_longest_within_the_budget():
    ladder = (512, 1024, 2048, 4096)
    assert bench.longest_fitting(ladder, lambda s: 100 + s / 32, budget_bytes=164) == 2048  # 164 at 2048: fits
    assert bench.longest_fitting(ladder, lambda s: 100 + s / 32, budget_bytes=163.9) == 1024
    assert bench.longest_fitting(ladder, lambda s: 1e9, budget_bytes=1) is None


def test_confirm_fit_steps_down_while_the_run_measures_more_than_the_budget():
    ladder = (512, 1024, 2048, 4096)
    measured_at = []

    def measured(s):
        measured_at.append(s)
        return 150 + s / 16  # the runs cost more than predicted: 406 at 4096, 278 at 2048, 214 at 1024

    seq, tried = bench.confirm_fit(ladder, predicted_bytes=lambda s: 100 + s / 64, measured_bytes=measured,
                                   budget_bytes=250)
    assert seq == 1024 and measured_at == [4096, 2048, 1024]
    assert tried == [(4096, 164.0, 406.0), (2048, 132.0, 278.0), (1024, 116.0, 214.0)]
    # Predicted to fit nowhere: nothing is run.
    measured_at.clear()
    assert bench.confirm_fit(ladder, predicted_bytes=lambda s: 1e9, measured_bytes=measured, budget_bytes=250) == (None, [])
    assert measured_at == []
    # Measured over the budget everywhere: None, every candidate tried once.
    seq, tried = bench.confirm_fit(ladder, predicted_bytes=lambda s: 0, measured_bytes=lambda s: 1e9, budget_bytes=250)
    assert seq is None and [t[0] for t in tried] == [4096, 2048, 1024, 512]


def test_paired_ratio_is_the_median_of_within_round_ratios():
    a = [[2.0, 2.2, 2.1], [4.0, 4.0, 4.0], [3.0, 3.0, 3.0]]
    b = [[1.0, 1.0, 1.0], [1.0, 1.0, 1.0], [2.0, 2.0, 2.0]]
    assert bench.paired_ratio(a, b) == pytest.approx(2.1)


def test_the_compared_plans_hold_the_same_tokens_per_rank():
    """Same global batch in tokens (4 sequences), and every rank sees one sequence's worth per step: its
    micro-batches x micro-batch x seq / cp tokens."""
    for plan in list(bench.TIMED.values()) + list(bench.ACTIVATION.values()):
        assert plan.world_size == bench.WORLD
        assert plan.global_batch == bench.GLOBAL_BATCH
        assert plan.micro_batch * plan.num_micro_batches == plan.cp
