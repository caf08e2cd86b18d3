"""The step's timeline: the pipeline schedule simulated from `rank_actions`, with the DP reduction.

Every rank runs its action list in order; an action starts when the rank is free and its input has
arrived: F(c, m) after F(c - 1, m) plus one point-to-point transfer, B(c, m) after B(c + 1, m) plus one
transfer (and after F(c, m), which the rank order already implies). Sends are asynchronous, so a
transfer delays only the receiver (sends overlap the sender's next compute).

Durations are per chunk and already include the chunk's exposed TP communication and the part of its
per-micro-batch DP/ZeRO communication (gathers, reduce-scatters) that the separate communication stream
cannot hide. What is left is the step-end gradient reduction of each chunk (`reduce_s`), which the
schedule places in one of two ways (the `commshift` argument names the second; estimate.py decides
which one a plan runs, and with what durations):

* inside the last backward: the reduction of chunk c is issued bucket by bucket as gradients become
  ready and the send of that backward's input gradient waits for it, so the action lasts
  max(backward, reduction - last bucket) + last bucket and every stage's reduction sits on the
  critical path of the upstream stages' cool-down (an engine that queues both on one ordered stream);
* on the communication stream: the last backward ends and sends; the reduction (or what is left of it)
  runs on the rank's communication stream from `reduce_start_s` after that backward's end and overlaps
  the upstream stages' remaining backwards; the rank waits for it just before the optimizer step. A
  send that shares its link with the reduction arrives `last_send_delay_s` later (linkshare.py).

A simulation of many micro-batches is long (pp = 16 and 1024 micro-batches are 32768 actions), and
the makespan is not linear in the micro-batch count from any fixed count on (constant terms such as the
step-end reductions can dominate a slower-growing path for a long time), so extrapolating the makespan
itself is not exact. What is exact:

* 1F1B and interleaved 1F1B: every rank's steady phase is a sequence of identical blocks (one
  forward/backward pair, or pp x virtual_stages pairs for interleaving, which shift micro-batches by
  one period); block k of every rank depends only on blocks k and k - 1 (`_compiled` checks this), so
  once the end times of block k equal those of block k - c plus one constant on every rank (c = 1
  usually; transfer delays can make the steady state repeat every c > 1 blocks), every later block
  repeats them (max-plus algebra is shift-invariant), and a step with n more cycles is the simulated
  one with the rest of its timeline shifted by n times that constant. `simulate` runs the shortest
  pipeline that reaches this state and shifts; if the state does not repeat in time it doubles the
  simulated count, up to the full simulation. The check is on the whole state, not on the makespan,
  so it cannot be fooled by a makespan that looks linear for a while.
* GPipe is two open flow shops (all forwards, then all backwards), solved in closed form
  (`_gpipe_closed_form`): the longest path rides the slowest rank for all the repeated work.

The unit tests compare both with the full simulation.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from specs.schedule import FORWARD, execution_order, rank_actions


@dataclass(frozen=True)
class ChunkDurations:
    """Per-chunk seconds of one micro-batch's forward and backward action and of the step-end reduction."""

    forward_s: tuple[float, ...]
    backward_s: tuple[float, ...]
    p2p_s: float  # one activation (or its gradient) between adjacent chunks
    reduce_s: tuple[float, ...]  # step-end DP reduction of each chunk's gradients
    last_bucket_s: tuple[float, ...]  # the part of reduce_s that cannot start before the backward ends
    # Under commshift, each chunk's last backward without the reductions it no longer issues (the
    # last micro-batch's reduce-scatter moves to reduce_s); None: the same as backward_s.
    shift_backward_s: tuple[float, ...] | None = None
    # Extra seconds on the transfer of each chunk's last input gradient, on top of p2p_s: the send
    # slowed by a reduction leaving beside it on the same link (cost_models/linkshare.py); None: 0.
    last_send_delay_s: tuple[float, ...] | None = None
    # In the commshift mode, seconds after each chunk's last backward ends at which its reduction starts
    # on the communication stream (the engine issues it once the last send is done); None: 0.
    reduce_start_s: tuple[float, ...] | None = None

    def send_delay(self, chunk: int) -> float:
        return self.last_send_delay_s[chunk] if self.last_send_delay_s is not None else 0.0

    def reduce_start(self, chunk: int) -> float:
        return self.reduce_start_s[chunk] if self.reduce_start_s is not None else 0.0

    def last_backward_s(self, commshift: bool) -> list[float]:
        """Each chunk's last backward: without commshift it carries its reduction (all but the last
        bucket overlapping the backward); with it, the reduction goes to the communication stream."""
        if commshift:
            return list(self.shift_backward_s if self.shift_backward_s is not None else self.backward_s)
        return [b if r <= 0.0 else max(b, r - lb) + lb
                for b, r, lb in zip(self.backward_s, self.reduce_s, self.last_bucket_s)]


@dataclass(frozen=True)
class PipelineResult:
    """Per pipeline rank: when its compute ends, when its communication stream ends, its busy seconds."""

    compute_end_s: tuple[float, ...]
    comm_end_s: tuple[float, ...]
    busy_s: tuple[float, ...]


@dataclass(frozen=True)
class _Compiled:
    """A schedule's actions in one dependency-respecting order, as flat tuples
    (rank, is_forward, chunk, index of the cross-rank dependency or -1, is the chunk's last backward),
    and its steady blocks: `blocks[r, k, j]` is the order index of the j-th action of block k on rank r."""

    order: tuple[tuple, ...]
    blocks: np.ndarray  # (pp, num_blocks, block_len), or an empty array when there is no steady phase
    first_checkable: int  # smallest k whose blocks k and later depend only on blocks k and k - 1
    special: tuple[bool, ...]  # block k holds some chunk's last backward

    @functools.cached_property
    def columns(self) -> tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...], tuple[int, ...]]:
        """(rank, dependency, duration slot, index of each last backward): the order as columns, with
        duration slot c for F of chunk c and num_chunks + c for B, for the simulation's inner loop."""
        num_chunks = 1 + max(a[2] for a in self.order)
        ranks = tuple(a[0] for a in self.order)
        deps = tuple(a[3] for a in self.order)
        slots = tuple(a[2] if a[1] else num_chunks + a[2] for a in self.order)
        lasts = tuple(i for i, a in enumerate(self.order) if a[4])
        return ranks, deps, slots, lasts


def _topological(per_rank, num_chunks: int):
    """Interleave the ranks' lists into one order in which every action follows its dependency."""
    last_backward = {a.chunk: a.micro_batch for actions in per_rank for a in actions if a.kind != FORWARD}
    index: dict[tuple[str, int, int], int] = {}
    order: list[tuple] = []
    position: list[tuple[int, int]] = []  # (rank, position in the rank's list) of each order entry
    for rank, pos, a, dep in execution_order(per_rank, num_chunks=num_chunks):
        forward = a.kind == FORWARD
        index[(a.kind, a.chunk, a.micro_batch)] = len(order)
        order.append((rank, forward, a.chunk, -1 if dep is None else index[dep],
                      (not forward) and last_backward[a.chunk] == a.micro_batch))
        position.append((rank, pos))
    return order, position


@functools.lru_cache(maxsize=256)
def _compiled(schedule: str, pp: int, virtual_stages: int, num_micro_batches: int) -> _Compiled:
    per_rank = rank_actions(schedule=schedule, pp=pp, virtual_stages=virtual_stages,
                            num_micro_batches=num_micro_batches)
    order, position = _topological(per_rank, pp * virtual_stages)
    if schedule == "gpipe":
        return _Compiled(tuple(order), np.zeros((0, 0, 0), dtype=np.int64), 0, ())
    # Steady phase of rank r: forward/backward pairs from its first backward's preceding forward on.
    pairs_per_block = virtual_stages * (pp if schedule == "interleaved-1f1b" else 1)
    block_len = 2 * pairs_per_block
    starts = []
    for actions in per_rank:
        first_backward = next(i for i, a in enumerate(actions) if a.kind != FORWARD)
        starts.append(max(0, first_backward - 1))
    num_blocks = min((len(per_rank[r]) - starts[r]) // block_len for r in range(pp))
    # A rank's steady pairs end where its cool-down (backwards only) begins.
    num_blocks = min([num_blocks] + [sum(1 for a in per_rank[r][starts[r]:] if a.kind == FORWARD) // pairs_per_block
                                     for r in range(pp)])
    if num_blocks < 1:
        return _Compiled(tuple(order), np.zeros((0, 0, 0), dtype=np.int64), 0, ())
    where = {pos: i for i, pos in enumerate(position)}
    blocks = np.empty((pp, num_blocks, block_len), dtype=np.int64)
    block_of: dict[int, tuple[int, int]] = {}
    for r in range(pp):
        for k in range(num_blocks):
            for j in range(block_len):
                i = where[(r, starts[r] + k * block_len + j)]
                blocks[r, k, j] = i
                block_of[i] = (r, k)
    # Blocks whose actions reach outside (the warm-up) or further back than the previous block.
    first_checkable = 1
    for i, (r, k) in block_of.items():
        rank, pos = position[i]
        deps = [order[i][3]] + ([where[(rank, pos - 1)]] if pos > 0 else [])
        for dep in deps:
            if dep < 0:
                continue
            dep_block = block_of.get(dep)
            if dep_block is None or k - dep_block[1] not in (0, 1):
                first_checkable = max(first_checkable, k + 1)
    special = tuple(bool(any(order[i][4] for i in blocks[:, k, :].ravel())) for k in range(num_blocks))
    return _Compiled(tuple(order), blocks, first_checkable, special)


def _run(compiled: _Compiled, pp: int, d: ChunkDurations, commshift: bool) -> tuple[PipelineResult, list[float]]:
    ranks, deps, slots, lasts = compiled.columns
    num_chunks = len(d.forward_s)
    last_duration = d.last_backward_s(commshift)
    slot_duration = list(d.forward_s) + list(d.backward_s)
    durations = [slot_duration[k] for k in slots]
    for i in lasts:
        durations[i] = last_duration[slots[i] - num_chunks]
    end = [0.0] * len(ranks)
    rank_free = [0.0] * pp
    p2p = d.p2p_s
    # Extra transfer seconds of the message each action sends (only last backwards have any).
    extra = None
    if d.last_send_delay_s is not None and any(d.last_send_delay_s):
        extra = [0.0] * len(ranks)
        for i in lasts:
            extra[i] = d.last_send_delay_s[slots[i] - num_chunks]
    for i, rank in enumerate(ranks):
        start = rank_free[rank]
        dep = deps[i]
        if dep >= 0:
            arrive = end[dep] + p2p if extra is None else end[dep] + p2p + extra[dep]
            if arrive > start:
                start = arrive
        end[i] = rank_free[rank] = start + durations[i]
    comm_free = [0.0] * pp
    if commshift:
        for i in lasts:  # in order, so each rank's reductions queue on its stream
            chunk = slots[i] - num_chunks
            if d.reduce_s[chunk] > 0.0:
                comm_free[ranks[i]] = max(comm_free[ranks[i]], end[i] + d.reduce_start(chunk)) + d.reduce_s[chunk]
    busy = [0.0] * pp
    for rank, duration in zip(ranks, durations):
        busy[rank] += duration
    return PipelineResult(tuple(rank_free), tuple(comm_free), tuple(busy)), end


def simulate_full(*, schedule: str, pp: int, virtual_stages: int, num_micro_batches: int,
                  durations: ChunkDurations, commshift: bool) -> PipelineResult:
    """Simulate every action of the step."""
    compiled = _compiled(schedule, pp, virtual_stages, num_micro_batches)
    return _run(compiled, pp, durations, commshift)[0]


def _steady_shift(compiled: _Compiled, end: list[float]) -> tuple[int, float] | None:
    """(c, shift): the last checkable steady block repeats the block c before it plus `shift` on every
    rank (max-plus periodicity of cyclicity c, which pipeline transfers can make larger than 1), or None."""
    num_blocks = compiled.blocks.shape[1] if compiled.blocks.ndim == 3 else 0
    k = num_blocks - 1
    if k >= 1 and compiled.special[k]:
        k -= 1  # the insertion point must precede every chunk's last backward
    if k < 1 or compiled.special[k]:
        return None
    ends = np.asarray(end)
    tolerance = 1e-12 * max(1.0, abs(float(ends.max())))
    latest = ends[compiled.blocks[:, k, :]]
    for cycle in range(1, k + 1):
        # The recurrence must hold from block k - cycle + 1 on, with no last backward in the repeated blocks.
        if k - cycle + 1 < compiled.first_checkable or any(compiled.special[k - cycle:k + 1]):
            return None
        shift = latest - ends[compiled.blocks[:, k - cycle, :]]
        lo, hi = float(shift.min()), float(shift.max())
        if hi - lo <= tolerance:
            return cycle, lo
    return None


def _gpipe_closed_form(*, pp: int, m: int, d: ChunkDurations, commshift: bool) -> PipelineResult:
    """GPipe's makespan per rank without simulating (one chunk per rank).

    Forwards form a flow shop of identical jobs: the longest path to F(r, m - 1) rides the slowest rank
    up to r for the m - 1 repeated jobs, F_end(r) = sum_{q <= r} f_q + r p2p + (m - 1) max_{q <= r} f_q.
    Backwards run from the last rank down, rank j starting after its own forwards (R_j = F_end(j)); the
    longest path to B(r, m - 1) starts at some rank j >= r, rides some rank t in [r, j] for the repeated
    jobs, and its last job is each rank's last backward (duration b'_q, with the step-end reduction
    when commshift is off): G_t = max(R_t, G_{t+1} + b_{t+1} + p2p),
    H_r = max(G_r + (m - 1) b_r + b'_r, H_{r+1} + b'_r + p2p).
    """
    f, b, p = d.forward_s, d.backward_s, d.p2p_s
    last = d.last_backward_s(commshift)
    release, total, slowest = [], 0.0, 0.0
    for r in range(pp):
        total += f[r]
        slowest = max(slowest, f[r])
        release.append(total + r * p + (m - 1) * slowest)
    g = [0.0] * pp
    h = [0.0] * pp
    for r in reversed(range(pp)):
        g[r] = release[r] if r == pp - 1 else max(release[r], g[r + 1] + b[r + 1] + p)
        ride = g[r] + (m - 1) * b[r] + last[r]
        h[r] = ride if r == pp - 1 else max(ride, h[r + 1] + last[r] + p + d.send_delay(r + 1))
    comm = tuple(h[r] + d.reduce_start(r) + d.reduce_s[r] if commshift and d.reduce_s[r] > 0.0 else 0.0
                 for r in range(pp))
    busy = tuple(m * (f[r] + b[r]) - b[r] + last[r] for r in range(pp))
    return PipelineResult(tuple(h), comm, busy)


@functools.lru_cache(maxsize=256)
def _shortest_checkable(schedule: str, pp: int, virtual_stages: int, period: int) -> int:
    """The fewest micro-batches (a multiple of the period, more than pp) whose steady phase has enough
    blocks to check a cycle of 2 after the blocks that still reach into the warm-up."""
    count = period * (pp // period + 1)
    while True:
        compiled = _compiled(schedule, pp, virtual_stages, count)
        if compiled.blocks.ndim == 3 and compiled.blocks.shape[1] >= compiled.first_checkable + 2:
            return count
        count += period


def _extrapolated(schedule: str, pp: int, virtual_stages: int, m: int, d: ChunkDurations,
                  commshift: bool) -> PipelineResult | None:
    """The step of m micro-batches from a shorter simulation whose steady state repeats (module doc)."""
    period = pp if schedule == "interleaved-1f1b" else 1
    simulated = _shortest_checkable(schedule, pp, virtual_stages, period)
    while simulated < m:
        compiled = _compiled(schedule, pp, virtual_stages, simulated)
        result, end = _run(compiled, pp, d, commshift)
        found = _steady_shift(compiled, end)
        if found is None:
            simulated = 2 * simulated + (m - 2 * simulated) % period
            continue
        cycle, shift = found
        blocks_added = (m - simulated) // period
        if blocks_added % cycle:
            # Insert whole cycles only: simulate the remainder (the repeating state persists).
            simulated += (blocks_added % cycle) * period
            continue
        offset = shift * (blocks_added // cycle)
        per_rank_work = [sum(d.forward_s[c] + d.backward_s[c] for c in range(r, pp * virtual_stages, pp))
                         for r in range(pp)]
        return PipelineResult(
            tuple(x + offset for x in result.compute_end_s),
            tuple(x + offset if x > 0.0 else 0.0 for x in result.comm_end_s),
            tuple(x + (m - simulated) * w for x, w in zip(result.busy_s, per_rank_work)))
    return None


def simulate(*, schedule: str, pp: int, virtual_stages: int, num_micro_batches: int,
             durations: ChunkDurations, commshift: bool) -> PipelineResult:
    """The step's pipeline: closed form for GPipe, a shifted short simulation for 1F1B and interleaved
    1F1B once their steady state repeats, else the full simulation (see the module docstring)."""
    if schedule == "gpipe":
        return _gpipe_closed_form(pp=pp, m=num_micro_batches, d=durations, commshift=commshift)
    result = _extrapolated(schedule, pp, virtual_stages, num_micro_batches, durations, commshift)
    if result is not None:
        return result
    return simulate_full(schedule=schedule, pp=pp, virtual_stages=virtual_stages,
                         num_micro_batches=num_micro_batches, durations=durations, commshift=commshift)


@dataclass(frozen=True)
class Span:
    """One action of the simulated step on its pipeline rank: kind "F" or "B" on the compute stream, or
    "R" (the step-end DP reduction of `chunk` on the communication stream, under commshift)."""

    rank: int
    kind: str
    chunk: int
    micro_batch: int
    start_s: float
    end_s: float
    last_backward: bool = False  # the chunk's last backward: without commshift it carries the reduction


def action_spans(*, schedule: str, pp: int, virtual_stages: int, num_micro_batches: int,
                 durations: ChunkDurations, commshift: bool) -> list[Span]:
    """Every action's start and end in the full simulation (`simulate_full`'s timeline, for pictures;
    estimate() prices with `simulate`, which agrees with it). Starts follow the module docstring's rule:
    an action starts when its rank is free and its input has arrived (the dependency's end plus one
    transfer); under commshift each chunk's reduction queues on the rank's communication stream after
    its last backward."""
    compiled = _compiled(schedule, pp, virtual_stages, num_micro_batches)
    per_rank = rank_actions(schedule=schedule, pp=pp, virtual_stages=virtual_stages,
                            num_micro_batches=num_micro_batches)
    _order, position = _topological(per_rank, pp * virtual_stages)
    _, end = _run(compiled, pp, durations, commshift)
    ranks, deps, _slots, _lasts = compiled.columns
    rank_free = [0.0] * pp
    comm_free = [0.0] * pp
    spans: list[Span] = []
    for i, (rank, dep) in enumerate(zip(ranks, deps)):
        if dep < 0:
            start = rank_free[rank]
        else:
            delay = durations.send_delay(compiled.order[dep][2]) if compiled.order[dep][4] else 0.0
            start = max(rank_free[rank], end[dep] + durations.p2p_s + delay)
        rank_free[rank] = end[i]
        action = per_rank[rank][position[i][1]]
        is_last = compiled.order[i][4]
        spans.append(Span(rank, action.kind, action.chunk, action.micro_batch, start, end[i], is_last))
        if is_last and commshift and durations.reduce_s[action.chunk] > 0.0:
            begin = max(comm_free[rank], end[i] + durations.reduce_start(action.chunk))
            comm_free[rank] = begin + durations.reduce_s[action.chunk]
            spans.append(Span(rank, "R", action.chunk, action.micro_batch, begin, comm_free[rank]))
    return spans
