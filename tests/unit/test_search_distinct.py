"""The search's table shows plans the cost model tells apart: those within its resolution in both step time and
memory collapse into the first (planner.search.distinct_plans)."""

from cost_models.estimate import Estimate
from planner.search import Candidate, distinct_plans
from specs.plan import Plan


def _candidate(step_time_s: float, memory_gib: float, **plan) -> Candidate:
    estimate = Estimate(step_time_s=step_time_s, tokens_per_s=1.0, mfu=0.5, tflops_per_gpu=1.0,
                        peak_memory_bytes=int(memory_gib * 2**30), memory_limit_bytes=80 * 2**30)
    return Candidate(Plan(dp=8, micro_batch=1, num_micro_batches=1, **plan), estimate)


def test_plans_alike_in_time_and_memory_collapse_into_the_first():
    ranked = [_candidate(1.000, 70.0), _candidate(1.002, 70.1, bucket_size_bytes=5 * 2**20),
              _candidate(1.003, 40.0, optim_shard=8), _candidate(1.004, 70.0, schedule="gpipe"),
              _candidate(1.2, 30.0, param_shard=8, grad_shard=8, optim_shard=8), _candidate(1.3, 20.0, recompute="full")]
    shown = distinct_plans(ranked, limit=3)
    assert [d.candidate for d in shown] == [ranked[0], ranked[2], ranked[4]]
    assert shown[0].alike == (ranked[1], ranked[3])
    assert shown[0].differing_knobs() == ["schedule", "bucket_size_bytes"]
    assert len(distinct_plans(ranked, limit=10)) == 4 and distinct_plans(ranked, limit=1)[0].alike == (ranked[1], ranked[3])
