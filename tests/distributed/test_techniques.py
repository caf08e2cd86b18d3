"""The three published techniques in our engine, on the tiny transformer, against one process.

Run: timeout 900 python -m pytest -q tests/distributed/test_techniques.py

- MAZ3 (Liu et al., ICNP 2025): ZeRO-3 with the forward-gathered parameters of each layer kept on the
  device, copied to host, or kept as an intra-node secondary shard (ZeRO++ hpZ) for the backward.
- Lins (Chen et al., IWQoS 2024): a (2, 2, 4) mix whose optimizer-shard redistribution overlaps the next
  forward.
- Commshift (Hosoki et al., CCGrid 2025): pp2 x dp2 with every last-micro-batch reduction deferred until
  after the stage's last input-gradient send.

Every plan trains 8 steps and must match the one-process reference (harness.check_against_reference), at
one of harness.SEEDS in turn (test_gradients.py checks every plan's first-step gradients); the MAZ3
byte counters are checked against the ring formulas of runners/comm.py, per unit.
"""

from __future__ import annotations

import pytest

from specs.model import PRESETS
from specs.plan import Plan
from tests.distributed.harness import SEEDS, check_against_reference, run_plans, spread_seeds, tiny_config

DP, M, FP32 = 4, 2, 4
MIX = ("device", "host", "secondary", "none", "device", "host", "secondary", "none")


def _zero3(**kw) -> Plan:
    return Plan(dp=DP, param_shard=DP, grad_shard=DP, optim_shard=DP, micro_batch=1, num_micro_batches=M, **kw)


PLANS = {
    "zero3": _zero3(),
    "maz3-device": _zero3(param_cache="device"),
    "maz3-host": _zero3(param_cache="host"),
    "maz3-secondary": _zero3(param_cache="secondary"),
    "maz3-mix": _zero3(param_cache=MIX, prefetch_depth=2),
    "lins-2-2-4": Plan(dp=DP, param_shard=2, grad_shard=2, optim_shard=4, micro_batch=1, num_micro_batches=M),
    "commshift-zero0": Plan(dp=2, pp=2, micro_batch=1, num_micro_batches=4, schedule="1f1b", commshift=True),
    "commshift-zero2": Plan(dp=2, pp=2, grad_shard=2, optim_shard=2, micro_batch=1, num_micro_batches=4,
                            schedule="1f1b", commshift=True, bucket_size_bytes=64 * 1024),
    "commshift-zero3": Plan(dp=2, pp=2, param_shard=2, grad_shard=2, optim_shard=2, micro_batch=1,
                            num_micro_batches=4, virtual_stages=2, schedule="interleaved-1f1b", commshift=True,
                            recompute="full"),
}
# Two emulated nodes of two ranks: every ZeRO-3 parameter group spans both (the hpZ case).
RANKS_PER_NODE = 2
CASES = spread_seeds(list(PLANS))
_results: dict[tuple[str, int], tuple[dict, dict]] = {}


def _config(name: str, seed: int = SEEDS[0]):
    return tiny_config(PLANS[name], ranks_per_node=RANKS_PER_NODE, seed=seed)


def _result(name: str, seed: int | None = None) -> tuple[dict, dict]:
    """The run of plan `name` at `seed` (default: the first seed it trains at; byte counts do not depend on it)."""
    if not _results:
        _results.update(zip(CASES, run_plans([_config(n, s) for n, s in CASES])))
    return _results[(name, seed if seed is not None else next(s for n, s in CASES if n == name))]


def _unit_numels() -> tuple[list[int], list[int | None]]:
    """Padded numel of every unit of the one-chunk tiny model (multiple of s_os = 4) and its layer index."""
    from runners.transformer import build_chunk
    from runners.tensor_parallel import TPContext

    spec = PRESETS["tiny"]
    chunk = build_chunk(spec, layers=range(spec.num_layers), first=True, last=True, seed=0, tp=TPContext.single(),
                        recompute="none", loss_scale=1.0)
    numels = [-(-sum(p.numel() for p in unit.parameters()) // DP) * DP for unit in chunk.units]
    return numels, [getattr(unit, "layer_index", None) for unit in chunk.units]


def _expected_bytes(tiers: tuple[str, ...]) -> dict[str, int]:
    """Bytes per step summed over the 4 ranks, from runners.comm's ring convention, for ZeRO-3 on dp4 with
    2 ranks per node and layer tiers `tiers`: per micro-batch each unit all-gathers its fp32 buffer in
    forward ((n-1)/n x 4 B per element, n = 4; the ring 0-1-2-3 crosses nodes on half its edges) and,
    by tier, in backward again ("none"), not at all ("device"), from host ("host": 4 B each way), or
    inside the node ("secondary": (2-1)/2 x 4 B, intra-node); it reduce-scatters once ((n-1)/n x 4 B;
    on the wire, gloo's all-reduce underneath moves twice that)."""
    numels, layers = _unit_numels()
    gather, rs, host, inter = 0.0, 0.0, 0.0, 0.0
    for numel, layer in zip(numels, layers):
        tier = tiers[layer] if layer is not None else "none"
        full = (DP - 1) / DP * numel * FP32
        backward = {"none": full, "device": 0.0, "host": 0.0, "secondary": 1 / 2 * numel * FP32}[tier]
        gather += full + backward
        rs += full
        host += 2 * numel * FP32 if tier == "host" else 0.0
        inter += (full + (backward if tier == "none" else 0.0) + full) / 2
    # gloo's reduce-scatter is an all-reduce underneath: twice the ring's bytes cross (runners/comm.py).
    per_step = {"all_gather": gather, "reduce_scatter": rs, "host_device": host, "inter_node": inter,
                "inter_node_wire": inter + rs / 2}
    return {k: int(DP * M * v) for k, v in per_step.items()}


@pytest.mark.parametrize("name,seed", CASES, ids=[f"{n}-seed{s}" for n, s in CASES])
def test_technique_matches_one_process(name, seed):
    metrics, params = _result(name, seed)
    check_against_reference(_config(name, seed), metrics, params)


@pytest.mark.parametrize("name,tiers", [
    ("zero3", ("none",) * 8), ("maz3-device", ("device",) * 8), ("maz3-host", ("host",) * 8),
    ("maz3-secondary", ("secondary",) * 8), ("maz3-mix", MIX)])
def test_maz3_comm_bytes_follow_the_tiers(name, tiers):
    got = _result(name)[0].summary.comm_bytes
    want = _expected_bytes(tiers)
    for kind, value in want.items():
        assert got[kind] == value, (name, kind, got[kind], value)
    assert got["all_reduce"] == 0


def test_maz3_device_tier_saves_a_third_of_each_layers_traffic():
    """The device tier drops each layer's backward gather: of gather + gather + reduce-scatter per
    micro-batch, 2/3 remain for the 8 layers; the embedding, final norm and head keep all three."""
    numels, layers = _unit_numels()
    layer_elems = sum(n for n, i in zip(numels, layers) if i is not None)
    per_elem = DP * M * (DP - 1) / DP * FP32  # one gather (or reduce-scatter) of one element, all ranks
    zero3, device = (_result(n)[0].summary.comm_bytes for n in ("zero3", "maz3-device"))
    traffic = {name: c["all_gather"] + c["reduce_scatter"] for name, c in (("zero3", zero3), ("device", device))}
    layer_zero3 = 3 * per_elem * layer_elems
    assert traffic["zero3"] - traffic["device"] == layer_zero3 / 3
    assert device["all_gather"] < zero3["all_gather"]


def test_maz3_secondary_removes_the_backward_gathers_inter_node_share():
    numels, layers = _unit_numels()
    layer_elems = sum(n for n, i in zip(numels, layers) if i is not None)
    zero3, secondary = (_result(n)[0].summary.comm_bytes for n in ("zero3", "maz3-secondary"))
    backward_gather_inter = DP * M * (DP - 1) / DP * FP32 * layer_elems / 2
    assert zero3["inter_node"] - secondary["inter_node"] == backward_gather_inter
    assert secondary["host_device"] == zero3["host_device"] == 0


def test_lins_redistribution_bytes_unchanged_by_overlap():
    """(2, 2, 4) on dp4: per micro-batch two gathers and one reduce-scatter in pairs, then per step the
    replica all-reduce of the 1/2 gradient shard and the redistribution of 1/4 optimizer shards inside
    the pair sharing a parameter chunk (issued at the step's end, waited in the next forward)."""
    numels, _ = _unit_numels()
    total = sum(numels)
    got = _result("lins-2-2-4")[0].summary.comm_bytes
    gathers = M * 2 * (1 / 2) * total * FP32
    redistribute = (1 / 2) * (total / 2) * FP32
    assert got["all_gather"] == int(DP * (gathers + redistribute))
    assert got["reduce_scatter"] == int(DP * M * (1 / 2) * total * FP32)
    assert got["all_reduce"] == int(DP * 2 * (1 / 2) * (total / 2) * FP32)


# --- when the overlapped collectives are issued and waited (engine internals, one step each) ----------
def _step_inputs(trainer, cfg, step: int):
    import torch

    from runners.data import make_data, rank_micro_batches

    data = make_data(None, vocab_size=cfg.model.vocab_size, seq_len=cfg.job.seq_len, seed=cfg.seed)
    return rank_micro_batches(data.global_batch(step, cfg.job.global_batch), dp=cfg.plan.dp,
                              dp_rank=trainer.mesh.dp_rank, micro_batch=cfg.plan.micro_batch, device=torch.device("cpu"))


def _lins_order(cfg) -> dict:
    """After a step, how many redistribution buckets are still in flight; then, during the next step's
    forward and backward, which units' buckets were waited for, in order."""
    import torch

    from runners.train import Trainer

    trainer = Trainer(cfg, device=torch.device("cpu"))
    engine = trainer.engine
    trainer.step(_step_inputs(trainer, cfg, 0))
    in_flight_after_step = len(engine.lins.in_flight)
    awaited: list[int] = []
    await_bucket = engine.lins.await_unit

    def logged(u) -> None:
        if u.redistribution is not None:
            awaited.append(engine.units.index(u))
        await_bucket(u)

    engine.lins.await_unit = logged
    trainer.run_micro_batches(_step_inputs(trainer, cfg, 1))
    in_flight_after_forward = len(engine.lins.in_flight)
    engine.optimizer_step()
    return {"in_flight_after_step": in_flight_after_step, "awaited": awaited,
            "in_flight_after_forward": in_flight_after_forward, "num_units": len(engine.units)}


def _commshift_counters(cfg) -> dict:
    """Byte counters of one step at the pipeline's start_grad_sync call and at the step's end."""
    import torch

    from runners.train import Trainer

    trainer = Trainer(cfg, device=torch.device("cpu"))
    at_hook: list[dict] = []
    start_grad_sync = trainer.engine.start_grad_sync

    def logged(chunk: int) -> None:
        at_hook.append(dict(trainer.comm.counters.snapshot()))
        start_grad_sync(chunk)

    trainer.engine.start_grad_sync = logged
    trainer.comm.counters.reset()
    trainer.step(_step_inputs(trainer, cfg, 0))
    return {"at_hook": at_hook, "at_end": dict(trainer.comm.counters.snapshot())}


LINS_SMALL_BUCKETS = tiny_config(Plan(dp=DP, param_shard=2, grad_shard=2, optim_shard=4, micro_batch=1,
                                      num_micro_batches=1, bucket_size_bytes=64 * 1024), ranks_per_node=2)
COMMSHIFT_ZERO2 = tiny_config(Plan(dp=2, pp=2, grad_shard=2, optim_shard=2, micro_batch=1, num_micro_batches=4,
                                   schedule="1f1b", commshift=True), ranks_per_node=2)


def _order_worker(rank: int, world_size: int) -> dict:
    return {"lins": _lins_order(LINS_SMALL_BUCKETS), "commshift": _commshift_counters(COMMSHIFT_ZERO2)}


@pytest.fixture(scope="module")
def order_results():
    from tests.distributed.spawn import run_on_ranks

    return run_on_ranks(_order_worker, world_size=DP)


def test_lins_redistribution_overlaps_the_next_forward_in_forward_order(order_results):
    for result in (r["lins"] for r in order_results):
        # Small buckets: several all-gathers, none waited inside optimizer_step ...
        assert result["in_flight_after_step"] >= 3, result
        # ... and each waited by the first forward pre-hook that needs it, in forward order.
        assert result["in_flight_after_forward"] == 0
        assert len(result["awaited"]) == result["in_flight_after_step"]
        assert result["awaited"][0] == 0 and result["awaited"] == sorted(result["awaited"])


def test_commshift_defers_the_last_micro_batchs_reduce_scatter_past_the_gradient_send(order_results):
    m = COMMSHIFT_ZERO2.plan.num_micro_batches
    for result in (r["commshift"] for r in order_results):
        # One chunk per rank: the pipeline's call after its last backward comes first (optimizer_step
        # repeats it, a no-op).
        at_hook = result["at_hook"][0]
        at_end = result["at_end"]
        assert at_end["reduce_scatter"] > 0
        # m - 1 micro-batches' reduce-scatters issued from the hooks, the last one's only after the call,
        assert at_hook["reduce_scatter"] * m == at_end["reduce_scatter"] * (m - 1)
        # which comes once every pipeline send of the step (activations or input gradients) is issued.
        assert at_hook["p2p"] == at_end["p2p"] > 0
