"""Pipeline schedules as per-rank action lists: the one definition the runner executes and the cost
model's timeline simulates.

A model of `pp * virtual_stages` chunks; chunk c lives on pipeline rank c % pp (Megatron's interleaved
placement: rank r holds chunks r, r + pp, r + 2pp, ...). F(c, m) needs the output of F(c - 1, m) and
B(c, m) needs the input gradient from B(c + 1, m); those are the point-to-point messages, implied by
the action lists rather than listed.

Sources: GPipe (Huang et al. 2019): all forwards then all backwards. 1F1B (PipeDream-Flush, Narayanan
et al. 2021): pp - r - 1 warm-up forwards, then one forward one backward. Interleaved 1F1B (Narayanan
et al., SC21, Megatron-LM's forward_backward_pipelining_with_interleaving): the same over virtual
micro-batches, in groups of pp micro-batches per chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

FORWARD = "F"
BACKWARD = "B"


@dataclass(frozen=True)
class Action:
    kind: str  # FORWARD or BACKWARD
    chunk: int  # global chunk index, 0 .. pp * virtual_stages - 1
    micro_batch: int


def rank_actions(*, schedule: str, pp: int, virtual_stages: int, num_micro_batches: int) -> list[list[Action]]:
    """The ordered compute actions of every pipeline rank (list index = pipeline rank)."""
    if schedule == "gpipe":
        return [_gpipe(r, pp, num_micro_batches) for r in range(pp)]
    if schedule == "1f1b":
        return [_one_f_one_b(r, pp, num_micro_batches) for r in range(pp)]
    if schedule == "interleaved-1f1b":
        return [_interleaved(r, pp, virtual_stages, num_micro_batches) for r in range(pp)]
    raise ValueError(f"unknown schedule {schedule!r}")


def _gpipe(rank: int, pp: int, m: int) -> list[Action]:
    return ([Action(FORWARD, rank, i) for i in range(m)] + [Action(BACKWARD, rank, i) for i in range(m)])


def _one_f_one_b(rank: int, pp: int, m: int) -> list[Action]:
    warmup = min(pp - rank - 1, m)
    actions = [Action(FORWARD, rank, i) for i in range(warmup)]
    for i in range(m - warmup):
        actions.append(Action(FORWARD, rank, warmup + i))
        actions.append(Action(BACKWARD, rank, i))
    actions += [Action(BACKWARD, rank, i) for i in range(m - warmup, m)]
    return actions


def _interleaved(rank: int, pp: int, v: int, m: int) -> list[Action]:
    if m % pp:
        raise ValueError(f"interleaved-1f1b needs num_micro_batches ({m}) divisible by pp ({pp})")
    total = m * v

    def forward(k: int) -> Action:
        local = (k // pp) % v
        return Action(FORWARD, local * pp + rank, (k // (pp * v)) * pp + k % pp)

    def backward(k: int) -> Action:
        local = v - 1 - (k // pp) % v
        return Action(BACKWARD, local * pp + rank, (k // (pp * v)) * pp + k % pp)

    warmup = total if m == pp else min(total, (pp - rank - 1) * 2 + (v - 1) * pp)
    actions = [forward(k) for k in range(warmup)]
    for i in range(total - warmup):
        actions.append(forward(warmup + i))
        actions.append(backward(i))
    actions += [backward(k) for k in range(total - warmup, total)]
    return actions


def max_in_flight(actions: list[Action]) -> int:
    """Most micro-batch activations a rank holds at once (forwards done whose backward is not):
    what activation memory scales with under the schedule."""
    live = peak = 0
    for action in actions:
        live += 1 if action.kind == FORWARD else -1
        peak = max(peak, live)
    return peak


def execution_order(per_rank: list[list[Action]], *, num_chunks: int):
    """Interleave the ranks' lists into one order in which every action follows its inputs.

    Sends are asynchronous, so a rank blocks only on the input it needs next: repeatedly run every
    rank's next ready action. Yields (rank, position in the rank's list, action, the key of the
    cross-chunk action it waits for or None); raises ValueError if some rank would wait forever.
    """
    done: set[tuple[str, int, int]] = set()
    cursor = [0] * len(per_rank)
    remaining = sum(len(a) for a in per_rank)
    while remaining:
        progressed = False
        for rank, actions in enumerate(per_rank):
            while cursor[rank] < len(actions):
                a = actions[cursor[rank]]
                if a.kind == FORWARD:
                    dep = None if a.chunk == 0 else (FORWARD, a.chunk - 1, a.micro_batch)
                    ready = dep is None or dep in done
                else:
                    dep = None if a.chunk == num_chunks - 1 else (BACKWARD, a.chunk + 1, a.micro_batch)
                    ready = (FORWARD, a.chunk, a.micro_batch) in done and (dep is None or dep in done)
                if not ready:
                    break
                yield rank, cursor[rank], a, dep
                done.add((a.kind, a.chunk, a.micro_batch))
                cursor[rank] += 1
                remaining -= 1
                progressed = True
        if not progressed:
            stuck = {r: per_rank[r][cursor[r]] for r in range(len(per_rank)) if cursor[r] < len(per_rank[r])}
            raise ValueError(f"schedule deadlocks; next actions per rank: {stuck}")


def check_executable(per_rank: list[list[Action]], *, num_chunks: int) -> None:
    """Raise ValueError if the action lists cannot all run to completion (see execution_order)."""
    for _ in execution_order(per_rank, num_chunks=num_chunks):
        pass
