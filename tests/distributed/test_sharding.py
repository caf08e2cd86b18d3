"""The sharding engine against single-process torch.optim.Adam, on gloo processes.

Run: timeout 600 python -m pytest -q tests/distributed/test_sharding.py

Every DP sharding point (ZeRO-0..3, HSDP, Lins mixes that need chunk permutations) trains the same small
model for 8 steps with gradient accumulation; the summed loss of every step and the final parameters
must match one process running the whole global batch with torch.optim.Adam. The same runs also give
the communication volume (checked against the ring formulas), the state bytes held (against the bytes-
per-parameter formula) and the peak live parameter bytes (ZeRO-3 below ZeRO-0).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.checkpoint import checkpoint

from specs.plan import Plan
from runners.comm import Comm
from runners.mesh import build_mesh
from runners.sharding import ShardedDataParallel, shard_chunks, state_bytes_per_param
from tests.distributed.spawn import run_on_ranks

NUM_STEPS = 8
MICRO_BATCH = 2
D_IN, D_MODEL, D_HIDDEN = 4, 8, 16
LR = 1e-2


class Block(nn.Module):
    """Residual Linear-tanh-Linear; `recompute` wraps the inner function in torch.utils.checkpoint."""

    def __init__(self, *, recompute: bool = False) -> None:
        super().__init__()
        self.lin1, self.lin2 = nn.Linear(D_MODEL, D_HIDDEN), nn.Linear(D_HIDDEN, D_MODEL)
        self.recompute = recompute

    def _inner(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.tanh(self.lin1(x)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + (checkpoint(self._inner, x, use_reentrant=False) if self.recompute else self._inner(x))


class Head(nn.Module):
    """Sum of squared errors divided by the global element count (so gradients add over ranks)."""

    def __init__(self, *, global_count: int) -> None:
        super().__init__()
        self.proj = nn.Linear(D_MODEL, D_MODEL)
        self.global_count = global_count

    def forward(self, x: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return ((self.proj(x) - target) ** 2).sum() / self.global_count


class Chunk(nn.Module):
    def __init__(self, units: list[nn.Module]) -> None:
        super().__init__()
        self.units = nn.ModuleList(units)

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        for unit in self.units:
            x = unit(x, target) if isinstance(unit, Head) else unit(x)
        return x


def make_chunks(*, num_chunks: int, global_count: int, tied: str | None = None) -> list[Chunk]:
    """Input projection, three blocks (the second recomputed), head; split into 1 or 2 chunks.

    `tied` makes the head's projection start equal to a D_MODEL -> D_MODEL input projection: "copies"
    (two parameters, the engine keeps their gradients summed) or "shared" (one module, the reference)."""
    torch.manual_seed(0)
    first = nn.Sequential(nn.Linear(D_MODEL if tied else D_IN, D_MODEL))
    units = [first, Block(), Block(recompute=True), Block(), Head(global_count=global_count)]
    if tied == "shared":
        units[-1].proj = first[0]
    elif tied == "copies":
        units[-1].proj.load_state_dict(first[0].state_dict())
    if num_chunks == 1:
        return [Chunk(units)]
    return [Chunk(units[:3]), Chunk(units[3:])]


def num_params() -> int:
    return sum(p.numel() for c in make_chunks(num_chunks=1, global_count=1) for p in c.parameters())


def global_batch(step: int, *, dp: int, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 + step)
    n = dp * m * MICRO_BATCH
    return torch.randn(n, D_MODEL, generator=gen), torch.randn(n, D_MODEL, generator=gen)


def micro_batch(x: torch.Tensor, y: torch.Tensor, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    s = slice(index * MICRO_BATCH, (index + 1) * MICRO_BATCH)
    return x[s], y[s]


def run_chunks(chunks: list[Chunk], x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    first = next(chunks[0].parameters())
    x, y = x[:, :first.shape[1]].to(first.dtype), y.to(first.dtype)
    for chunk in chunks[:-1]:
        x = chunk(x)
    return chunks[-1](x, y)


def reference(case: dict, *, dp: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the whole global batch, torch.optim.Adam (its default single-tensor path)."""
    m = case["m"]
    chunks = make_chunks(num_chunks=case.get("chunks", 1), global_count=dp * m * MICRO_BATCH * D_MODEL,
                         tied="shared" if case.get("tied") else None)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.Adam(params, lr=LR, foreach=False)
    losses = []
    for step in range(NUM_STEPS):
        x, y = global_batch(step, dp=dp, m=m)
        total = 0.0
        for i in range(dp * m):
            loss = run_chunks(chunks, *micro_batch(x, y, i))
            loss.backward()
            total += loss.item()
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses, {f"{v}.{n}": p.detach().clone() for v, c in enumerate(chunks) for n, p in c.named_parameters()}


def sum_tied_gradients(chunks: list[Chunk], engine: ShardedDataParallel):
    """Keep the tied copies equal: both take the sum of their (DP-reduced) gradient chunks."""
    first, head = engine.unit_grad(chunks[0].units[0]), engine.unit_grad(chunks[-1].units[-1])

    def before_update() -> None:
        first.add_(head)
        head.copy_(first)

    return before_update


def _train_case(rank: int, world_size: int, case: dict) -> dict:
    dp, m = world_size, case["m"]
    s_p, s_g, s_os = case["degrees"]
    plan = Plan(dp=dp, num_micro_batches=m, param_shard=s_p, grad_shard=s_g, optim_shard=s_os,
                prefetch_depth=case.get("prefetch", 1), bucket_size_bytes=case.get("bucket", 1 << 20))
    mesh = build_mesh(plan, ranks_per_node=case.get("ranks_per_node", world_size))

    def new_engine():
        comm = Comm(ranks_per_node=mesh.ranks_per_node)
        chunks = make_chunks(num_chunks=case.get("chunks", 1), global_count=dp * m * MICRO_BATCH * D_MODEL,
                             tied="copies" if case.get("tied") else None)
        engine = ShardedDataParallel(chunks, plan=plan, mesh=mesh, comm=comm, num_micro_batches=m, lr=LR,
                                     defer_grad_sync=case.get("defer", False), param_dtype=case.get("dtype"))
        return chunks, engine, comm

    issued_in_backward = {}

    def train(chunks, engine, steps):
        losses = []
        for step in steps:
            x, y = global_batch(step, dp=dp, m=m)
            local = torch.zeros(())
            for i in range(m):
                loss = run_chunks(chunks, *micro_batch(x, y, mesh.dp_rank * m + i))
                loss.backward()
                local += loss.detach().float()
            if step == 0:  # what the backward hooks issued before the pipeline or the step asks for more
                issued_in_backward.update(engine.comm.counters.snapshot())
            if case.get("defer"):
                for v in reversed(range(len(chunks))):
                    engine.start_grad_sync(v)
            engine.optimizer_step(before_update=sum_tied_gradients(chunks, engine) if case.get("tied") else None)
            dist.all_reduce(local)  # not through comm: test bookkeeping, not engine traffic
            losses.append(local.item())
        return losses

    chunks, engine, comm = new_engine()
    half = NUM_STEPS // 2
    losses = train(chunks, engine, range(half))
    saved = engine.local_state() if case.get("checkpoint") else None
    losses += train(chunks, engine, range(half, NUM_STEPS))
    result = {"losses": losses, "counters": comm.counters.snapshot(), "state_bytes": engine.state_bytes(),
              "issued_in_backward": dict(issued_in_backward),
              "peak_param_bytes": engine.peak_param_bytes, "unit_numels": [u.padded for u in engine.units]}
    full = {k: v.float() for k, v in engine.full_state_dict().items()}
    result["params"] = full if rank == 0 else None
    if saved is not None:  # a fresh engine on freshly initialised chunks, resumed from the shards
        chunks, engine, _ = new_engine()
        engine.load_local_state(saved)
        result["resumed_losses"] = train(chunks, engine, range(half, NUM_STEPS))
    return result


def _worker(rank: int, world_size: int, cases: dict[str, dict]) -> dict[str, dict]:
    return {name: _train_case(rank, world_size, case) for name, case in cases.items()}


CASES_DP4 = {
    "zero0": {"degrees": (1, 1, 1), "m": 2},
    "zero1": {"degrees": (1, 1, 4), "m": 2},
    "zero2": {"degrees": (1, 4, 4), "m": 3},
    "zero3": {"degrees": (4, 4, 4), "m": 2},
    "hsdp": {"degrees": (2, 2, 2), "m": 2, "ranks_per_node": 2},
    "mixed_224": {"degrees": (2, 2, 4), "m": 4, "checkpoint": True},
    # Mixes whose nested layout permutes chunks in the reduce-scatter / the redistribution.
    "mixed_244": {"degrees": (2, 4, 4), "m": 2, "bucket": 512},
    "mixed_124": {"degrees": (1, 2, 4), "m": 2, "bucket": 512},
    # Two chunks, Commshift-style deferred boundary reductions, buckets smaller than a unit.
    "hsdp_defer": {"degrees": (2, 2, 2), "m": 2, "chunks": 2, "defer": True, "bucket": 256, "ranks_per_node": 2},
    "zero1_defer": {"degrees": (1, 1, 4), "m": 3, "chunks": 2, "defer": True, "bucket": 256},
}
CASES_DP2 = {
    "zero0": {"degrees": (1, 1, 1), "m": 3},
    "zero2": {"degrees": (1, 2, 2), "m": 2},
    "zero3_prefetch2": {"degrees": (2, 2, 2), "m": 2, "prefetch": 2, "checkpoint": True},
    "zero3_noprefetch": {"degrees": (2, 2, 2), "m": 1, "prefetch": 0},
    # Tied input and output projections kept as two equal copies whose gradients the step sums.
    "tied_zero2": {"degrees": (1, 2, 2), "m": 2, "tied": True},
}
# Mixed precision: bf16 parameters and gradients (accumulated and reduced in bf16), fp32 master weights.
CASES_BF16 = {
    "bf16_zero3": {"degrees": (2, 2, 2), "m": 2, "dtype": torch.bfloat16},
    "bf16_zero1": {"degrees": (1, 1, 2), "m": 2, "dtype": torch.bfloat16},
}
CASES_DP8 = {"mixed_248": {"degrees": (2, 4, 8), "m": 2, "ranks_per_node": 4, "bucket": 1024}}


@pytest.fixture(scope="module")
def dp4_results():
    return run_on_ranks(_worker, world_size=4, args=(CASES_DP4,))


@pytest.fixture(scope="module")
def dp2_results():
    return run_on_ranks(_worker, world_size=2, args=({**CASES_DP2, **CASES_BF16},))


def _check_against_reference(results: list[dict], case: dict, *, dp: int) -> None:
    ref_losses, ref_params = reference(case, dp=dp)
    got = results[0]
    assert got["losses"] == pytest.approx(ref_losses, abs=1e-4)
    initial = {f"{v}.{n}": p for v, c in enumerate(make_chunks(num_chunks=case.get("chunks", 1), global_count=1,
                                                               tied="shared" if case.get("tied") else None))
               for n, p in c.named_parameters()}
    # The parameters moved far beyond the tolerance, so the comparison is not between two frozen models.
    assert max((ref_params[k] - initial[k]).abs().max().item() for k in initial) > 2e-2
    if case.get("tied"):  # the engine's head copy must equal the one shared reference parameter
        ref_params = {**ref_params, "0.units.4.proj.weight": ref_params["0.units.0.0.weight"],
                      "0.units.4.proj.bias": ref_params["0.units.0.0.bias"]}
    assert set(got["params"]) == set(ref_params)
    for name, want in ref_params.items():
        diff = (got["params"][name] - want).abs().max().item()
        assert diff < 1e-3, f"{name} differs by {diff}"
    for other in results[1:]:
        assert other["losses"] == got["losses"]


@pytest.mark.parametrize("name", list(CASES_DP4))
def test_dp4_matches_single_process_adam(dp4_results, name):
    _check_against_reference([r[name] for r in dp4_results], CASES_DP4[name], dp=4)


@pytest.mark.parametrize("name", list(CASES_DP2))
def test_dp2_matches_single_process_adam(dp2_results, name):
    _check_against_reference([r[name] for r in dp2_results], CASES_DP2[name], dp=2)


def test_dp8_mixed_sharding_matches_single_process_adam():
    results = run_on_ranks(_worker, world_size=8, args=(CASES_DP8,))
    _check_against_reference([r["mixed_248"] for r in results], CASES_DP8["mixed_248"], dp=8)
    # (2, 4, 8), 4 ranks per node, per step: parameter gathers in pairs and reduce-scatters in fours stay
    # in a node; the boundary all-reduce of the 1/4 gradient shard pairs positions q and q + 4 (inter-node);
    # the redistribution of 1/8 optimizer shards over positions {q, q+2, q+4, q+6} crosses nodes on half
    # of its ring's edges.
    counters = results[0]["mixed_248"]["counters"]
    P, m, fp32 = num_params(), CASES_DP8["mixed_248"]["m"], 4
    gathers = 2 * m * (1 / 2) * P * fp32
    redistribute = (3 / 4) * (P / 2) * fp32
    all_reduce = 2 * (1 / 2) * (P / 4) * fp32
    assert counters["all_gather"] == NUM_STEPS * (gathers + redistribute)
    assert counters["reduce_scatter"] == NUM_STEPS * m * (3 / 4) * P * fp32
    assert counters["all_reduce"] == NUM_STEPS * all_reduce
    assert counters["inter_node"] == NUM_STEPS * (all_reduce + redistribute / 2)


@pytest.mark.parametrize("name", ["mixed_224", "zero3_prefetch2"])
def test_resume_from_local_state_continues_identically(dp4_results, dp2_results, name):
    results = dp4_results if name in CASES_DP4 else dp2_results
    for rank_result in results:
        got = rank_result[name]
        assert got["resumed_losses"] == pytest.approx(got["losses"][NUM_STEPS // 2:], abs=1e-7)


@pytest.mark.parametrize("name", list(CASES_BF16))
def test_bf16_parameters_with_fp32_master_track_fp32_training(dp2_results, name):
    case = CASES_BF16[name]
    ref_losses, ref_params = reference(case, dp=2)
    got = dp2_results[0][name]
    # bf16 keeps 8 mantissa bits: losses agree to ~1e-2; the fp32 master keeps the steps from stalling.
    assert got["losses"] == pytest.approx(ref_losses, abs=3e-2)
    worst = max((got["params"][k] - v).abs().max().item() for k, v in ref_params.items())
    assert worst < 3e-2
    P = num_params()
    want = state_bytes_per_param(degrees=case["degrees"], compute_bytes=2) * P
    # The ZeRO paper's mixed-precision accounting: 2 B parameters, 2 B gradients, 12 B fp32 master + Adam
    # moments; ZeRO-3 over 2 ranks holds 16P/2, ZeRO-1 holds 4P + 12P/2.
    assert want == (2 / 2 + 2 / 2 + 12 / 2) * P if case["degrees"] == (2, 2, 2) else want == (2 + 2 + 12 / 2) * P
    for rank_result in dp2_results:
        assert sum(rank_result[name]["state_bytes"].values()) == want


def test_nested_layout_is_a_bijection_and_nests():
    for dp, degrees in ((4, (2, 2, 4)), (8, (2, 4, 8)), (8, (1, 2, 8)), (8, (2, 2, 2)), (8, (4, 4, 8))):
        s_p, s_g, s_os = degrees
        for base in range(0, dp, s_os):
            chunks = [shard_chunks(q, degrees=degrees) for q in range(base, base + s_os)]
            assert sorted(o for _, _, o in chunks) == list(range(s_os))
            for p, g, o in chunks:
                assert g // (s_g // s_p) == p and o // (s_os // s_g) == g
        for q in range(dp):  # the replica group (same q % s_g) holds the same gradient chunk
            assert shard_chunks(q, degrees=degrees)[1] == shard_chunks(q % s_g, degrees=degrees)[1]


def test_comm_bytes_match_ring_formulas(dp4_results):
    """Per step: ZeRO-0 all-reduces 2(n-1)/n x 4P; ZeRO-1 adds an all-gather of (n-1)/n x 4P; ZeRO-3
    gathers 2 x m x (n-1)/n x 4P and reduce-scatters m x (n-1)/n x 4P; HSDP (2,2,2) keeps its gathers
    and reduce-scatters inside a node and all-reduces the half-size shard across nodes."""
    P = sum(dp4_results[0]["zero0"]["unit_numels"])
    assert P == num_params()  # unit sizes chosen divisible by 4: no padding, exact formulas
    n, steps, fp32 = 4, NUM_STEPS, 4

    def per_run(name):
        return dp4_results[0][name]["counters"]

    assert per_run("zero0")["all_reduce"] == steps * 2 * (n - 1) * P * fp32 // n
    assert per_run("zero0")["all_gather"] == per_run("zero0")["reduce_scatter"] == 0
    assert per_run("zero1")["all_reduce"] == steps * 2 * (n - 1) * P * fp32 // n
    assert per_run("zero1")["all_gather"] == steps * (n - 1) * P * fp32 // n
    m = CASES_DP4["zero3"]["m"]
    assert per_run("zero3")["all_gather"] == steps * 2 * m * (n - 1) * P * fp32 // n
    assert per_run("zero3")["reduce_scatter"] == steps * m * (n - 1) * P * fp32 // n
    assert per_run("zero3")["all_reduce"] == 0
    m, g = CASES_DP4["hsdp"]["m"], 2
    hsdp = per_run("hsdp")
    assert hsdp["all_gather"] == steps * 2 * m * (g - 1) * P * fp32 // g
    assert hsdp["reduce_scatter"] == steps * m * (g - 1) * P * fp32 // g
    assert hsdp["all_reduce"] == steps * 2 * (2 - 1) * (P // g) * fp32 // 2
    assert hsdp["inter_node"] == hsdp["all_reduce"]  # only the replica all-reduce crosses nodes
    for rank_result in dp4_results[1:]:
        assert rank_result["hsdp"]["counters"] == hsdp


def test_reductions_issued_from_backward_hooks_unless_deferred(dp4_results):
    """By the end of the last micro-batch's backward, the hooks have issued every reduce-scatter and the
    s_g == 1 boundary all-reduce, unless deferred to start_grad_sync (Commshift), which then holds back
    the last micro-batch's reduce-scatter and every boundary all-reduce. (An s_g < dp replica all-reduce
    waits for its reduce-scatter, so the last bucket's is issued at the step.)"""
    P, n, fp32 = num_params(), 4, 4
    issued = {name: dp4_results[0][name]["issued_in_backward"] for name in CASES_DP4}
    assert issued["zero0"]["all_reduce"] == 2 * (n - 1) * P * fp32 // n
    m = CASES_DP4["zero3"]["m"]
    assert issued["zero3"]["reduce_scatter"] == m * (n - 1) * P * fp32 // n
    assert issued["zero3"]["all_gather"] == 2 * m * (n - 1) * P * fp32 // n
    assert issued["hsdp"]["reduce_scatter"] == CASES_DP4["hsdp"]["m"] * (1 / 2) * P * fp32
    assert issued["zero1_defer"]["all_reduce"] == 0
    m = CASES_DP4["hsdp_defer"]["m"]
    assert issued["hsdp_defer"]["reduce_scatter"] == (m - 1) * (1 / 2) * P * fp32
    assert issued["hsdp_defer"]["all_reduce"] == 0


@pytest.mark.parametrize("name,formula_bytes_per_param", [
    # fp32 (CPU): 4 B params, 4 B grads, 8 B Adam moments (the params are the master weights).
    ("zero0", 16.0), ("zero1", 8 + 8 / 4), ("zero2", 4 + 12 / 4), ("zero3", 16 / 4),
    ("hsdp", 16 / 2), ("mixed_224", 4 / 2 + 4 / 2 + 8 / 4)])
def test_state_bytes_held_match_formula(dp4_results, name, formula_bytes_per_param):
    P = num_params()
    assert formula_bytes_per_param == state_bytes_per_param(degrees=CASES_DP4[name]["degrees"], compute_bytes=4)
    for rank_result in dp4_results:
        held = rank_result[name]["state_bytes"]
        assert sum(held.values()) == formula_bytes_per_param * P, held


def test_zero3_peak_live_parameters_below_zero0(dp4_results, dp2_results):
    """ZeRO-3 holds its 1/dp shards plus the unit in use and `prefetch_depth` gathered ahead (plus one
    being freed); with prefetch <= 1 that is below ZeRO-0's full copy even for this 5-unit model."""
    P = num_params()
    for results, dp, name, below_zero0 in ((dp4_results, 4, "zero3", True), (dp2_results, 2, "zero3_noprefetch", True),
                                           (dp2_results, 2, "zero3_prefetch2", False)):
        zero0 = results[0]["zero0"]["peak_param_bytes"]
        assert zero0 == 4 * P
        numels = results[0][name]["unit_numels"]
        depth = (CASES_DP4 if dp == 4 else CASES_DP2)[name].get("prefetch", 1)
        bound = 4 * P // dp + (depth + 2) * 4 * max(numels)
        for rank_result in results:
            peak = rank_result[name]["peak_param_bytes"]
            assert peak <= bound, (name, peak, bound)
            assert peak > 4 * P // dp  # something was gathered: the peak is measured, not the shard size
            if below_zero0:
                assert peak < zero0, (name, peak, zero0)


def test_real_tiny_model_zero3_with_recomputation_matches_one_process():
    """The lead's transformer (specs.model.PRESETS['tiny']) under ZeRO-3 with full and selective
    recomputation and a mixed sharding: the engine's backward pre-hook must gather a unit's parameters
    before torch.utils.checkpoint recomputes it, and freeing after forward must not corrupt saved tensors."""
    from tests.distributed.harness import check_against_reference, run_plans, spread_seeds, tiny_config

    plans = [Plan(dp=2, num_micro_batches=2, micro_batch=2, param_shard=2, grad_shard=2, optim_shard=2,
                  recompute="full", prefetch_depth=1),
             Plan(dp=2, num_micro_batches=2, micro_batch=2, param_shard=2, grad_shard=2, optim_shard=2,
                  recompute="selective", prefetch_depth=2, bucket_size_bytes=64 * 1024),
             Plan(dp=2, num_micro_batches=3, micro_batch=1, param_shard=1, grad_shard=2, optim_shard=2,
                  recompute="full")]
    cfgs = [tiny_config(plan, steps=4, seed=seed) for plan, seed in spread_seeds(plans)]
    for cfg, (metrics, params) in zip(cfgs, run_plans(cfgs)):
        check_against_reference(cfg, metrics, params)


def test_mesh_groups_follow_megatron_order_and_nest():
    from runners.mesh import mesh_groups

    plan = Plan(dp=4, tp=2, pp=2, param_shard=2, grad_shard=2, optim_shard=4)
    groups = mesh_groups(plan)
    by_kind: dict[str, list[tuple[int, ...]]] = {}
    for kind, ranks in groups:
        by_kind.setdefault(kind, []).append(ranks)
    for kind, lists in by_kind.items():  # each kind partitions the 16 ranks
        assert sorted(r for ranks in lists for r in ranks) == list(range(16)), kind
    # rank = (pp_rank * dp + dp_rank) * tp + tp_rank
    assert by_kind["tp"][:2] == [(0, 1), (2, 3)]
    assert (1, 9) in by_kind["pp"] and (0, 8) in by_kind["pp"]
    assert (0, 2, 4, 6) in by_kind["dp"] and (9, 11, 13, 15) in by_kind["dp"]
    assert (0, 2) in by_kind["param"] and (4, 6) in by_kind["param"] and (1, 3) in by_kind["param"]
    assert (0, 4) in by_kind["grad_replica"] and (2, 6) in by_kind["grad_replica"]
    # Redistribution: inside the optimizer group (DP positions 0..3), the positions sharing a parameter chunk.
    assert (0, 4) in by_kind["redistribute"] and (2, 6) in by_kind["redistribute"]
    # With 2 ranks per node, every TP group is inside one node.
    assert all(ranks[-1] // 2 == ranks[0] // 2 for ranks in by_kind["tp"])


def test_real_tiny_model_pipelined_sharding_with_commshift_matches_one_process():
    """dp2 x pp2 on the tiny transformer: ZeRO-3 under 1F1B and ZeRO-1 under interleaved 1F1B (two chunks
    per rank finishing at different times), both with deferred (Commshift) boundary reductions."""
    from tests.distributed.harness import check_against_reference, run_plans, spread_seeds, tiny_config

    plans = [Plan(dp=2, pp=2, num_micro_batches=4, micro_batch=1, schedule="1f1b", param_shard=2, grad_shard=2,
                  optim_shard=2, recompute="full", commshift=True),
             Plan(dp=2, pp=2, virtual_stages=2, num_micro_batches=4, micro_batch=1, schedule="interleaved-1f1b",
                  param_shard=1, grad_shard=1, optim_shard=2, recompute="selective", commshift=True,
                  bucket_size_bytes=32 * 1024)]
    cfgs = [tiny_config(plan, steps=4, seed=seed) for plan, seed in spread_seeds(plans)]
    for cfg, (metrics, params) in zip(cfgs, run_plans(cfgs)):
        check_against_reference(cfg, metrics, params)


def test_one_rank_is_bitwise_torch_adam():
    """With no data parallelism the engine's flat fp32 accumulation and Adam do torch's arithmetic in
    torch's order, so the parameters are bit-identical, not merely close (the reported losses differ in
    the last bits only because the reference sums them in Python doubles)."""
    case = {"degrees": (1, 1, 1), "m": 3}
    (result,) = run_on_ranks(_worker, world_size=1, args=({"one": case},))
    ref_losses, ref_params = reference(case, dp=1)
    assert result["one"]["losses"] == pytest.approx(ref_losses, abs=1e-6)
    for name, want in ref_params.items():
        assert torch.equal(result["one"]["params"][name], want), name


def _sharding_probe_worker(rank: int, world_size: int) -> dict:
    from runners.probe import measure_sharding
    from specs.model import resolve_model

    torch.set_num_threads(1)
    return measure_sharding(resolve_model("tiny"), device=torch.device("cpu"), repeats=2, rounds=1)


def test_the_sharding_probe_times_the_engine_around_local_collectives():
    """runners/probe.measure_sharding on 2 ranks: the engine's three plans train with LocalComm (no data
    crosses ranks, so no rank waits for another's collective), and every rank reports the same figures
    (the slowest rank's times), per unit of tiny's 4 probed layers plus embedding, final norm and head."""
    first, second = run_on_ranks(_sharding_probe_worker, world_size=2)
    assert first == second
    assert first["units"] == 7 and first["micro_batches"] == 4 and first["step_s"] > 0
    assert first["grad_unit_s"] >= 0 and first["param_unit_s"] >= 0


def _context_probe_worker(rank: int, world_size: int) -> dict:
    from runners.probe import measure_context
    from specs.model import resolve_model

    torch.set_num_threads(1)
    return measure_context(resolve_model("tiny"), device=torch.device("cpu"), dtype=torch.float32, repeats=2, rounds=1)


def test_the_context_probe_times_the_engines_cp_attention_with_and_without_its_exchanges():
    """runners/probe.measure_context on 2 ranks: both kinds over the CP group of 2, every rank reporting the
    slowest rank's figures; the real exchanges (a ring's p2p, the all-to-alls) cost time the local ones do not."""
    first, second = run_on_ranks(_context_probe_worker, world_size=2)
    assert first == second
    assert first["world"] == 2 and first["seq_len"] == 64
    assert set(first) == {"world", "seq_len", "ring2_local_s", "ring2_comm_s", "a2a2_local_s", "a2a2_comm_s"}
    assert all(first[f"{kind}2_local_s"] > 0 and first[f"{kind}2_comm_s"] >= 0 for kind in ("ring", "a2a"))


def _sync_probe_worker(rank: int, world_size: int) -> dict:
    import runners.probe as probe

    torch.set_num_threads(1)
    return probe.measure_sync_wait(device=torch.device("cpu"), share=0.07)  # 3 rounds of ~0.02 s loops


def test_the_sync_wait_probe_reports_every_group_size_and_segment_on_every_rank():
    """runners/probe.measure_sync_wait on 2 ranks: one group size (2), every segment, the ranks' mean on
    every rank, never below 0."""
    from runners.probe import SYNC_SEGMENTS_S

    first, second = run_on_ranks(_sync_probe_worker, world_size=2)
    assert first == second and first["world"] == 2
    assert set(first) == {"world"} | {f"sync2_{round(w * 1e6)}_s" for w in SYNC_SEGMENTS_S}
    assert all(v >= 0 for v in first.values())


def _group_seconds_worker(rank: int, world_size: int) -> dict:
    import time

    import runners.probe as probe
    from specs.model import PRESETS

    torch.set_num_threads(1)
    # Rank 1's calls take 4x rank 0's: the group's seconds per call are the slower rank's, on both ranks.
    grouped = probe._group_seconds(lambda: time.sleep(0.01 * (1 + 3 * rank)), repeats=3, device=torch.device("cpu"))
    points, attention = probe.measure_attention_blocks(PRESETS["tiny"], device=torch.device("cpu"), budget_s=0.03,
                                                       sides=(16, 64), seq_lens=(64, 256), head_dims=(8,), rounds=1)
    return {"grouped": grouped, "points": points, "attention": attention}


def _window_overhead_worker(rank: int, world_size: int) -> dict:
    import runners.probe as probe
    from specs.model import PRESETS

    torch.set_num_threads(1)
    measured = probe._window_overhead_s(torch.device("cpu"))
    probe.ATTENTION_MIN_WINDOW_S = 0.0  # one call a window
    probe._group_seconds = lambda body, *, repeats, device: 0.010
    out = {"measured": measured}
    for overhead in (0.004, 0.008):
        probe._window_overhead_s = lambda device, overhead=overhead: overhead
        out[overhead] = probe.measure_attention_blocks(PRESETS["tiny"], device=torch.device("cpu"), budget_s=1e-9,
                                                       sides=(16,), seq_lens=(64,), head_dims=(8,), rounds=2)
    return out


def test_the_attention_probe_takes_the_windows_own_cost_off_its_calls():
    """runners/probe.measure_attention_blocks: a window of one 10 ms call whose empty window (the closing
    barrier and the ranks' skew: `_window_overhead_s`) takes 4 ms reads 6 ms a call; an overhead over half the
    window leaves half. The empty window measured for real costs a few milliseconds at most."""
    first, second = run_on_ranks(_window_overhead_worker, world_size=2)
    assert 0 <= first["measured"] < 0.05
    for overhead, expected in ((0.004, 0.006), (0.008, 0.005)):
        ring, attention = first[overhead]
        assert [(p.square_forward_s, p.half_backward_s) for p in ring] == [pytest.approx((expected, expected))]
        assert [(p.forward_s, p.backward_s) for p in attention] == [pytest.approx((expected, expected))]


def test_the_attention_probe_times_the_steps_as_the_groups_wall_on_every_rank():
    """runners/probe._group_seconds is the group's wall per call (the slowest rank's calls plus the end
    barrier), not a rank's own mean; measure_attention_blocks returns the same ring and fused-attention points
    on every rank, marked concurrent, at the tiny model's head width and GQA ratio (8 heads, 4 K/V: 4 and 2
    timed)."""
    first, second = run_on_ranks(_group_seconds_worker, world_size=2)
    for result in (first, second):
        assert 0.04 <= result["grouped"] < 0.06
    assert first["points"] == second["points"] and first["attention"] == second["attention"]
    assert [(p.side, p.num_heads, p.num_kv_heads, p.head_dim, p.concurrent) for p in first["points"]] == \
        [(16, 4, 2, 8, True), (64, 4, 2, 8, True)]
    assert all(0 < v for p in first["points"] for v in (p.square_forward_s, p.square_backward_s,
                                                        p.half_forward_s, p.half_backward_s))
    assert [(p.seq_len, p.num_heads, p.head_dim, p.dtype, p.concurrent) for p in first["attention"]] == \
        [(64, 4, 8, "fp32", True), (256, 4, 8, "fp32", True)]
    assert all(0 < p.forward_s <= p.backward_s for p in first["attention"])
