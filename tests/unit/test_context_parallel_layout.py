"""The CP layout and the ring's block schedule, on one process: every (query, key) pair of the causal mask is
computed exactly once over the ring steps, and the two mirrored chunks balance each rank's work."""

import pytest
import torch

from runners.context_parallel import _block, _from_ring_order, _to_ring_order, local_positions


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_positions_cover_the_sequence_once(cp):
    seq = 8 * cp
    held = torch.cat([local_positions(seq, cp=cp, rank=r) for r in range(cp)])
    assert sorted(held.tolist()) == list(range(seq))
    assert local_positions(8, cp=2, rank=0).tolist() == [0, 1, 6, 7]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_blocks_cover_the_causal_mask_exactly_once(n):
    half = 2
    seq = 2 * half * n
    covered = torch.zeros(seq, seq, dtype=torch.int64)
    work = []
    for me in range(n):
        pos_q = local_positions(seq, cp=n, rank=me)
        done = 0
        for step in range(n):
            src = (me - step) % n
            pos_k = local_positions(seq, cp=n, rank=src)
            rows, cols, causal = _block(step, me=me, n=n, half=half)
            q, k = pos_q[rows], pos_k[cols]
            for i, pq in enumerate(q.tolist()):
                for j, pk in enumerate(k.tolist()):
                    if not causal or j <= i:
                        assert pk <= pq, "a block computes a masked pair"
                        covered[pq, pk] += 1
                        done += 1
        work.append(done)
    assert torch.equal(covered, torch.ones(seq, seq, dtype=torch.int64).tril())
    assert len(set(work)) == 1, f"ranks do unequal work {work}"


def test_ring_order_round_trips():
    # a2a group of 2 (cp 4, ranks 0 and 1): gathered [r0 chunks (0, 7), r1 chunks (1, 6)] -> positions 0, 1, 6, 7
    x = torch.tensor([0, 7, 1, 6]).view(4, 1)
    ordered = _to_ring_order(x, 2)
    assert ordered.view(-1).tolist() == [0, 1, 6, 7]
    assert torch.equal(_from_ring_order(ordered, 2), x)
