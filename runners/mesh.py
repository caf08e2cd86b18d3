"""The device mesh: one process's coordinates and process groups under a plan.

Ranks follow Megatron-LM's order, tensor parallel innermost, then context parallel, data parallel and
pipeline: rank = ((pp_rank * dp + dp_rank) * cp + cp_rank) * tp + tp_rank (Narayanan et al., SC'21;
Megatron-LM's and torchtitan's tp-cp-dp-pp order), so a TP group is `tp` consecutive ranks and stays
inside a node whenever tp <= ranks_per_node, and a CP group fills the rest of the node before DP does.

CP ranks hold the same parameters, so the sharding engine treats the dp x cp ranks of one (pp, tp)
position as its data-parallel ranks (Megatron's data-parallel group with CP): its position is
q = dp_rank * cp + cp_rank (`shard_rank`), and every group below is over those dp x cp positions; the
formula above is then rank = (pp_rank * dp_cp + q) * tp + tp_rank.

The data-parallel sharding groups (runners/sharding/) are built from *consecutive* positions, so a
group fills a node before it spans nodes. For position q and degrees s_p | s_g | s_os | dp x cp:
- param group: the s_p positions that together hold a unit's parameters (all-gather before use);
- grad group: the s_g positions that reduce-scatter a unit's gradient;
- grad replica group: the dp / s_g positions holding the same gradient shard (boundary all-reduce);
- redistribute group: the s_os / s_p positions inside my optimizer group that share my parameter shard
  (all-gather of updated optimizer shards after the step).
- cp groups (cp > 1): the cp ranks of one (pp, dp, tp) position; `cp_a2a` its parts that exchange heads
  by all-to-all and `cp_ring` those that pass K/V around a ring (Plan.cp_split; runners/context_parallel.py).
- expert groups (MoE models, `moe=True`): the same tp x dp x cp ranks of a stage folded as etp x ep x
  expert-DP, etp innermost (Megatron-Core's parallel folding; specs/plan.py): with r = q * tp + t a rank's
  place in its stage, etp_rank = r % etp, ep_rank = (r // etp) % ep, expert-DP position e = r // (etp x ep).
  `ep` the ranks that exchange tokens by all-to-all (runners/expert_parallel.py), `etp` those that split an
  expert, and the expert sharding groups (expert_dp, expert_param, expert_grad, ...) the sharding groups
  above built over the expert-DP positions at Plan.expert_shard_degrees (`Mesh.expert_view`).
- param intra group (only when the plan has a MAZ3 "secondary" tier): the ranks of my param group inside
  my node (ZeRO++ hpZ's secondary partition, Wang et al. 2023), for the backward gather of cached layers.

Process groups are few and shared (`shared_group`): every group of one rank (tp = 1, cp = 1, ...) is one
group per rank whatever its kind, and a process that builds many meshes on one world (the batched
timing holds every compared plan's trainer; benchmarks run plans one after another) creates each group
once. A gloo group is not free while idle: each keeps its own threads (three per group here), which cost CPU
even with nothing to send, measured here at ~0.09% of a core per group per process (4 processes on 2 cores, 200 groups:
17.7% of a core each), so a set of processes holding 32 trainers' own groups ran every plan up to ~2x
slower than a fresh run of it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch.distributed as dist

from specs.errors import PlannerError


@dataclass
class Mesh:
    rank: int
    world_size: int
    ranks_per_node: int
    dp: int
    tp: int
    pp: int
    dp_rank: int
    tp_rank: int
    pp_rank: int
    cp: int
    cp_rank: int
    shard_degrees: tuple[int, int, int]
    tp_ranks: tuple[int, ...]
    dp_ranks: tuple[int, ...]
    pp_ranks: tuple[int, ...]
    param_ranks: tuple[int, ...]
    grad_ranks: tuple[int, ...]
    grad_replica_ranks: tuple[int, ...]
    redistribute_ranks: tuple[int, ...]
    param_intra_ranks: tuple[int, ...] = ()
    cp_ranks: tuple[int, ...] = ()
    cp_a2a_ranks: tuple[int, ...] = ()
    cp_ring_ranks: tuple[int, ...] = ()
    # Expert parallelism (MoE models; module docstring): sizes, my coordinates and my groups' ranks.
    ep: int = 1
    etp: int = 1
    ep_rank: int = 0
    etp_rank: int = 0
    expert_dp_rank: int = 0
    ep_ranks: tuple[int, ...] = ()
    expert_shard_degrees: tuple[int, int, int] = (1, 1, 1)
    expert_ranks: dict[str, tuple[int, ...]] = field(default_factory=dict)
    # Process groups (torch.distributed handles) keyed like the rank tuples above.
    groups: dict[str, object] = field(default_factory=dict, repr=False)

    @property
    def tp_group(self):
        return self.groups["tp"]

    @property
    def dp_group(self):
        return self.groups["dp"]

    @property
    def param_group(self):
        return self.groups["param"]

    @property
    def grad_group(self):
        return self.groups["grad"]

    @property
    def grad_replica_group(self):
        return self.groups["grad_replica"]

    @property
    def redistribute_group(self):
        return self.groups["redistribute"]

    @property
    def param_intra_group(self):
        if "param_intra" not in self.groups:
            raise PlannerError("the mesh has no intra-node parameter groups: the plan has no secondary param_cache tier")
        return self.groups["param_intra"]

    @property
    def shard_rank(self) -> int:
        """This rank's position among the dp x cp ranks that reduce and shard gradients together."""
        return self.dp_rank * self.cp + self.cp_rank

    def global_rank(self, *, pp_rank: int, dp_rank: int, tp_rank: int, cp_rank: int = 0) -> int:
        return ((pp_rank * self.dp + dp_rank) * self.cp + cp_rank) * self.tp + tp_rank

    @property
    def ep_group(self):
        return self.groups["ep"]

    @property
    def expert_dp(self) -> int:
        return self.tp * self.dp * self.cp // (self.ep * self.etp)

    def expert_view(self) -> "Mesh":
        """The mesh as the sharding engine sees the expert parameters: expert-DP as its data-parallel
        group (no CP), the expert sharding groups as its param/grad/... groups."""
        if "expert_dp" not in self.groups:
            raise PlannerError("the mesh has no expert groups: it was built for a dense model")
        kinds = ("dp", "param", "grad", "grad_replica", "redistribute")
        return dataclasses.replace(
            self, dp=self.expert_dp, cp=1, dp_rank=self.expert_dp_rank, cp_rank=0,
            shard_degrees=self.expert_shard_degrees, dp_ranks=self.expert_ranks["expert_dp"],
            param_ranks=self.expert_ranks["expert_param"], grad_ranks=self.expert_ranks["expert_grad"],
            grad_replica_ranks=self.expert_ranks["expert_grad_replica"],
            redistribute_ranks=self.expert_ranks["expert_redistribute"], param_intra_ranks=(),
            groups={k: self.groups[f"expert_{k}"] for k in kinds})


def _dp_groups(*, dp: int, s_p: int, s_g: int, s_os: int) -> dict[str, list[tuple[int, ...]]]:
    """The sharding groups as lists of DP positions, each list partitioning range(dp)."""
    kinds: dict[str, list[tuple[int, ...]]] = {"dp": [tuple(range(dp))]}
    kinds["param"] = [tuple(range(b, b + s_p)) for b in range(0, dp, s_p)]
    kinds["grad"] = [tuple(range(b, b + s_g)) for b in range(0, dp, s_g)]
    kinds["grad_replica"] = [tuple(range(r, dp, s_g)) for r in range(s_g)]
    kinds["redistribute"] = [tuple(range(b + r, b + s_os, s_p)) for b in range(0, dp, s_os) for r in range(s_p)]
    return kinds


def mesh_groups(plan, *, ranks_per_node: int = 1, moe: bool = False) -> list[tuple[str, tuple[int, ...]]]:
    """Every process group of `plan` as (kind, global ranks), in the one order all ranks create them.

    Kinds: tp, pp, dp, param, grad, grad_replica, redistribute, and with cp > 1 cp, cp_a2a, cp_ring (see
    the module docstring; `ranks_per_node` places the hierarchical kind's all-to-all part); each kind's
    groups partition the world. The sharding kinds (dp, param, ...) span the dp x cp positions.
    """
    n, tp, pp = plan.dp_cp, plan.tp, plan.pp
    s_p, s_g, s_os = plan.shard_degrees

    def to_global(p: int, q: int, t: int) -> int:
        return (p * n + q) * tp + t

    groups: list[tuple[str, tuple[int, ...]]] = []
    for p in range(pp):
        for q in range(n):
            groups.append(("tp", tuple(to_global(p, q, t) for t in range(tp))))
    for q in range(n):
        for t in range(tp):
            groups.append(("pp", tuple(to_global(p, q, t) for p in range(pp))))
    for kind, position_lists in _dp_groups(dp=n, s_p=s_p, s_g=s_g, s_os=s_os).items():
        for p in range(pp):
            for t in range(tp):
                for positions in position_lists:
                    groups.append((kind, tuple(to_global(p, q, t) for q in positions)))
    if plan.cp > 1:
        groups += _cp_groups(plan, to_global=to_global, ranks_per_node=ranks_per_node)
    if moe:
        groups += _expert_groups(plan)
    return groups


def _expert_groups(plan) -> list[tuple[str, tuple[int, ...]]]:
    """ep, etp and the expert sharding groups of every stage: place r = (e * ep + j) * etp + t in a stage of
    tp x dp x cp ranks, for expert-DP position e, EP rank j, ETP rank t (the module docstring)."""
    stage, ep, etp, edp = plan.tp * plan.dp_cp, plan.ep, plan.etp, plan.expert_dp
    s_p, s_g, s_os = plan.expert_shard_degrees
    out: list[tuple[str, tuple[int, ...]]] = []
    for p in range(plan.pp):
        def rank(e: int, j: int, t: int) -> int:
            return p * stage + (e * ep + j) * etp + t
        out += [("ep", tuple(rank(e, j, t) for j in range(ep))) for e in range(edp) for t in range(etp)]
        out += [("etp", tuple(rank(e, j, t) for t in range(etp))) for e in range(edp) for j in range(ep)]
        for kind, position_lists in _dp_groups(dp=edp, s_p=s_p, s_g=s_g, s_os=s_os).items():
            out += [(f"expert_{kind}", tuple(rank(e, j, t) for e in positions))
                    for j in range(ep) for t in range(etp) for positions in position_lists]
    return out


def _cp_groups(plan, *, to_global, ranks_per_node: int) -> list[tuple[str, tuple[int, ...]]]:
    """The CP groups of every (pp, dp, tp) position: the whole group, its all-to-all parts (consecutive CP
    ranks, inside a node) and its rings (CP ranks a2a apart), c = ring index x a2a size + a2a index."""
    cp = plan.cp
    a2a, ring = plan.cp_split(ranks_per_node=max(1, ranks_per_node))
    out: list[tuple[str, tuple[int, ...]]] = []
    for p in range(plan.pp):
        for d in range(plan.dp):
            for t in range(plan.tp):
                rank_of = [to_global(p, d * cp + c, t) for c in range(cp)]
                out.append(("cp", tuple(rank_of)))
                out += [("cp_a2a", tuple(rank_of[j * a2a + u] for u in range(a2a))) for j in range(ring)]
                out += [("cp_ring", tuple(rank_of[j * a2a + u] for j in range(ring))) for u in range(a2a)]
    return out


def param_intra_groups(plan, *, ranks_per_node: int) -> list[tuple[int, ...]]:
    """Every param group split by node (global ranks // ranks_per_node), in mesh_groups' order.

    The MAZ3 secondary tier keeps a 1/len(part) slice per rank, so every part must be equally large."""
    parts: list[tuple[int, ...]] = []
    for kind, ranks in mesh_groups(plan, ranks_per_node=ranks_per_node):
        if kind != "param":
            continue
        by_node: dict[int, list[int]] = {}
        for r in ranks:
            by_node.setdefault(r // ranks_per_node, []).append(r)
        sizes = {len(part) for part in by_node.values()}
        if len(sizes) != 1:
            raise PlannerError(f"param_cache 'secondary' needs each parameter group {ranks} spread evenly over nodes "
                               f"of {ranks_per_node} ranks; its parts have sizes {sorted(sizes)}")
        parts.extend(tuple(part) for part in by_node.values())
    return parts


# The stream each kind of group's collectives run on. NCCL runs every collective of one process group on
# one stream, in issue order, so two kinds meant to overlap need groups of their own even over the same
# ranks: the parameter all-gathers of the next units and the gradient reduce-scatters of the last ones
# (FSDP2 issues them from separate all-gather and reduce-scatter streams). Kinds of one stream that span
# the same ranks share a group (their collectives are ordered anyway).
STREAM_OF_KIND = {"tp": "tp", "pp": "pp", "cp": "cp", "cp_a2a": "cp", "cp_ring": "cp", "param": "gather", "param_intra": "gather", "redistribute": "gather",
                  "dp": "reduce", "grad": "reduce", "grad_replica": "reduce", "ep": "ep", "etp": "tp",
                  "expert_param": "gather", "expert_redistribute": "gather", "expert_dp": "reduce",
                  "expert_grad": "reduce", "expert_grad_replica": "reduce"}


def group_keys(plan, *, ranks_per_node: int, moe: bool = False) -> list[tuple[str, str, tuple[int, ...]]]:
    """(kind, stream, ranks) of every group `plan` needs, in the one order all ranks create them; the
    distinct (stream, ranks) pairs are the process groups."""
    kinds = list(mesh_groups(plan, ranks_per_node=max(1, ranks_per_node), moe=moe))
    if _uses_secondary(plan):
        kinds += [("param_intra", ranks) for ranks in param_intra_groups(plan, ranks_per_node=max(1, ranks_per_node))]
    return [(kind, STREAM_OF_KIND[kind], ranks) for kind, ranks in kinds]


def _uses_secondary(plan) -> bool:
    tiers = (plan.param_cache,) if isinstance(plan.param_cache, str) else plan.param_cache
    return "secondary" in tiers


SOLO_STREAM = "solo"
# This process's groups by (stream, ranks, timeout), for the world they were created on (module docstring).
_SHARED: dict = {"world": None, "groups": {}}


def shared_group(ranks: tuple[int, ...], *, stream: str, timeout=None):
    """The process group over `ranks` for `stream`, created on first use and reused by every later mesh
    of the same world (call on every rank, in the same order, like dist.new_group: a group missing here
    is missing on every rank, since all ranks ask for the same groups)."""
    world = dist.group.WORLD
    if _SHARED["world"] is not world:  # a new world (destroy_process_group, then init): its own groups
        _SHARED.update(world=world, groups={})
    key = (stream, tuple(ranks), timeout)
    if key not in _SHARED["groups"]:
        _SHARED["groups"][key] = dist.new_group(list(ranks), timeout=timeout)
    return _SHARED["groups"][key]


def build_mesh(plan, *, ranks_per_node: int, timeout=None, moe: bool = False) -> Mesh:
    """Create every process group of `plan` (call after dist.init_process_group, on every rank).

    Every rank creates every group in the same order (torch.distributed requires it); kinds of one
    stream over the same ranks share a group, kinds of different streams never do (`STREAM_OF_KIND`:
    e.g. ZeRO-3's param and grad groups span the same ranks but are two groups, so gathers and
    reduce-scatters overlap on NCCL). `timeout` (a timedelta) bounds each collective on the groups:
    torch gives new groups its 30-minute default, not the world group's timeout, so a hung peer would
    otherwise stall a sub-group collective that long. `moe`: also the expert groups (module docstring).
    """
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if plan.world_size != world_size:
        raise PlannerError(f"plan needs {plan.degrees_text()} processes, but the job has {world_size}")
    dp, tp, cp = plan.dp, plan.tp, plan.cp
    handles: dict[tuple[str, tuple[int, ...]], object] = {}
    mine: dict[str, tuple[str, tuple[int, ...]]] = {}
    for kind, stream, ranks in group_keys(plan, ranks_per_node=ranks_per_node, moe=moe):
        # A one-rank group carries no communication, so its stream does not matter: one per rank.
        stream = SOLO_STREAM if len(ranks) == 1 else stream
        if (stream, ranks) not in handles:
            handles[(stream, ranks)] = shared_group(ranks, stream=stream, timeout=timeout)
        if rank in ranks:
            mine[kind] = (stream, ranks)
    r = rank % (tp * cp * dp)  # my place in my pipeline stage
    return Mesh(
        ep=plan.ep, etp=plan.etp, ep_rank=(r // plan.etp) % plan.ep, etp_rank=r % plan.etp,
        expert_dp_rank=r // (plan.etp * plan.ep), ep_ranks=mine.get("ep", (None, (rank,)))[1],
        expert_shard_degrees=plan.expert_shard_degrees,
        expert_ranks={kind: ranks for kind, (_, ranks) in mine.items() if kind.startswith("expert_")},
        rank=rank, world_size=world_size, ranks_per_node=max(1, ranks_per_node), dp=dp, tp=tp, pp=plan.pp,
        dp_rank=(rank // (tp * cp)) % dp, tp_rank=rank % tp, pp_rank=rank // (tp * cp * dp), cp=cp,
        cp_rank=(rank // tp) % cp, shard_degrees=plan.shard_degrees,
        tp_ranks=mine["tp"][1], dp_ranks=mine["dp"][1], pp_ranks=mine["pp"][1], param_ranks=mine["param"][1],
        grad_ranks=mine["grad"][1], grad_replica_ranks=mine["grad_replica"][1],
        redistribute_ranks=mine["redistribute"][1], param_intra_ranks=mine.get("param_intra", (None, ()))[1],
        cp_ranks=mine.get("cp", (None, (rank,)))[1], cp_a2a_ranks=mine.get("cp_a2a", (None, (rank,)))[1],
        cp_ring_ranks=mine.get("cp_ring", (None, (rank,)))[1],
        groups={kind: handles[key] for kind, key in mine.items()},
    )
