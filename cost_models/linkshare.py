"""Concurrent flows on one link: per-flow fair sharing (what TCP over a FIFO queue and NCCL's channels on
one NIC converge to), for the moments when two kinds of traffic of a rank leave through the same egress.

A link of bandwidth B carrying n flows gives each B / n; a flow that would take t seconds alone (its
wire time: bytes / B) progresses at 1 / n of that rate while n flows are active. For flows that start
together, sorted by wire time t_1 <= ... <= t_n, the k-th finishes at

    t_1 + ... + t_k + (n - k) t_k

(processor sharing: until the shortest ends, everyone runs at 1 / n; then the rest split the link). The
link is work-conserving, so the last flow ends at the sum of all wire times, as if they had run one
after the other: that is why the per-micro-batch gathers and reduce-scatters that overlap a layer's
compute on one link are priced by the sum of their times (estimate._sharding_comm). What sharing
changes is who finishes when: a pipeline send that leaves beside a DP reduction arrives up to twice as
late (`shared_send_delay_s`), and a reduction issued only after that send has finished (Commshift)
lets the send go at the full rate instead. Where the two leave through different links (a send over
NVLink or loopback beside an inter-node reduction), nothing is shared and nothing changes.

Only the wire part of a transfer shares (its bandwidth term on an inter-node link): latency, per-call
overheads and intra-node work are per flow.
"""

from __future__ import annotations

from typing import Sequence


def fair_share_finish_s(wire_s: Sequence[float]) -> tuple[float, ...]:
    """When each flow ends (seconds after they all start on one link), in the order given.

    Args:
        wire_s: each flow's wire time alone on the link (bytes over the link's bandwidth); >= 0.
    """
    if any(t < 0 for t in wire_s):
        raise ValueError(f"wire times must be >= 0, got {tuple(wire_s)}")
    order = sorted(range(len(wire_s)), key=lambda i: wire_s[i])
    finish = [0.0] * len(wire_s)
    done_s = 0.0  # sum of the wire times of the flows that already ended
    for k, i in enumerate(order):
        remaining = len(wire_s) - k - 1  # flows still running when flow i ends, at i's progress
        finish[i] = done_s + wire_s[i] * (1 + remaining)
        done_s += wire_s[i]
    return tuple(finish)


def shared_send_delay_s(send_wire_s: float, *, other_wire_s: float) -> float:
    """Extra seconds a send takes when another flow with `other_wire_s` of wire time starts beside it on
    the same link: min(send, other), up to doubling the send (the other flow is slowed by as much)."""
    send_end, _ = fair_share_finish_s((send_wire_s, other_wire_s))
    return send_end - send_wire_s
