"""Pipeline timeline: textbook makespans, the shortened simulation equals the full one, commshift."""

import random

import pytest

from cost_models.timeline import ChunkDurations, simulate, simulate_full


def _uniform(num_chunks, f, b, p2p=0.0, reduce_s=0.0, last_bucket_s=0.0):
    return ChunkDurations((f,) * num_chunks, (b,) * num_chunks, p2p, (reduce_s,) * num_chunks,
                          (last_bucket_s,) * num_chunks)


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe"])
@pytest.mark.parametrize("pp,m", [(1, 5), (4, 4), (4, 32), (8, 100)])
def test_uniform_pipeline_makespan_is_textbook(schedule, pp, m):
    # (m + pp - 1) (f + b): every rank's m forward/backward pairs plus pp - 1 bubbles.
    result = simulate(schedule=schedule, pp=pp, virtual_stages=1, num_micro_batches=m,
                      durations=_uniform(pp, 1.0, 2.0), commshift=False)
    assert max(result.compute_end_s) == pytest.approx((m + pp - 1) * 3.0)
    assert result.busy_s == pytest.approx((3.0 * m,) * pp)


def test_interleaving_shrinks_the_bubble():
    pp, m = 4, 16
    plain = simulate(schedule="1f1b", pp=pp, virtual_stages=1, num_micro_batches=m,
                     durations=_uniform(pp, 2.0, 4.0), commshift=False)
    inter = simulate(schedule="interleaved-1f1b", pp=pp, virtual_stages=2, num_micro_batches=m,
                     durations=_uniform(2 * pp, 1.0, 2.0), commshift=False)
    # Megatron (SC21): the bubble drops from (pp - 1)(f + b) to (pp - 1)(f + b) / v.
    assert max(plain.compute_end_s) == pytest.approx(6.0 * (m + pp - 1))
    assert max(inter.compute_end_s) == pytest.approx(6.0 * m + 6.0 * (pp - 1) / 2)


def _random_case(rng):
    schedule = rng.choice(["1f1b", "interleaved-1f1b", "gpipe"])
    pp = rng.choice([1, 2, 3, 4, 8, 16]) if schedule != "interleaved-1f1b" else rng.choice([2, 3, 4, 8])
    v = rng.choice([2, 3]) if schedule == "interleaved-1f1b" else 1
    spread = rng.choice([0.0, 0.05, 1.0])
    f = tuple(rng.uniform(1, 1 + spread) for _ in range(pp * v))
    b = tuple(x * rng.uniform(1.5, 2.5) for x in f)
    reduce_s = tuple(rng.choice([0.0, rng.uniform(0, 10)]) for _ in range(pp * v))
    last = tuple(min(r, rng.uniform(0, 1)) for r in reduce_s)
    m = rng.choice([40, 96, 128, 200])
    if schedule == "interleaved-1f1b":
        m -= m % pp
    durations = ChunkDurations(f, b, rng.choice([0.0, 0.05, 0.5, 3.0]), reduce_s, last)
    return dict(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m, durations=durations,
                commshift=rng.random() < 0.5)


def _assert_same(short, full, case):
    for field in ("compute_end_s", "comm_end_s", "busy_s"):
        assert getattr(short, field) == pytest.approx(getattr(full, field), rel=1e-9, abs=1e-9), (case, field)


@pytest.mark.parametrize("seed", range(4))
def test_shortened_simulation_equals_the_full_one(seed):
    rng = random.Random(seed)
    for _ in range(60):
        case = _random_case(rng)
        _assert_same(simulate(**case), simulate_full(**case), case)


def test_long_realistic_pipelines_equal_the_full_simulation():
    # The regime the search prices: many micro-batches, a slightly heavier last stage (the head).
    for schedule, pp, v in [("1f1b", 16, 1), ("interleaved-1f1b", 8, 2), ("gpipe", 16, 1)]:
        n = pp * v
        durations = ChunkDurations(tuple([1.0] * (n - 1) + [1.12]), tuple([2.9] * (n - 1) + [3.3]), 0.01,
                                   (0.8,) * n, (0.05,) * n)
        for commshift in (False, True):
            case = dict(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=512, durations=durations,
                        commshift=commshift)
            _assert_same(simulate(**case), simulate_full(**case), case)


def test_commshift_takes_the_reductions_off_the_critical_path():
    pp, m = 4, 16
    durations = _uniform(pp, 1.0, 2.0, p2p=0.01, reduce_s=8.0, last_bucket_s=0.1)
    without = simulate(schedule="1f1b", pp=pp, virtual_stages=1, num_micro_batches=m, durations=durations,
                       commshift=False)
    shifted = simulate(schedule="1f1b", pp=pp, virtual_stages=1, num_micro_batches=m, durations=durations,
                       commshift=True)
    step_without = max(max(c, d) for c, d in zip(without.compute_end_s, without.comm_end_s))
    step_shifted = max(max(c, d) for c, d in zip(shifted.compute_end_s, shifted.comm_end_s))
    bare = simulate(schedule="1f1b", pp=pp, virtual_stages=1, num_micro_batches=m, commshift=False,
                    durations=_uniform(pp, 1.0, 2.0, p2p=0.01))
    step_bare = max(bare.compute_end_s)
    # Without: each stage's last backward lasts max(b, reduce - last bucket) + last bucket = 8 instead
    # of 2 and only then sends upstream, so the pp reductions queue along the cool-down: +pp x 6.
    assert step_without == pytest.approx(step_bare + pp * 6.0)
    # With: the backwards run as usual; only rank 0's reduction, issued last, remains exposed.
    assert step_shifted == pytest.approx(step_bare + 8.0)
