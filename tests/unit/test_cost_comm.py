"""Collective times: ring formulas by hand, hierarchical groups across nodes, measured fits."""

import dataclasses

import pytest

from cost_models.comm import collective_time_s, flat_collective_time_s
from specs.cluster import Cluster
from specs.hardware import PRESETS as HW
from specs.hardware import CollectiveFit, LinkSpec

# The hand-computed figures below use round links (the preset's own are NCCL-measured busbw).
A100 = dataclasses.replace(HW["a100"], intra_node=LinkSpec(300e9, 5e-6), inter_node=LinkSpec(25e9, 1.5e-5))
NODES = Cluster(num_nodes=4, devices_per_node=8, hardware=A100)
B = 1e8


def test_two_rank_all_reduce_by_hand():
    # 2 (n-1)/n = 1: each rank sends half, then the other half; two latency steps.
    assert collective_time_s(NODES, collective="all_reduce", size_bytes=B, group_size=2, stride=1) == \
        pytest.approx(B / 300e9 + 2 * 5e-6, rel=1e-12)


def test_ring_all_gather_and_reduce_scatter_by_hand():
    expected = 3 / 4 * B / 300e9 + 3 * 5e-6
    for collective in ("all_gather", "reduce_scatter"):
        assert collective_time_s(NODES, collective=collective, size_bytes=B, group_size=4, stride=2) == \
            pytest.approx(expected, rel=1e-12)


def test_p2p_between_nodes_by_hand():
    assert collective_time_s(NODES, collective="p2p", size_bytes=B, group_size=2, stride=8) == \
        pytest.approx(B / 25e9 + 1.5e-5, rel=1e-12)
    assert collective_time_s(NODES, collective="p2p", size_bytes=B, group_size=2, stride=1) == \
        pytest.approx(B / 300e9 + 5e-6, rel=1e-12)


def test_group_spanning_nodes_is_hierarchical():
    # 16 consecutive ranks = 2 nodes x 8: reduce-scatter in the node, all-reduce of B/8 across the
    # two nodes (8 NICs in parallel), all-gather in the node.
    intra = 7 / 8 * B / 300e9 + 7 * 5e-6
    inter = (B / 8) / 25e9 + 2 * 1.5e-5
    assert collective_time_s(NODES, collective="all_reduce", size_bytes=B, group_size=16, stride=1) == \
        pytest.approx(2 * intra + inter, rel=1e-12)
    # One member per node (DP across TP=8): the whole buffer over one NIC.
    assert collective_time_s(NODES, collective="all_reduce", size_bytes=B, group_size=4, stride=8) == \
        pytest.approx(2 * 3 / 4 * B / 25e9 + 6 * 1.5e-5, rel=1e-12)


def test_more_ranks_per_node_is_faster_across_nodes():
    spread = collective_time_s(NODES, collective="all_gather", size_bytes=B, group_size=4, stride=8)
    packed = collective_time_s(NODES, collective="all_gather", size_bytes=B, group_size=32, stride=1)
    assert packed < spread


def test_measured_fit_replaces_the_datasheet():
    fit = CollectiveFit(collective="all_reduce", link="intra_node", group_size=8, latency_s=2e-5,
                        bandwidth_bytes_per_s=200e9)
    hw = dataclasses.replace(A100, collectives=(fit,))
    # Measured at 8 ranks, used at 4: the ring's 2 (n - 1) latency steps scale it by 6 / 14.
    assert flat_collective_time_s(hw, collective="all_reduce", size_bytes=B, group_size=4, link="intra_node") == \
        pytest.approx(2e-5 * 6 / 14 + 1.5 * B / 200e9, rel=1e-12)
    assert flat_collective_time_s(hw, collective="all_reduce", size_bytes=B, group_size=8, link="intra_node") == \
        pytest.approx(2e-5 + 1.75 * B / 200e9, rel=1e-12)
    # Collectives without a fit keep the datasheet link.
    assert flat_collective_time_s(hw, collective="all_gather", size_bytes=B, group_size=4, link="intra_node") == \
        flat_collective_time_s(A100, collective="all_gather", size_bytes=B, group_size=4, link="intra_node")


def test_single_rank_groups_cost_nothing():
    assert collective_time_s(NODES, collective="all_reduce", size_bytes=B, group_size=1, stride=1) == 0.0


def test_the_fit_of_the_group_size_used_is_chosen():
    """A profile measures each collective at several group sizes; a group of 4 must be priced with the
    4-rank fit, not whichever fit comes first (gloo's 4-rank latency on an oversubscribed host is 3x the
    2-rank one)."""
    two = CollectiveFit(collective="all_gather", link="intra_node", group_size=2, latency_s=1e-3,
                        bandwidth_bytes_per_s=1e9)
    four = CollectiveFit(collective="all_gather", link="intra_node", group_size=4, latency_s=3e-3,
                         bandwidth_bytes_per_s=0.5e9)
    hw = dataclasses.replace(A100, collectives=(two, four))
    assert flat_collective_time_s(hw, collective="all_gather", size_bytes=B, group_size=4, link="intra_node") == \
        pytest.approx(3e-3 + 0.75 * B / 0.5e9, rel=1e-12)
    assert flat_collective_time_s(hw, collective="all_gather", size_bytes=B, group_size=2, link="intra_node") == \
        pytest.approx(1e-3 + 0.5 * B / 1e9, rel=1e-12)
    # 8 ranks: the nearest (4) fit, its 3 latency steps scaled to 7.
    assert flat_collective_time_s(hw, collective="all_gather", size_bytes=B, group_size=8, link="intra_node") == \
        pytest.approx(3e-3 * 7 / 3 + 0.875 * B / 0.5e9, rel=1e-12)


def test_ring_all_gather_across_nodes_pays_every_nvlink_hop():
    """NCCL runs all-gather and reduce-scatter across nodes on one ring through all n ranks: n - k NVLink
    hops and k - 1 node crossings, each a latency (src/graph/tuning.cc). 32 ranks on 4 nodes of 8, a
    near-empty message: 28 intra-node and 3 inter-node steps, not the 7 + 3 of the hierarchical split."""
    tiny = 1.0
    for collective in ("all_gather", "reduce_scatter"):
        t = collective_time_s(NODES, collective=collective, size_bytes=tiny, group_size=32, stride=1)
        assert t == pytest.approx(28 * 5e-6 + 3 * 1.5e-5, rel=1e-6)
    # With bytes: the hierarchical bandwidth terms plus the (k - 1)(r - 1) = 21 extra NVLink steps.
    intra = 7 / 8 * B / 300e9 + 7 * 5e-6
    inter = 3 / 4 * (B / 8) / 25e9 + 3 * 1.5e-5
    assert collective_time_s(NODES, collective="all_gather", size_bytes=B, group_size=32, stride=1) == \
        pytest.approx(intra + inter + 21 * 5e-6, rel=1e-12)


def test_ring_latency_grows_with_the_node_count():
    big = Cluster(num_nodes=64, devices_per_node=8, hardware=A100)
    times = [collective_time_s(big, collective="reduce_scatter", size_bytes=1.0, group_size=n, stride=1)
             for n in (64, 128, 512)]
    # n - k NVLink steps: 56, 112, 448; node crossings: 7, 15, 63.
    assert times == pytest.approx([56 * 5e-6 + 7 * 1.5e-5, 112 * 5e-6 + 15 * 1.5e-5, 448 * 5e-6 + 63 * 1.5e-5],
                                  rel=1e-6)


def test_one_rank_per_node_and_all_reduce_keep_their_step_counts():
    # DP across TP=8: one member per node, no NVLink hop in the ring.
    assert collective_time_s(NODES, collective="all_gather", size_bytes=1.0, group_size=4, stride=8) == \
        pytest.approx(3 * 1.5e-5, rel=1e-6)
    # The all-reduce stays hierarchical (NCCL may take its tree): 2 x 7 intra and 2 x 3 inter steps.
    assert collective_time_s(NODES, collective="all_reduce", size_bytes=1.0, group_size=32, stride=1) == \
        pytest.approx(14 * 5e-6 + 6 * 1.5e-5, rel=1e-6)


def test_the_sync_wait_counts_from_the_shortest_measured_segment_and_levels_off_past_the_longest():
    """cost_models/comm.sync_wait_s: the probe's wait after a segment, less its wait after the shortest one it
    timed (which the per-call prices fitted at short segments already hold), linear between measured segments,
    never falling, flat beyond the longest, from the nearest measured group size (the smaller on a tie);
    nothing measured, a group of one or an empty segment: 0."""
    from cost_models.comm import sync_wait_s, sync_waits_s

    calibration = {"sync_wait_s_4_500": 5e-4, "sync_wait_s_4_2000": 1.7e-3, "sync_wait_s_4_8000": 4.5e-3,
                   "sync_wait_s_4_32000": 12e-3, "sync_wait_s_2_500": 1e-3, "sync_wait_s_2_2000": 0.5e-3}

    def wait(segment_s: float, group_size: int = 4) -> float:
        return sync_wait_s(calibration, group_size=group_size, segment_s=segment_s)

    assert [wait(s) for s in (1e-4, 5e-4)] == [0.0, 0.0]
    assert wait(2e-3) == pytest.approx(1.2e-3) and wait(1.25e-3) == pytest.approx(0.6e-3)
    assert wait(20e-3) == pytest.approx(4e-3 + 0.5 * 7.5e-3) and wait(1.0) == pytest.approx(11.5e-3)
    assert wait(20e-3, group_size=3) == wait(20e-3) and wait(20e-3, group_size=8) == wait(20e-3)
    assert wait(1.0, group_size=2) == 0.0  # its longer segment waited less than its shortest: never below 0
    # A longer segment never waits less than a shorter one (a point below is the probe's noise).
    dipped = {**calibration, "sync_wait_s_4_32000": 1e-3}
    assert sync_wait_s(dipped, group_size=4, segment_s=20e-3) == pytest.approx(4e-3)
    assert sync_wait_s(dipped, group_size=4, segment_s=1.0) == pytest.approx(4e-3)
    assert sync_wait_s({}, group_size=4, segment_s=1.0) == 0.0
    assert sync_wait_s({"sync_wait_s_x_1": 1.0, "sync_wait_s_4": 1.0, "sync_wait_s_0_5": 1.0}, group_size=4,
                       segment_s=1.0) == 0.0  # a hand-edited key that does not parse is not a curve
    # planner tune's fitted factor on the probe's waits
    assert sync_wait_s({**calibration, "sync_wait_scale": 0.5}, group_size=4, segment_s=20e-3) == \
        pytest.approx(0.5 * wait(20e-3))
    assert wait(1.0, group_size=1) == 0.0 and wait(0.0) == 0.0
    # A layer meeting its group 2 times a pass: 2 waits after half the pass each.
    assert sync_waits_s(calibration, group_size=4, syncs=2, forward_s=4e-3, backward_s=64e-3) == \
        pytest.approx((2 * wait(2e-3), 2 * wait(32e-3)))
    assert sync_waits_s(calibration, group_size=4, syncs=0, forward_s=1.0, backward_s=1.0) == (0.0, 0.0)
