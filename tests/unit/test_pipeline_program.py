"""The pipeline executor's p2p programs: complete, and safe on a transport that matches messages by order.

The simulator models NCCL's point-to-point semantics strictly: one in-order queue of operations per rank
pair and direction of issue, a send completes only together with the matching receive at the head of the
peer's queue (rendezvous, no eager buffering), and a WAIT blocks its rank until the receive completed.
"""

import itertools
from collections import defaultdict, deque

import pytest

from specs.schedule import BACKWARD, rank_actions
from runners.pipeline import (HOOK, POST, RUN, SEND, WAIT, input_message, message_order, message_tag,
                              output_message, rank_program)

CASES = [
    *[("gpipe", pp, 1, m) for pp, m in itertools.product((2, 3, 4), (1, 3, 8))],
    *[("1f1b", pp, 1, m) for pp, m in itertools.product((2, 3, 4), (1, 2, 5, 8))],
    *[("interleaved-1f1b", pp, v, m) for pp, v, m in itertools.product((2, 4), (2, 3), (4, 8, 12)) if m % pp == 0],
]


def programs(schedule, pp, v, m, *, ordered):
    table = rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m)
    return [rank_program(table[r], pp_rank=r, pp=pp, num_chunks=pp * v, schedule_table=table if ordered else None)
            for r in range(pp)]


def simulate_order_matched(progs, *, pp):
    """Run the programs under NCCL-like matching; raise AssertionError on a mismatch or a deadlock."""
    queues = defaultdict(deque)  # (rank, peer) -> issued ("send"|"recv", message)
    received, pc = set(), [0] * pp

    def peer_of(rank, message):
        src, dst = message.src_chunk % pp, message.dst_chunk % pp
        return dst if src == rank else src

    while True:
        progressed = False
        for rank, prog in enumerate(progs):
            while pc[rank] < len(prog):
                step = prog[pc[rank]]
                if step.op in (POST, SEND):
                    queues[(rank, peer_of(rank, step.message))].append(("recv" if step.op == POST else "send", step.message))
                elif step.op == WAIT and step.message not in received:
                    break
                pc[rank] += 1
                progressed = True
        for a, b in itertools.combinations(range(pp), 2):
            qa, qb = queues[(a, b)], queues[(b, a)]
            while qa and qb:
                (op_a, msg_a), (op_b, msg_b) = qa[0], qb[0]
                assert msg_a == msg_b and op_a != op_b, f"ranks {a},{b} mismatch: {qa[0]} vs {qb[0]}"
                qa.popleft(), qb.popleft()
                received.add(msg_a)
                progressed = True
        if all(pc[r] == len(progs[r]) for r in range(pp)):
            assert not any(queues.values()), f"unmatched operations left: {dict(queues)}"
            return
        assert progressed, f"deadlock at program counters {pc}"


@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_ordered_programs_match_and_finish_under_order_matching(schedule, pp, v, m):
    simulate_order_matched(programs(schedule, pp, v, m, ordered=True), pp=pp)


def test_on_demand_programs_break_order_matching():
    # The negative control: posting receives on demand mismatches on NCCL in plain 1F1B, which is why
    # the executor wants the whole schedule table there.
    with pytest.raises(AssertionError, match="mismatch|deadlock"):
        simulate_order_matched(programs("1f1b", 2, 1, 4, ordered=False), pp=2)


@pytest.mark.parametrize("ordered", [True, False])
@pytest.mark.parametrize("schedule,pp,v,m", CASES)
def test_every_input_is_received_before_use_and_every_output_sent(schedule, pp, v, m, ordered):
    num_chunks = pp * v
    table = rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m)
    for rank, prog in enumerate(programs(schedule, pp, v, m, ordered=ordered)):
        posted, waited, sent, hooks = set(), set(), [], []
        for k, step in enumerate(prog):
            if step.op == POST:
                assert step.message not in posted
                posted.add(step.message)
            elif step.op == WAIT:
                assert step.message in posted
                waited.add(step.message)
            elif step.op == RUN:
                need = input_message(step.action, num_chunks=num_chunks)
                assert need is None or need in waited
            elif step.op == SEND:
                sent.append(step.message)
                assert prog[k - 1].op in (RUN, POST, SEND)
            elif step.op == HOOK:
                hooks.append((step.chunk, k))
        assert posted == waited == {input_message(a, num_chunks=num_chunks) for a in table[rank]} - {None}
        assert sent == [o for a in table[rank] if (o := output_message(a, num_chunks=num_chunks)) is not None]
        # One hook per chunk, right after that chunk's last backward (and its gradient send, if any).
        assert sorted(c for c, _ in hooks) == list(range(rank, num_chunks, pp))
        for chunk, k in hooks:
            last_b = max(i for i, s in enumerate(prog) if s.op == RUN and s.action.kind == BACKWARD
                         and s.action.chunk == chunk)
            between = prog[last_b + 1:k]
            assert all(s.op in (POST, SEND) for s in between)
            if chunk > 0:
                grad = output_message(prog[last_b].action, num_chunks=num_chunks)
                assert any(s.op == SEND and s.message == grad for s in between)


def test_message_order_is_a_topological_order_and_tags_are_unique():
    pp, v, m = 4, 2, 8
    table = rank_actions(schedule="interleaved-1f1b", pp=pp, virtual_stages=v, num_micro_batches=m)
    order = message_order(tuple(map(tuple, table)), num_chunks=pp * v)
    assert len(order) == 2 * (pp * v - 1) * m
    for msg, seq in order.items():
        if msg.kind == 0 and msg.src_chunk > 0:  # an activation follows the one its forward consumed
            assert order[type(msg)(0, msg.src_chunk - 1, msg.micro_batch)] < seq
    tags = {message_tag(msg, num_chunks=pp * v, num_micro_batches=m) for msg in order}
    assert len(tags) == len(order)


def test_actions_must_be_this_ranks_row_of_the_table():
    table = rank_actions(schedule="1f1b", pp=2, virtual_stages=1, num_micro_batches=4)
    with pytest.raises(AssertionError, match="schedule_table"):
        rank_program(table[0], pp_rank=1, pp=2, num_chunks=2, schedule_table=table)
