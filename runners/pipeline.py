"""Pipeline-parallel executor: runs one rank's schedule (specs.schedule action lists) over isend/irecv.

The schedule is ours rather than torch.distributed.pipelining's so that data-parallel communication can
be placed precisely inside it (Commshift: the DP gradient reduction of a chunk is issued after the
chunk's last input-gradient send, `after_last_backward`; where nothing follows on the rank, once that send
has arrived, so that the two do not share a link).

Execution is a two-step affair. `rank_program` turns the action list into a flat program of
point-to-point steps (post a receive, wait for it, run an action, send its output, call the hook); the
program is a pure function of the schedule, so its ordering is unit-tested without processes.
`run_pipeline` interprets it.

Message matching. Gloo matches a receive to a send by (peer, tag), so any order works as long as nothing
waits on a message whose sender is itself waiting. NCCL ignores tags and matches the k-th send from A to B
with the k-th receive on B from A, on one stream per rank pair that executes its operations in issue
order; a receive posted ahead of a send on that stream blocks the send. Given every rank's action list
(`schedule_table`), both ends of every pair issue their operations in one global message order (a fixed
topological execution of the whole schedule, `message_order`), which matches by construction and cannot
deadlock. Without the table the program posts each receive just before it is needed (plus a one-action
prefetch), which is correct only on a tag-matching backend.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
import torch.distributed as dist
from torch import Tensor, nn

from specs.schedule import BACKWARD, FORWARD, Action
from runners.comm import Comm

ACTIVATION = 0  # output of chunk c, sent to chunk c + 1
GRADIENT = 1  # gradient of chunk c's input, sent to chunk c - 1


@dataclass(frozen=True)
class Message:
    kind: int  # ACTIVATION or GRADIENT
    src_chunk: int
    micro_batch: int

    @property
    def dst_chunk(self) -> int:
        return self.src_chunk + 1 if self.kind == ACTIVATION else self.src_chunk - 1


def message_tag(message: Message, *, num_chunks: int, num_micro_batches: int) -> int:
    """A tag unique to (kind, source chunk, micro-batch), so the interleaved schedule's many messages
    between one pair of ranks cannot be confused on a tag-matching backend."""
    return (message.kind * num_chunks + message.src_chunk) * num_micro_batches + message.micro_batch


def input_message(action: Action, *, num_chunks: int) -> Message | None:
    """The message an action consumes: the previous chunk's activation, or the next chunk's gradient."""
    if action.kind == FORWARD:
        return Message(ACTIVATION, action.chunk - 1, action.micro_batch) if action.chunk > 0 else None
    if action.chunk < num_chunks - 1:
        return Message(GRADIENT, action.chunk + 1, action.micro_batch)
    return None


def output_message(action: Action, *, num_chunks: int) -> Message | None:
    if action.kind == FORWARD:
        return Message(ACTIVATION, action.chunk, action.micro_batch) if action.chunk < num_chunks - 1 else None
    return Message(GRADIENT, action.chunk, action.micro_batch) if action.chunk > 0 else None


# --- the program ------------------------------------------------------------------------------------
POST, WAIT, RUN, SEND, HOOK = "post", "wait", "run", "send", "hook"


@dataclass(frozen=True)
class Step:
    op: str  # POST | WAIT | SEND (message), RUN (action), HOOK (chunk)
    message: Message | None = None
    action: Action | None = None
    chunk: int = -1
    # HOOK only: the input-gradient send (`message`) must finish before the hook runs. Set where the
    # chunk's last backward is the rank's last action, so waiting stalls no compute (Commshift: the
    # reduction then leaves after the send instead of sharing the link with it, cost_models/linkshare.py).
    after_send: bool = False


def message_order(table: tuple[tuple[Action, ...], ...], *, num_chunks: int) -> dict[Message, int]:
    """A sequence number for every message: the order in which a fixed topological execution of all
    ranks' action lists produces them (round-robin over ranks, each running as far as it can, as in
    specs.schedule.check_executable). Every rank computes the same order from the same table."""
    order: dict[Message, int] = {}
    done: set[tuple[str, int, int]] = set()
    cursor = [0] * len(table)
    while any(cursor[r] < len(table[r]) for r in range(len(table))):
        progressed = False
        for rank, actions in enumerate(table):
            while cursor[rank] < len(actions):
                action = actions[cursor[rank]]
                need = input_message(action, num_chunks=num_chunks)
                ready = need is None or need in order
                if action.kind == BACKWARD:
                    ready = ready and (FORWARD, action.chunk, action.micro_batch) in done
                if not ready:
                    break
                done.add((action.kind, action.chunk, action.micro_batch))
                out = output_message(action, num_chunks=num_chunks)
                if out is not None:
                    order[out] = len(order)
                cursor[rank] += 1
                progressed = True
        if not progressed:
            raise ValueError(f"schedule deadlocks at cursors {cursor}")
    return order


class _Issuer:
    """Emits POST and SEND steps; in ordered mode, per peer strictly in the global message order."""

    def __init__(self, *, pp_rank: int, pp: int, order: dict[Message, int] | None) -> None:
        self.pp_rank, self.pp, self.ordered = pp_rank, pp, order is not None
        self.steps: list[Step] = []
        self.issued: set[Message] = set()
        self.queues: dict[int, list[Message]] = defaultdict(list)
        self.cursor: dict[int, int] = defaultdict(int)
        for message in sorted(order, key=order.get) if order else ():
            src, dst = message.src_chunk % pp, message.dst_chunk % pp
            if pp_rank in (src, dst):
                self.queues[dst if src == pp_rank else src].append(message)

    def peer(self, message: Message) -> int:
        src, dst = message.src_chunk % self.pp, message.dst_chunk % self.pp
        return dst if src == self.pp_rank else src

    def issue(self, message: Message, *, required: bool) -> bool:
        """Issue `message`'s receive or send (and, ordered, every earlier operation with its peer).

        Returns False if an earlier send to the peer has not been produced yet: then the receive cannot
        be posted now without breaking the pair's order (only allowed for prefetches)."""
        if message in self.issued:
            return True
        if not self.ordered:
            self._emit(message)
            return True
        peer = self.peer(message)
        queue = self.queues[peer]
        while True:
            assert self.cursor[peer] < len(queue), f"{message} is not in the order with rank {peer}"
            head = queue[self.cursor[peer]]
            is_send = head.src_chunk % self.pp == self.pp_rank
            if is_send and head != message:
                # An earlier send is not produced yet; the schedule's own order guarantees this never
                # happens for a receive the next action needs or for the send being issued.
                assert not required, f"{message} needed before the earlier send {head} to rank {peer}"
                return False
            self._emit(head)
            self.cursor[peer] += 1
            if head == message:
                return True

    def _emit(self, message: Message) -> None:
        is_send = message.src_chunk % self.pp == self.pp_rank
        self.steps.append(Step(SEND if is_send else POST, message=message))
        self.issued.add(message)


@lru_cache(maxsize=64)
def _cached_program(actions: tuple[Action, ...], table: tuple[tuple[Action, ...], ...] | None, pp_rank: int,
                    pp: int, num_chunks: int) -> tuple[Step, ...]:
    order = message_order(table, num_chunks=num_chunks) if table is not None else None
    issuer = _Issuer(pp_rank=pp_rank, pp=pp, order=order)
    last_backward = {a.chunk: k for k, a in enumerate(actions) if a.kind == BACKWARD}
    for k, action in enumerate(actions):
        need = input_message(action, num_chunks=num_chunks)
        if need is not None:
            issuer.issue(need, required=True)
            issuer.steps.append(Step(WAIT, message=need))
        # Prefetch the next action's input so that its transfer overlaps this action's compute.
        if k + 1 < len(actions):
            upcoming = input_message(actions[k + 1], num_chunks=num_chunks)
            if upcoming is not None:
                issuer.issue(upcoming, required=False)
        issuer.steps.append(Step(RUN, action=action))
        out = output_message(action, num_chunks=num_chunks)
        if out is not None:
            issuer.issue(out, required=True)
        if last_backward.get(action.chunk) == k:
            after_send = out is not None and k == len(actions) - 1
            issuer.steps.append(Step(HOOK, message=out if after_send else None, chunk=action.chunk,
                                     after_send=after_send))
    return tuple(issuer.steps)


def rank_program(actions: list[Action], *, pp_rank: int, pp: int, num_chunks: int,
                 schedule_table: list[list[Action]] | None = None) -> tuple[Step, ...]:
    """The p2p program of one pipeline rank: POST/WAIT/SEND steps around each RUN, a HOOK after each
    chunk's last backward. With `schedule_table` (all ranks' actions) operations with each peer follow
    the global message order (safe on order-matching NCCL); without it, receives are posted on demand."""
    table = tuple(tuple(a) for a in schedule_table) if schedule_table is not None else None
    if table is not None:
        assert table[pp_rank] == tuple(actions), "actions are not schedule_table[pp_rank]"
    return _cached_program(tuple(actions), table, pp_rank, pp, num_chunks)


# --- the interpreter ----------------------------------------------------------------------------
class _Executor:
    def __init__(self, *, chunks, micro_batches, pp_ranks, num_chunks, comm, activation_shape, dtype,
                 device, after_last_backward) -> None:
        self.chunks, self.micro_batches, self.comm = chunks, micro_batches, comm
        self.pp_ranks, self.num_chunks = pp_ranks, num_chunks
        self.activation_shape, self.dtype, self.device = tuple(activation_shape), dtype, device
        self.after_last_backward = after_last_backward
        self.pp = len(pp_ranks)
        self.received: dict[Message, tuple[Tensor, object]] = {}
        self.outbox: dict[Message, Tensor] = {}
        self.inputs: dict[tuple[int, int], Tensor] = {}
        self.outputs: dict[tuple[int, int], Tensor] = {}
        self.losses: dict[int, Tensor] = {}
        self.sends: list[tuple[object, Tensor]] = []
        self.awaited: set[Message] = set()  # the sends a HOOK step waits for (Step.after_send)
        self.send_work: dict[Message, object] = {}

    def tag(self, message: Message) -> int:
        return message_tag(message, num_chunks=self.num_chunks, num_micro_batches=len(self.micro_batches))

    def rank_of_chunk(self, chunk: int) -> int:
        return self.pp_ranks[chunk % self.pp]

    def post(self, message: Message) -> None:
        buffer = torch.empty(self.activation_shape, dtype=self.dtype, device=self.device)
        work = self.comm.irecv(buffer, src=self.rank_of_chunk(message.src_chunk), tag=self.tag(message))
        self.received[message] = (buffer, work)

    def wait(self, message: Message) -> None:
        self.comm.wait(self.received[message][1])
        if self.acknowledges(message):
            ack = torch.ones(1, device=self.device)
            work = dist.isend(ack, dst=self.rank_of_chunk(message.src_chunk), tag=self.ack_tag(message))
            self.sends.append((work, ack))

    def acknowledges(self, message: Message) -> bool:
        """Whether `message` is a rank's last input-gradient send that the sender's Commshift hook waits
        for (Step.after_send: the last backward of chunk c < pp is rank c's last action). On gloo a send
        is done once its last byte is in the TCP socket's buffer, still up to a few hundred KiB short of
        the wire, so the receiver says when it has it: only then does the reduction stop sharing the
        link with it. NCCL matches messages by order, not tag: no acknowledgement there."""
        return (self.after_last_backward is not None and self.device.type != "cuda" and message.kind == GRADIENT
                and 0 < message.src_chunk < self.pp and message.micro_batch == len(self.micro_batches) - 1)

    def ack_tag(self, message: Message) -> int:
        return 2 * self.num_chunks * len(self.micro_batches) + self.tag(message)  # past every message's tag

    def send(self, message: Message) -> None:
        tensor = self.outbox.pop(message)
        assert tuple(tensor.shape) == self.activation_shape and tensor.dtype == self.dtype, (
            f"chunk {message.src_chunk} sends {tuple(tensor.shape)} {tensor.dtype}, the pipeline expects "
            f"activation_shape {self.activation_shape} {self.dtype}")
        work = self.comm.isend(tensor, dst=self.rank_of_chunk(message.dst_chunk), tag=self.tag(message))
        # Keep the tensor alive until the transfer is done; drop finished sends to free memory early.
        self.sends = [(w, t) for w, t in self.sends if not w.is_completed()] + [(work, tensor)]
        if message in self.awaited:
            self.send_work[message] = work

    def forward(self, chunk: int, micro_batch: int) -> None:
        tokens, targets = self.micro_batches[micro_batch]
        if chunk == 0:
            x = tokens
        else:
            x = self.received.pop(Message(ACTIVATION, chunk - 1, micro_batch))[0].requires_grad_()
        out = self.chunks[chunk](x, targets)
        self.inputs[(chunk, micro_batch)], self.outputs[(chunk, micro_batch)] = x, out
        if chunk == self.num_chunks - 1:
            self.losses[micro_batch] = out.detach()
        else:
            self.outbox[Message(ACTIVATION, chunk, micro_batch)] = out.detach().contiguous()

    def backward(self, chunk: int, micro_batch: int) -> None:
        # Popping frees this micro-batch's activations as soon as its backward is done.
        x, out = self.inputs.pop((chunk, micro_batch)), self.outputs.pop((chunk, micro_batch))
        if chunk == self.num_chunks - 1:
            out.backward()
        else:
            grad = self.received.pop(Message(GRADIENT, chunk + 1, micro_batch))[0]
            torch.autograd.backward(out, grad_tensors=grad)
        if chunk > 0:
            assert x.grad is not None, f"chunk {chunk}'s output does not depend on its input"
            self.outbox[Message(GRADIENT, chunk, micro_batch)] = x.grad

    def run(self, program: tuple[Step, ...]) -> list[Tensor]:
        self.awaited = {step.message for step in program if step.op == HOOK and step.after_send}
        for step in program:
            if step.op == POST:
                self.post(step.message)
            elif step.op == WAIT:
                self.wait(step.message)
            elif step.op == RUN:
                run = self.forward if step.action.kind == FORWARD else self.backward
                run(step.action.chunk, step.action.micro_batch)
            elif step.op == SEND:
                self.send(step.message)
            elif step.op == HOOK and self.after_last_backward is not None:
                if step.after_send:  # on NCCL this holds the stream back, not the CPU
                    work = self.send_work.pop(step.message)
                    self.comm.wait(work)
                    # Waited once only: a second wait on a gloo send blocks for a send that never comes.
                    self.sends = [(w, t) for w, t in self.sends if w is not work]
                    if self.acknowledges(step.message):
                        ack = torch.empty(1, device=self.device)
                        self.comm.wait(dist.irecv(ack, src=self.rank_of_chunk(step.message.dst_chunk),
                                                  tag=self.ack_tag(step.message)))
                self.after_last_backward(step.chunk)
        for work, _ in self.sends:
            self.comm.wait(work)
        assert not (self.inputs or self.outputs or self.received or self.outbox), "pipeline state left over"
        if self.num_chunks - 1 not in self.chunks:
            return []
        return [self.losses[i] for i in range(len(self.micro_batches))]


def run_pipeline(*, actions: list[Action], chunks: dict[int, nn.Module], micro_batches: list[tuple[Tensor, Tensor]],
                 pp_ranks: list[int], num_chunks: int, comm: Comm, activation_shape: tuple[int, ...],
                 dtype: torch.dtype, device: torch.device,
                 after_last_backward: Callable[[int], None] | None = None,
                 schedule_table: list[list[Action]] | None = None) -> list[Tensor]:
    """Run this rank's pipeline actions for one step; gradients accumulate into the chunks' parameters.

    Args:
        actions: this rank's list, rank_actions(...)[pp_rank]; chunks: global chunk index -> module held
            here (chunk c on pipeline rank c % pp); pp_ranks[p]: global rank of pipeline rank p.
        activation_shape, dtype: of every message between chunks (hidden state and its gradient).
        after_last_backward: called with chunk c right after c's last input-gradient send is issued,
            or once it is done where that backward is the rank's last action (Step.after_send).
        schedule_table: every pipeline rank's actions; required on NCCL, which matches by order.
    Returns:
        The detached per-micro-batch losses on the rank holding the last chunk, [] elsewhere.
    """
    pp = len(pp_ranks)
    assert pp > 1, "run_pipeline needs at least two pipeline ranks"
    # CUDA tensors go over NCCL (alone or as the cuda half of a "cpu:gloo,cuda:nccl" group).
    if schedule_table is None and device.type == "cuda" and "nccl" in str(dist.get_backend()):
        raise ValueError("NCCL matches point-to-point messages by order, not tag: pass schedule_table "
                         "(rank_actions(...) for all pipeline ranks) to run_pipeline")
    pp_rank = pp_ranks.index(dist.get_rank())
    assert set(chunks) == set(range(pp_rank, num_chunks, pp)), (
        f"pipeline rank {pp_rank} holds chunks {sorted(chunks)}, expected {list(range(pp_rank, num_chunks, pp))}")
    program = rank_program(actions, pp_rank=pp_rank, pp=pp, num_chunks=num_chunks, schedule_table=schedule_table)
    executor = _Executor(chunks=chunks, micro_batches=micro_batches, pp_ranks=pp_ranks, num_chunks=num_chunks,
                         comm=comm, activation_shape=activation_shape, dtype=dtype, device=device,
                         after_last_backward=after_last_backward)
    return executor.run(program)
