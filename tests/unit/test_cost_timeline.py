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


# pp 2, m 2, 1F1B, f 1, b 2, p2p 0.5: rank 1 runs F0 1.5-2.5, B0 2.5-4.5, F1 4.5-5.5 and its last
# backward B1 5.5-7.5; rank 0 runs B0 5-7 and B1 from the arrival of rank 1's last input gradient,
# 7.5 + 0.5 (+ the send's delay). Each chunk's reduction alone takes 1.0 on the wire.
def _two_stage(*, send_delay_s, reduce_s, reduce_start_s):
    return ChunkDurations((1.0, 1.0), (2.0, 2.0), 0.5, reduce_s, (1.0, 1.0), (2.0, 2.0),
                          last_send_delay_s=send_delay_s, reduce_start_s=reduce_start_s)


def _makespan(d):
    result = simulate_full(schedule="1f1b", pp=2, virtual_stages=1, num_micro_batches=2, durations=d, commshift=True)
    return result, max(max(result.compute_end_s), max(result.comm_end_s))


def test_a_send_sharing_its_link_with_the_reduction_arrives_one_send_later():
    """Without commshift the reduction (1.0) and the last send (0.5) of chunk 1 leave together: per-flow
    sharing delays the send by min(0.5, 1.0) = 0.5 and the reduction by as much (1.5). Rank 0's last
    backward starts at 8.5 instead of 8, ends at 10.5, its own reduction at 11.5. With commshift the
    reduction starts once the send is done (7.5 + 0.5) and takes 1.0: rank 0 ends 10, reduced at 11."""
    shared, shared_step = _makespan(_two_stage(send_delay_s=(0.0, 0.5), reduce_s=(1.0, 1.5),
                                                  reduce_start_s=(0.0, 0.0)))
    assert shared.compute_end_s == pytest.approx((10.5, 7.5))
    assert shared.comm_end_s == pytest.approx((11.5, 9.0))
    shifted, shifted_step = _makespan(_two_stage(send_delay_s=(0.0, 0.0), reduce_s=(1.0, 1.0),
                                                    reduce_start_s=(0.0, 0.5)))
    assert shifted.compute_end_s == pytest.approx((10.0, 7.5))
    assert shifted.comm_end_s == pytest.approx((11.0, 9.0))
    assert shared_step - shifted_step == pytest.approx(0.5)  # one send


def test_a_send_on_another_link_gains_nothing_from_commshift():
    """The reduction inside the node, the send across: nothing shares, the send arrives at 8 either way;
    commshift only starts chunk 1's reduction one send later (8 + 1 = 9 instead of 8.5), off the
    critical path, which rank 0's reduction ends at 11."""
    apart, apart_step = _makespan(_two_stage(send_delay_s=(0.0, 0.0), reduce_s=(1.0, 1.0),
                                                reduce_start_s=(0.0, 0.0)))
    shifted, shifted_step = _makespan(_two_stage(send_delay_s=(0.0, 0.0), reduce_s=(1.0, 1.0),
                                                    reduce_start_s=(0.0, 0.5)))
    assert apart.comm_end_s == pytest.approx((11.0, 8.5)) and shifted.comm_end_s == pytest.approx((11.0, 9.0))
    assert apart_step == pytest.approx(shifted_step) == pytest.approx(11.0)


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("gpipe", 1), ("interleaved-1f1b", 2)])
def test_send_delays_and_reduction_starts_agree_between_simulations(schedule, v):
    """The shortened and closed-form simulations carry the per-chunk send delays and reduction starts
    exactly as the full one does."""
    rng = random.Random(3)
    pp, m = 3, 12 if schedule != "interleaved-1f1b" else 9
    n = pp * v
    d = ChunkDurations(tuple(rng.uniform(0.5, 1.5) for _ in range(n)), tuple(rng.uniform(1, 3) for _ in range(n)),
                       0.3, tuple(rng.uniform(0, 4) for _ in range(n)), (0.2,) * n,
                       tuple(rng.uniform(1, 3) for _ in range(n)),
                       last_send_delay_s=tuple(rng.uniform(0, 1) for _ in range(n)),
                       reduce_start_s=tuple(rng.uniform(0, 1) for _ in range(n)))
    full = simulate_full(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m, durations=d, commshift=True)
    fast = simulate(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m, durations=d, commshift=True)
    assert fast.compute_end_s == pytest.approx(full.compute_end_s)
    assert fast.comm_end_s == pytest.approx(full.comm_end_s)
