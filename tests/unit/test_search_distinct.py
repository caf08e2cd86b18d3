"""The search's table shows plans the cost model tells apart (planner.search.distinct_plans): a plan within its
resolution in step time collapses into an earlier one of the same layout, or of any layout when memory agrees too."""

from cost_models.estimate import Estimate
from planner.search import Candidate, distinct_plans
from specs.plan import Plan


def _candidate(step_time_s: float, memory_gib: float, **plan) -> Candidate:
    estimate = Estimate(step_time_s=step_time_s, tokens_per_s=1.0, mfu=0.5, tflops_per_gpu=1.0,
                        peak_memory_bytes=int(memory_gib * 2**30), memory_limit_bytes=80 * 2**30)
    return Candidate(Plan(**{"dp": 8, "micro_batch": 1, "num_micro_batches": 1, **plan}), estimate)


def test_plans_alike_in_time_and_memory_collapse_into_the_first():
    ranked = [_candidate(1.000, 70.0), _candidate(1.002, 70.1, bucket_size_bytes=5 * 2**20),
              _candidate(1.003, 40.0, optim_shard=8), _candidate(1.004, 70.0, schedule="gpipe"),
              _candidate(1.2, 30.0, param_shard=8, grad_shard=8, optim_shard=8), _candidate(1.3, 20.0, recompute="full")]
    shown = distinct_plans(ranked, limit=3)
    # ZeRO-1 (optim_shard 8) is the same layout 0.3% slower: it collapses too, though it needs less memory.
    assert [d.candidate for d in shown] == [ranked[0], ranked[4], ranked[5]]
    assert shown[0].alike == (ranked[1], ranked[2], ranked[3])
    assert shown[0].differing_knobs() == ["schedule", "optim_shard", "bucket_size_bytes"]
    assert len(distinct_plans(ranked, limit=10)) == 3
    # Another layout within the step-time resolution but not in memory stays; the same layout collapses.
    other = [_candidate(1.0, 70.0), _candidate(1.001, 50.0, num_micro_batches=2), _candidate(1.009, 40.0, optim_shard=8),
             _candidate(1.02, 40.0, param_shard=8, grad_shard=8, optim_shard=8)]
    shown = distinct_plans(other, limit=5)
    assert [d.candidate for d in shown] == [other[0], other[1], other[3]] and shown[0].alike == (other[2],)
