"""Issue 11's bug classes that a CPU and gloo can express, on 2 gloo processes sharing one process group:

- fp16 trains with dynamic loss scaling (the Trainer), and a step whose gradients overflow is skipped,
  parameters untouched, the scale halved; the applied steps track the fp32 reference;
- bf16 with the plan's reduce_fp32: gradients accumulate and reduce in fp32 (4-byte buffers and
  collectives), matching one process that sums the same bf16 micro-batch gradients in fp32;
- parameters are initialised already sharded: each rank draws only its shards, its peak resident memory
  stays below its state plus one unit, and the losses still equal one process's;
- the reducer chained on side streams (what runs under NCCL) is exact on gloo with no-op CPU streams;
- every tensor a run hands to torch.distributed is on the run's device, contiguous and of a dtype NCCL
  reduces (an NCCL group has no CPU backend);
- a checkpoint copies each shard once, to host memory (no second device copy).
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist

from specs.plan import Plan
from tests.distributed.harness import LOSS_TOL, tiny_config
from tests.distributed.spawn import run_on_ranks
from tests.distributed.test_sharding import (D_MODEL, LR, MICRO_BATCH, NUM_STEPS, global_batch, make_chunks,
                                             micro_batch, num_params, reference, run_chunks)

ZERO3 = dict(dp=2, param_shard=2, grad_shard=2, optim_shard=2)
INIT_TEST_BLOCK = 4096
NCCL_DTYPES = {torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int8, torch.uint8, torch.int32,
               torch.int64, torch.bool}


def big_config():
    """The tiny model with 131072-row embedding and head: 17M parameters, most in two units."""
    return tiny_config(Plan(**ZERO3, micro_batch=1, num_micro_batches=2), steps=2, vocab_size=131072)


# --- in the workers -------------------------------------------------------------------------------------------
def _train(cfg, device=torch.device("cpu")):
    from runners.train import train

    torch.manual_seed(cfg.seed)
    metrics, trainer = train(cfg, device=device)
    return metrics, trainer


def _watch_collectives(records: list):
    """Wrap torch.distributed's tensor collectives (and runners.comm's bound aliases); each call appends
    (name, tensor) for every tensor argument. Returns a function that undoes the wrapping."""
    import runners.comm as comm_module

    targets = [(dist, n) for n in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                                    "broadcast", "isend", "irecv", "send", "recv", "all_to_all_single")]
    targets += [(comm_module, "all_gather_single"), (comm_module, "reduce_scatter_single")]
    originals = [(owner, name, getattr(owner, name)) for owner, name in targets if hasattr(owner, name)]

    def wrap(name, fn):
        def wrapper(*args, **kwargs):
            for a in list(args) + list(kwargs.values()):
                for t in (a if isinstance(a, (list, tuple)) else [a]):
                    if isinstance(t, torch.Tensor):
                        records.append((name, t.device, t.is_contiguous(), t.dtype))
            return fn(*args, **kwargs)
        return wrapper

    for owner, name, fn in originals:
        setattr(owner, name, wrap(name, fn))

    def undo():
        for owner, name, fn in originals:
            setattr(owner, name, fn)
    return undo


def _trainer_checks(rank: int, world: int, tmp: str) -> dict:
    """Trainer runs: fp16, stream-ordered reduction, sharded initialisation, the collective watch, checkpoint."""
    import runners.param_init as param_init
    from runners import checkpoint

    out: dict = {}
    # fp16 with loss scaling, ZeRO-2 (gradients reduce-scattered in fp16 under the scale).
    cfg = tiny_config(Plan(dp=2, grad_shard=2, optim_shard=2, micro_batch=2, num_micro_batches=2), steps=4)
    cfg = cfg.replace(job=cfg.job.__class__(global_batch=cfg.job.global_batch, seq_len=cfg.job.seq_len, precision="fp16"))
    metrics, _ = _train(cfg)
    out["fp16"] = metrics.to_dict()
    # fp16 for an MoE model: its dense and expert engines share one loss scale and one overflow decision.
    moe = tiny_config(Plan(dp=2, ep=2, grad_shard=2, optim_shard=2, micro_batch=2, num_micro_batches=2), steps=4,
                      model="tiny-moe")
    moe = moe.replace(job=moe.job.__class__(global_batch=moe.job.global_batch, seq_len=moe.job.seq_len, precision="fp16"))
    metrics, _ = _train(moe)
    out["fp16_moe"] = metrics.to_dict()
    # The reducer chained on side streams (NCCL's path), exact on gloo.
    out["ordered"] = {}
    for name, plan in (("zero3", Plan(**ZERO3, micro_batch=1, num_micro_batches=3)),
                       ("zero0", Plan(dp=2, micro_batch=1, num_micro_batches=2))):
        metrics, _ = _train(tiny_config(plan, steps=4).replace(stream_ordered=True))
        out["ordered"][name] = metrics.losses
    # Sharded initialisation: count the elements each rank draws and its peak resident memory, with blocks
    # small enough that "half of every weight" is visible (the default block is 2^20 elements).
    drawn = {"n": 0}
    original, block_size = param_init._seeded_block, param_init.INIT_BLOCK

    def counting(**kwargs):
        block = original(**kwargs)
        drawn["n"] += block.numel()
        return block

    param_init._seeded_block, param_init.INIT_BLOCK = counting, INIT_TEST_BLOCK
    big = big_config()
    from runners.train import Trainer, reset_peak_memory, peak_memory_bytes

    gc.collect()
    reset_peak_memory(torch.device("cpu"))
    before = peak_memory_bytes(torch.device("cpu"))
    trainer = Trainer(big, device=torch.device("cpu"))
    grown = peak_memory_bytes(torch.device("cpu")) - before
    param_init._seeded_block = original
    out["init"] = {"drawn": drawn["n"], "grown_bytes": grown, "state_bytes": sum(trainer.engine.state_bytes().values()),
                   "largest_unit_bytes": max(u.flat_bytes for u in trainer.engine.units),
                   "model_params": big.model.num_params()}
    del trainer
    gc.collect()
    metrics, _ = _train(big)
    out["init"]["losses"] = metrics.losses
    param_init.INIT_BLOCK = block_size
    # Every tensor handed to torch.distributed: ZeRO-3 with MAZ3's host tier, Lins' redistribution (1, 1, 2),
    # TP with sequence parallelism, a pipeline; and a checkpoint write.
    records: list = []
    undo = _watch_collectives(records)
    try:
        for plan in (Plan(**ZERO3, micro_batch=1, num_micro_batches=2, param_cache="host"),
                     Plan(dp=2, optim_shard=2, micro_batch=1, num_micro_batches=2),
                     Plan(tp=2, sequence_parallel=True, micro_batch=2, num_micro_batches=1),
                     Plan(pp=2, micro_batch=1, num_micro_batches=2)):
            _, trainer = _train(tiny_config(plan, steps=2).replace(checkpoint_dir=f"{tmp}/ckpt{plan.describe()}"))
    finally:
        undo()
    out["collectives"] = [(n, str(d), c, str(t)) for n, d, c, t in records]
    # Checkpoints: the live shards are read in place and each piece copied once, to host memory.
    live = trainer.engine.local_state(copy=False)
    ptrs = {v.untyped_storage().data_ptr() for k, v in live.items() if k != "num_steps"}
    engine_ptrs = {getattr(u, key).untyped_storage().data_ptr() for u in trainer.engine.units
                   for key in ("param_shard", "master", "exp_avg", "exp_avg_sq")}
    pieces = checkpoint.save_pieces(trainer, plan=trainer.plan)
    tensors = [t for entries in pieces.values() for _, t in entries]
    out["checkpoint"] = {"live_is_engine": ptrs <= engine_ptrs,
                         "pieces_on_host": all(t.device.type == "cpu" for t in tensors),
                         "pieces_share_engine_storage": any(t.untyped_storage().data_ptr() in engine_ptrs for t in tensors),
                         "num_pieces": len(tensors)}
    return out


def _toy_engine_checks(rank: int, world: int) -> dict:
    """Toy model (tests/distributed/test_sharding.py) under fp16 loss scaling and bf16 fp32 reduction."""
    from runners.comm import Comm
    from runners.mesh import build_mesh
    from runners.sharding import ShardedDataParallel
    from runners.sharding.loss_scale import DynamicLossScale

    out: dict = {}
    m = 2
    plan = Plan(**ZERO3, num_micro_batches=m, bucket_size_bytes=1 << 20)
    mesh = build_mesh(plan, ranks_per_node=2)

    def engine(dtype, *, grad_dtype=None, scale=None, degrees=(2, 2, 2)):
        p = plan.replace(param_shard=degrees[0], grad_shard=degrees[1], optim_shard=degrees[2])
        chunks = make_chunks(num_chunks=1, global_count=2 * m * MICRO_BATCH * D_MODEL)
        return chunks, ShardedDataParallel(chunks, plan=p, mesh=build_mesh(p, ranks_per_node=2),
                                           comm=Comm(ranks_per_node=2), num_micro_batches=m, lr=LR, param_dtype=dtype,
                                           grad_dtype=grad_dtype, loss_scale=scale)

    def step(chunks, eng, index, *, scale=1.0):
        x, y = global_batch(index, dp=2, m=m)
        local = torch.zeros(())
        for i in range(m):
            loss = run_chunks(chunks, *micro_batch(x, y, mesh.dp_rank * m + i))
            (loss * scale).backward()
            local += loss.detach().float()
        applied = eng.optimizer_step()
        dist.all_reduce(local)
        return local.item(), applied

    # fp16, a loss scale far too large: the first steps overflow, are skipped and halve it; a skipped step's
    # batch is tried again, so the applied steps are the reference's.
    chunks, eng = engine(torch.float16, scale=DynamicLossScale(init_scale=2.0**40, growth_interval=1000))
    losses, skipped_unchanged, applied_steps, index = [], [], 0, 0
    while applied_steps < NUM_STEPS:
        before = {k: v.clone() for k, v in eng.full_state_dict().items()}
        loss, applied = step(chunks, eng, applied_steps, scale=eng.loss_scale.scale)
        after = eng.full_state_dict()
        if applied:
            losses.append(loss)
            applied_steps += 1
        else:
            skipped_unchanged.append(all(torch.equal(before[k], after[k]) for k in before) and eng.num_steps == 0)
        index += 1
        assert index < 60, "the loss scale never came down"
    out["fp16"] = {"losses": losses, "skipped": eng.loss_scale.num_skipped, "scale": eng.loss_scale.scale,
                   "skipped_unchanged": skipped_unchanged}
    # bf16 parameters, gradients accumulated and reduced in fp32 (ZeRO-3 and ZeRO-1, whose s_g = 1 path
    # accumulates into an fp32 buffer outside autograd), against one process summing in fp32.
    out["bf16"] = {}
    for name, degrees in (("zero3", (2, 2, 2)), ("zero1", (1, 1, 2))):
        for grads in ("fp32", "bf16"):
            chunks, eng = engine(torch.bfloat16, grad_dtype=torch.float32 if grads == "fp32" else None, degrees=degrees)
            eng.comm.counters.reset()
            losses = [step(chunks, eng, s)[0] for s in range(NUM_STEPS)]
            params = {k: v.float() for k, v in eng.full_state_dict().items()}
            out["bf16"][f"{name}_{grads}"] = {"losses": losses, "params": params if rank == 0 else None,
                                              "state_bytes": sum(eng.state_bytes().values()),
                                              "counters": eng.comm.counters.snapshot()}
    return out


def _worker(rank: int, world: int, tmp: str) -> dict:
    torch.manual_seed(0)
    return {"toy": _toy_engine_checks(rank, world), "trainer": _trainer_checks(rank, world, tmp)}


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    return run_on_ranks(_worker, world_size=2, args=(str(tmp_path_factory.mktemp("precision")),), timeout_s=900)


def mixed_reference(*, dp: int, m: int) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process: bf16 parameters, every micro-batch's bf16 gradients summed in fp32, Adam on fp32 masters."""
    chunks = make_chunks(num_chunks=1, global_count=dp * m * MICRO_BATCH * D_MODEL)
    params = [p for c in chunks for p in c.parameters()]
    masters = [p.detach().clone().requires_grad_(True) for p in params]
    for p in params:
        p.data = p.data.to(torch.bfloat16)
    opt = torch.optim.Adam(masters, lr=LR, foreach=False)
    losses = []
    for step in range(NUM_STEPS):
        x, y = global_batch(step, dp=dp, m=m)
        sums = [torch.zeros_like(w) for w in masters]
        total = 0.0
        for i in range(dp * m):
            loss = run_chunks(chunks, *micro_batch(x, y, i))
            loss.backward()
            total += loss.float().item()
            for s, p in zip(sums, params):
                s += p.grad.float()
                p.grad = None
        for w, s in zip(masters, sums):
            w.grad = s
        opt.step()
        with torch.no_grad():
            for p, w in zip(params, masters):
                p.copy_(w)
        losses.append(total)
    return losses, {f"0.{n}": p.detach().float() for n, p in chunks[0].named_parameters()}


# --- the checks ---------------------------------------------------------------------------------------------
def test_fp16_trainer_with_loss_scaling_tracks_fp32(results):
    from runners.config import RunMetrics
    from runners.reference import train_reference

    cfg = tiny_config(Plan(dp=2, grad_shard=2, optim_shard=2, micro_batch=2, num_micro_batches=2), steps=4)
    ref_losses, _ = train_reference(cfg)
    metrics = RunMetrics.from_dict(results[0]["trainer"]["fp16"])
    assert metrics.summary.precision == "fp16" and metrics.summary.skipped_steps == 0
    assert metrics.summary.loss_scale == 2.0**16
    # fp16 keeps 10 mantissa bits: the losses agree to ~1e-3 of the fp32 run's.
    assert metrics.losses == pytest.approx(ref_losses, abs=2e-2)


def test_fp16_moe_trainer_shares_the_loss_scale_and_tracks_fp32(results):
    from runners.config import RunMetrics
    from runners.reference import train_reference

    cfg = tiny_config(Plan(dp=2, ep=2, grad_shard=2, optim_shard=2, micro_batch=2, num_micro_batches=2), steps=4,
                      model="tiny-moe")
    ref_losses, _ = train_reference(cfg)
    metrics = RunMetrics.from_dict(results[0]["trainer"]["fp16_moe"])
    assert metrics.summary.precision == "fp16" and metrics.summary.skipped_steps == 0
    assert metrics.summary.loss_scale == 2.0**16
    assert metrics.losses == pytest.approx(ref_losses, abs=2e-2)


def test_overflowing_steps_are_skipped_untouched_and_the_scale_backs_off(results):
    got = results[0]["toy"]["fp16"]
    assert got["skipped"] >= 1 and all(got["skipped_unchanged"])
    assert got["scale"] == 2.0**40 * 0.5 ** got["skipped"]
    ref_losses, _ = reference({"degrees": (2, 2, 2), "m": 2}, dp=2)
    assert got["losses"] == pytest.approx(ref_losses, abs=3e-2)
    assert results[1]["toy"]["fp16"]["losses"] == got["losses"]


@pytest.mark.parametrize("name,degrees", [("zero3", (2, 2, 2)), ("zero1", (1, 1, 2))])
def test_bf16_with_fp32_gradient_reduction_sums_like_one_process_in_fp32(results, name, degrees):
    from runners.sharding import state_bytes_per_param

    ref_losses, ref_params = mixed_reference(dp=2, m=2)
    got = results[0]["toy"]["bf16"][f"{name}_fp32"]
    assert got["losses"] == pytest.approx(ref_losses, abs=1e-3)
    worst = max((got["params"][k] - v).abs().max().item() for k, v in ref_params.items())
    assert worst < 1e-2  # a few bf16 roundings of the same fp32 masters
    P = num_params()
    assert got["state_bytes"] == state_bytes_per_param(degrees=degrees, compute_bytes=2, grad_bytes=4) * P
    plain = results[0]["toy"]["bf16"][f"{name}_bf16"]
    assert got["state_bytes"] - plain["state_bytes"] == 2 * P / degrees[1]
    kind = "reduce_scatter" if degrees[1] > 1 else "all_reduce"
    assert got["counters"][kind] == 2 * plain["counters"][kind] > 0  # 4-byte collectives, as priced


def test_parameters_are_initialised_already_sharded(results, monkeypatch):
    import runners.param_init as param_init
    from runners.reference import train_reference

    monkeypatch.setattr(param_init, "INIT_BLOCK", INIT_TEST_BLOCK)  # the workers' blocks
    big = big_config()
    for rank in (0, 1):
        init = results[rank]["trainer"]["init"]
        # Each rank draws its half of every weight (plus at most one partial block per weight), never all.
        assert init["drawn"] < 0.6 * init["model_params"]
        # Its resident memory grows by its state and one whole unit (a gather buffer), not by the model:
        # a full fp32 draw of this model alone is 4 x model_params bytes.
        bound = init["state_bytes"] + init["largest_unit_bytes"] + 16 * 2**20
        assert init["grown_bytes"] < bound < init["state_bytes"] + 4 * init["model_params"]
    ref_losses, _ = train_reference(big)
    assert max(abs(a - b) for a, b in zip(results[0]["trainer"]["init"]["losses"], ref_losses)) <= LOSS_TOL


@pytest.mark.parametrize("name", ["zero3", "zero0"])
def test_reductions_chained_on_side_streams_are_exact(results, name):
    from runners.reference import train_reference

    plan = Plan(**ZERO3, micro_batch=1, num_micro_batches=3) if name == "zero3" else Plan(dp=2, micro_batch=1,
                                                                                        num_micro_batches=2)
    ref_losses, _ = train_reference(tiny_config(plan, steps=4))
    got = results[0]["trainer"]["ordered"][name]
    assert max(abs(a - b) for a, b in zip(got, ref_losses)) <= LOSS_TOL


def test_every_collective_gets_contiguous_tensors_on_the_runs_device(results):
    for rank in (0, 1):
        calls = results[rank]["trainer"]["collectives"]
        names = {n for n, *_ in calls}
        assert {"all_gather_single", "reduce_scatter_single", "all_reduce", "isend", "irecv"} <= names
        bad = [c for c in calls if c[1] != "cpu" or not c[2] or c[3] not in {str(d) for d in NCCL_DTYPES}]
        assert not bad, bad[:5]


def test_checkpoints_copy_each_shard_once_to_host(results):
    got = results[0]["trainer"]["checkpoint"]
    assert got["live_is_engine"] and got["pieces_on_host"] and got["num_pieces"] > 0
    assert not got["pieces_share_engine_storage"]
