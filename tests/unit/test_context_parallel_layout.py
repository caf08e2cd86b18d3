"""The CP layout and the ring's block schedule, on one process: every (query, key) pair of the causal mask is
computed exactly once over the ring steps, and the two mirrored chunks balance each rank's work; each way of
running a step (torch's CPU flash kernel, written out) gives attention and its gradients over the blocks."""

import pytest
import torch

import runners.context_parallel as cpm
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


@pytest.mark.parametrize("fused", [True, False])
def test_ring_steps_merge_to_attention_and_its_gradients(monkeypatch, fused):
    """Two K/V blocks over one rank's queries, as a 2-rank ring's rank 1 meets them: step 0's causal square
    over its own keys, then a block of earlier keys seen by every row; GQA (4 query heads, 2 K/V heads)."""
    monkeypatch.setattr(cpm, "_fused_blocks", lambda q: fused)
    g = torch.Generator().manual_seed(0)
    side, d = 16, 8
    q, dout = (torch.randn(1, 4, side, d, generator=g) for _ in range(2))
    own, early = ([torch.randn(1, 2, side, d, generator=g) for _ in range(2)] for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, *own, *early)]
    keys, values = torch.cat([leaves[3], leaves[1]], 2), torch.cat([leaves[4], leaves[2]], 2)
    visible = torch.ones(side, 2 * side, dtype=torch.bool).tril(side)  # early keys all, own keys causally
    ref = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], keys.repeat_interleave(2, 1), values.repeat_interleave(2, 1), attn_mask=visible)
    ref.backward(dout)
    out, lse = torch.zeros(q.shape), torch.full(q.shape[:3], float("-inf"))
    whole, scale = slice(None), d ** -0.5
    steps = [(own, True, leaves[1:3]), (early, False, leaves[3:5])]
    for (k, v), causal, _ in steps:
        cpm.ring_forward_step(q, k, v, out, lse, rows=whole, cols=whole, causal=causal, scale=scale)
    assert torch.allclose(out, ref.detach(), atol=1e-5)
    delta, dq = (dout * out).sum(-1), torch.zeros(q.shape)
    for (k, v), causal, (k_leaf, v_leaf) in steps:
        dkv = cpm.ring_backward_step(q, k, v, dout, out, lse, delta, dq, rows=whole, cols=whole, causal=causal,
                                     scale=scale)
        assert torch.allclose(dkv[0], k_leaf.grad, atol=1e-5) and torch.allclose(dkv[1], v_leaf.grad, atol=1e-5)
    assert torch.allclose(dq, leaves[0].grad, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float64])
def test_ring_steps_run_in_every_dtype(dtype):
    """The flash kernel per step takes the training dtypes (its log-sum-exp fp32); others are written out."""
    g = torch.Generator().manual_seed(0)
    q, dout = torch.randn(1, 4, 16, 8, generator=g).to(dtype), torch.randn(1, 4, 16, 8, generator=g)
    k, v = (torch.randn(1, 2, 16, 8, generator=g).to(dtype) for _ in range(2))
    out, lse = torch.zeros(q.shape), torch.full(q.shape[:3], float("-inf"))
    whole, scale = slice(None), 8 ** -0.5
    cpm.ring_forward_step(q, k, v, out, lse, rows=whole, cols=whole, causal=True, scale=scale)
    leaves = [t.float().requires_grad_() for t in (q, k, v)]
    ref = torch.nn.functional.scaled_dot_product_attention(
        leaves[0], leaves[1].repeat_interleave(2, 1), leaves[2].repeat_interleave(2, 1), is_causal=True)
    ref.backward(dout)
    assert torch.allclose(out, ref.detach(), atol=2e-2)
    dq = torch.zeros(q.shape)
    dkv = cpm.ring_backward_step(q, k, v, dout, out, lse, (dout * out).sum(-1), dq, rows=whole, cols=whole,
                                 causal=True, scale=scale)
    assert torch.allclose(dq, leaves[0].grad, atol=5e-2)
    assert torch.allclose(dkv[0], leaves[1].grad, atol=5e-2) and torch.allclose(dkv[1], leaves[2].grad, atol=5e-2)
