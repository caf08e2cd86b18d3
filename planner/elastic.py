"""The plan for every world size an elastic run may have, and the checkpoint cadence from the failure rate.

    planner run --cluster --elastic 1:2 --hardware cpu --checkpoint-dir ckpt --mtbf 3600 --max-restarts 3

Re-planning is done here, up front, and handed to the runner as a table keyed by world size
(RunConfig.elastic_plans), rather than by a callback each worker makes into the search at start-up:
- the rooms: runners/ must not import planner/ (the search); a table is plain data the runner reads;
- agreement: every rank of a new world reads the same entry with no communication and no chance of
  two ranks searching on different inputs (a search per restart would have to be broadcast);
- speed: a restart pays a look-up, not a search; the searches (0.1-0.3 s each for the tiny model) are
  paid once, before any process starts;
- early refusal: a world size for which no plan fits is an error before training, not after a failure.
The price: the worlds are fixed at launch (whole nodes between MIN and MAX, each with the same number
of processes), and every world keeps the model, sequence length and global batch; the search re-splits
the batch into micro-batches for each world.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

from cost_models.estimate import Estimate
from specs.errors import PlannerError
from specs.problem import Problem
from runners.config import WorldPlan


@dataclass(frozen=True)
class ElasticTable:
    """The searched plan for each world size, and what the searches took."""

    entries: tuple[WorldPlan, ...]
    estimates: dict[int, Estimate]  # world size -> the winner's estimate
    search_time_s: float

    def plan_for(self, world_size: int) -> WorldPlan:
        for entry in self.entries:
            if entry.world_size == world_size:
                return entry
        raise PlannerError(f"no elastic plan for {world_size} processes (have {[e.world_size for e in self.entries]})")


def world_sizes(*, nodes: tuple[int, int], procs_per_node: int) -> list[int]:
    """Every world an elastic run over MIN..MAX whole nodes can have."""
    return [n * procs_per_node for n in range(nodes[0], nodes[1] + 1)]


def plan_table(problem_for: Callable[[int], Problem], *, nodes: tuple[int, int], procs_per_node: int,
               engine: str = "ours") -> ElasticTable:
    """Search the best plan for each world size; `problem_for(world_size)` gives the problem on that many
    devices (same model, job and hardware)."""
    from planner.search import default_cost_model, search

    start = time.perf_counter()
    cost = default_cost_model(engine)
    entries, estimates = [], {}
    for world in world_sizes(nodes=nodes, procs_per_node=procs_per_node):
        problem = problem_for(world)
        try:
            winner = search(problem, cost=cost).winner
        except PlannerError as exc:
            raise PlannerError(f"--elastic: no plan for {world} processes: {exc}") from None
        entries.append(WorldPlan(world_size=world, plan=winner.plan, predicted=winner.estimate.to_dict()))
        estimates[world] = winner.estimate
    return ElasticTable(entries=tuple(entries), estimates=estimates, search_time_s=time.perf_counter() - start)
