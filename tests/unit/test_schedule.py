"""Pipeline action lists: every schedule is complete, executable, and holds the activations it should."""

import itertools

import pytest

from specs.schedule import BACKWARD, FORWARD, check_executable, max_in_flight, rank_actions


@pytest.mark.parametrize("schedule,pp,v,m", [
    *[("gpipe", pp, 1, m) for pp, m in itertools.product((1, 2, 4), (1, 3, 8))],
    *[("1f1b", pp, 1, m) for pp, m in itertools.product((1, 2, 3, 4), (1, 2, 5, 8))],
    *[("interleaved-1f1b", pp, v, m) for pp, v, m in itertools.product((2, 4), (2, 3), (4, 8, 12)) if m % pp == 0],
])
def test_schedules_are_complete_and_executable(schedule, pp, v, m):
    per_rank = rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m)
    for rank, actions in enumerate(per_rank):
        expected = {(k, c, i) for k in (FORWARD, BACKWARD) for c in range(rank, pp * v, pp) for i in range(m)}
        assert {(a.kind, a.chunk, a.micro_batch) for a in actions} == expected
        assert len(actions) == len(expected)
    check_executable(per_rank, num_chunks=pp * v)


def test_one_f_one_b_bounds_activations_by_depth():
    per_rank = rank_actions(schedule="1f1b", pp=4, virtual_stages=1, num_micro_batches=16)
    assert [max_in_flight(a) for a in per_rank] == [4, 3, 2, 1]
    gpipe = rank_actions(schedule="gpipe", pp=4, virtual_stages=1, num_micro_batches=16)
    assert [max_in_flight(a) for a in gpipe] == [16] * 4


def test_deadlock_is_detected():
    per_rank = rank_actions(schedule="1f1b", pp=2, virtual_stages=1, num_micro_batches=2)
    per_rank[1] = list(reversed(per_rank[1]))
    with pytest.raises(ValueError, match="deadlocks"):
        check_executable(per_rank, num_chunks=2)
