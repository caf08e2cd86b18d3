"""ShardedDataParallel: a rank's chunks under the plan's DP sharding (runners/sharding/__init__.py)."""

from __future__ import annotations

import warnings
from typing import Callable

import torch
import torch.distributed as dist
from torch import nn

from runners.comm import all_gather_single
from runners.sharding.adam import AdamSettings, adam_update
from runners.sharding.buckets import GradientReducer
from runners.sharding.commshift import DeferredSync
from runners.sharding.gather import ParameterGather
from runners.sharding.layout import FlatUnit, shard_chunks
from runners.sharding.lins import Redistributor
from runners.sharding.loss_scale import DynamicLossScale
from runners.sharding.streams import SideStreams
from specs.errors import PlannerError

# The first unit's input (token ids) needs no gradient, so torch warns that its full backward hook fires
# on the outputs' gradients; the pre-hook is exactly that, and the warning would repeat every step.
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                        "respect to module outputs")


def decide_overflow(engines, loss_scale: DynamicLossScale | None) -> tuple[bool, float]:
    """(whether this step's gradients overflowed on any rank of any of `engines`, 1 / the scale they carry),
    and the loss scale updated once for the step; (False, 1.0) without a loss scale."""
    if loss_scale is None:
        return False, 1.0
    grads = [u.grad for e in engines for u in e.units]
    device = grads[0].device if grads else (engines[0].device or torch.device("cpu"))
    overflow = loss_scale.found_inf(grads, device=device)
    inv_scale = 1.0 / loss_scale.scale
    loss_scale.update(found_inf=overflow)
    return overflow, inv_scale


class ShardedDataParallel:
    """Trains a rank's model chunks under the plan's DP sharding (see the package docstring).

    Use: run forward/backward of every micro-batch through the chunks as usual (the hooks gather, free
    and reduce), then `optimizer_step()`; under defer_grad_sync the pipeline calls `start_grad_sync(c)`
    right after chunk c's last input-gradient send. `full_state_dict()` gathers the parameters for tests;
    `local_state()` / `load_local_state()` save and restore this rank's shards.

    Args:
        chunks: this rank's model chunks, each with `units: nn.ModuleList` run in order by its forward.
        plan: the plan (dp, shard degrees, prefetch_depth, bucket_size_bytes, pp).
        mesh: runners.mesh.Mesh of this process. comm: runners.comm.Comm that counts every collective.
        num_micro_batches: backward passes of every unit per step (the accumulation boundary).
        defer_grad_sync: issue each chunk's last-micro-batch reduce-scatter and boundary all-reduce only at
            start_grad_sync(chunk) (Commshift).
        param_dtype: compute dtype of the parameters (default: the modules'); the master stays fp32.
        grad_dtype: dtype gradients accumulate and reduce in (default: param_dtype; fp32 under the plan's
            reduce_fp32).
        device: where the shards live (default: the first parameter's; needed for deferred parameters,
            built without storage by runners.transformer.deferred_init).
        loss_scale: a loss_scale.DynamicLossScale (fp16): the caller multiplies the loss by its `scale`;
            optimizer_step divides it out, or skips the step when a gradient overflowed.
        stream_ordered: chain the gradient reductions on side streams instead of polling them
            (runners/sharding/streams.py; default: on CUDA under NCCL). True on CPU runs the same logic
            with no-op streams (for tests).
        experts: None (every parameter, units = each chunk's `units`), False (all but MoE experts' parameters,
            `is_expert`), or True (only those, each chunk's GroupedExperts modules as its units; `plan` and
            `mesh` are then the expert views, runners/train.py): experts shard over their own expert-DP group.
    """

    def __init__(self, chunks, *, plan, mesh, comm, num_micro_batches: int, lr: float,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 defer_grad_sync: bool = False, param_dtype: torch.dtype | None = None,
                 grad_dtype: torch.dtype | None = None, device: torch.device | None = None,
                 loss_scale: DynamicLossScale | None = None, stream_ordered: bool | None = None,
                 experts: bool | None = None) -> None:
        if num_micro_batches < 1:
            raise PlannerError(f"num_micro_batches must be at least 1, got {num_micro_batches}")
        self.chunks, self.plan, self.mesh, self.comm = list(chunks), plan, mesh, comm
        self.num_micro_batches = num_micro_batches
        self.adam = AdamSettings(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self.degrees = plan.shard_degrees
        self.num_steps = 0
        self.loss_scale = loss_scale
        self.device = device
        self.experts = experts
        self._build_units(param_dtype, grad_dtype)
        device = self.units[0].flat.device if self.units else torch.device("cpu")
        self.streams = SideStreams(device)
        if stream_ordered is None:
            stream_ordered = device.type == "cuda" and dist.get_backend(mesh.grad_group) == "nccl"
        self.lins = Redistributor(self.units, degrees=self.degrees, mesh=mesh, comm=comm,
                                  bucket_size_bytes=plan.bucket_size_bytes)
        self.gather = ParameterGather(self.units_by_chunk, s_p=self.degrees[0], prefetch_depth=plan.prefetch_depth,
                                      mesh=mesh, comm=comm, lins=self.lins, streams=self.streams)
        self.deferred = DeferredSync(len(self.chunks), enabled=defer_grad_sync)
        self.reducer = GradientReducer(self.units_by_chunk, plan=plan, mesh=mesh, comm=comm, deferred=self.deferred,
                                       streams=self.streams, ordered=stream_ordered)
        self._register_hooks()

    @property
    def peak_param_bytes(self) -> int:
        return self.gather.peak_param_bytes

    # --- construction ----------------------------------------------------------------------------
    def _build_units(self, param_dtype: torch.dtype | None, grad_dtype: torch.dtype | None) -> None:
        self.units_by_chunk: list[list[FlatUnit]] = []
        self.names: dict[int, str] = {}
        seen: dict[int, str] = {}
        for v, chunk in enumerate(self.chunks):
            c = v * self.mesh.pp + self.mesh.pp_rank  # the global chunk id, as the pipeline names chunks
            for name, p in chunk.named_parameters():
                self.names[id(p)] = f"{c}.{name}"
            units = []
            for i, module in enumerate(self._unit_modules(chunk)):
                params = [p for p in module.parameters() if p.requires_grad and self._selects(p)]
                for p in params:
                    if id(p) in seen and self.degrees[0] > 1:
                        raise PlannerError(f"parameter {self.names.get(id(p))} is in two units ({seen[id(p)]} and "
                                           f"chunk {v} unit {i}); sharded parameters (param_shard > 1) need each "
                                           f"in one unit")
                # Unsharded parameters stay whole on the device: a later unit that uses one (a tied head)
                # borrows it from the unit that owns it, and its gradient, summed by autograd over both
                # uses, reaches the owner's hook once.
                params = [p for p in params if id(p) not in seen]
                for p in params:
                    seen[id(p)] = f"chunk {v} unit {i}"
                if not params:
                    continue
                dtype = param_dtype or params[0].dtype
                # Only transformer blocks carry a layer index; the plan's MAZ3 tiers are per layer.
                layer = getattr(module, "layer_index", None)
                tier = self.plan.layer_cache(layer) if layer is not None else "none"
                units.append(FlatUnit(module, params, chunk=v, position=len(units), q=self.mesh.shard_rank,
                                      degrees=self.degrees, dtype=dtype, tier=tier, grad_dtype=grad_dtype,
                                      device=self.device))
            self.units_by_chunk.append(units)
        self.units = [u for units in self.units_by_chunk for u in units]

    def _unit_modules(self, chunk) -> list[nn.Module]:
        if self.experts:
            from runners.moe import GroupedExperts

            return [m for m in chunk.modules() if isinstance(m, GroupedExperts)]
        return list(chunk.units)

    def _selects(self, p: nn.Parameter) -> bool:
        return self.experts is None or bool(getattr(p, "is_expert", False)) == self.experts

    def _register_hooks(self) -> None:
        for u in self.units:
            u.module.register_forward_pre_hook(lambda m, args, u=u: self.gather.pre_forward(u))
            if self.degrees[0] > 1:  # parameters to free after forward and gather before backward
                u.module.register_forward_hook(lambda m, args, out, u=u: self.gather.post_forward(u))
                u.module.register_full_backward_pre_hook(lambda m, grad_out, u=u: self.gather.pre_backward(u))
            for i, p in enumerate(u.params):
                p.register_post_accumulate_grad_hook(lambda p, u=u, i=i: self._on_grad(u, i))

    # --- backward ------------------------------------------------------------------------------------
    def _on_grad(self, u: FlatUnit, i: int) -> None:
        if not self.reducer.on_grad(u, i):
            return
        u.in_backward = False
        u.num_backward += 1
        if u.num_backward > self.num_micro_batches:
            raise RuntimeError(f"unit {u.position} of chunk {u.chunk} ran backward {u.num_backward} times in one "
                               f"step, but num_micro_batches is {self.num_micro_batches}; call optimizer_step()")
        u.num_in_flight = max(0, u.num_in_flight - 1)
        if u.num_in_flight == 0:
            self.gather.tiers.drop(u)
        if u.tier != "device" or u.num_in_flight == 0:
            self.gather.free(u)
        self.reducer.unit_done(u, boundary=u.num_backward == self.num_micro_batches)

    def start_grad_sync(self, chunk: int) -> None:
        """Issue the last micro-batch's reduce-scatter and the boundary reduction of global chunk id `chunk`
        (c = v * pp + pp_rank, as the pipeline schedule names chunks), for defer_grad_sync mode; a second
        call in a step is a no-op."""
        v, rest = divmod(chunk - self.mesh.pp_rank, self.mesh.pp)
        if rest or not 0 <= v < len(self.chunks):
            raise RuntimeError(f"start_grad_sync({chunk}): chunk {chunk} is not on pipeline rank {self.mesh.pp_rank}")
        self.reducer.release(v)

    # --- optimizer -----------------------------------------------------------------------------------
    def unit_grad(self, module: nn.Module) -> torch.Tensor:
        """The gradient (compute dtype) this rank holds for unit `module`: the whole flat buffer when s_g == 1, else
        its gradient chunk g(q); final (reduced over DP) inside optimizer_step's `before_update`. Two
        units of equal size (a tied embedding and output projection) have chunks that line up."""
        for u in self.units:
            if u.module is module:
                return u.grad
        raise KeyError(f"{type(module).__name__} is not a unit with trainable parameters")

    def optimizer_step(self, *, before_update: Callable[[], None] | None = None) -> bool:
        """Wait for the gradient reductions, Adam-step my shard, redistribute, and zero the gradients.

        `before_update` runs once the gradients are reduced and before Adam reads them (e.g. to sum the
        gradients of tied copies through unit_grad). The redistribution of the updated shards is left in
        flight (Lins); the next forward waits for it unit by unit. Under a loss scale, a step whose
        gradients overflowed on any rank is skipped (parameters and Adam state unchanged). Returns whether
        the parameters were updated. (Two engines sharing a loss scale, an MoE model's dense and expert
        ones, step through `finish_gradients`, one `decide_overflow` over both, and `apply_update` each.)"""
        self.finish_gradients(before_update=before_update)
        return self.apply_update(decide_overflow([self], self.loss_scale))

    def finish_gradients(self, *, before_update: Callable[[], None] | None = None) -> None:
        """Every micro-batch's gradients reduced and final (`optimizer_step`'s first half)."""
        self.lins.finish_all()
        for u in self.units:
            if u.num_backward != self.num_micro_batches:
                raise RuntimeError(f"unit {u.position} of chunk {u.chunk} ran backward {u.num_backward} times this "
                                   f"step, expected num_micro_batches = {self.num_micro_batches}")
        if self.deferred.enabled:  # chunks the pipeline did not release yet
            for v in reversed(range(len(self.chunks))):
                self.start_grad_sync(v * self.mesh.pp + self.mesh.pp_rank)
        self.reducer.drain()
        if before_update is not None:
            before_update()

    def apply_update(self, decision: tuple[bool, float]) -> bool:
        """Adam-step the shards unless `decision` (overflow, 1 / the scale the gradients carry) says the step
        overflowed; zero the gradients either way (`optimizer_step`'s second half)."""
        overflow, inv_scale = decision
        if not overflow:
            self.num_steps += 1
            for u in self.units:
                adam_update(u, step=self.num_steps, settings=self.adam, grad_scale=inv_scale)
            with torch.no_grad():
                self.lins.issue()
        for u in self.units:
            u.grad.zero_()
            u.num_backward = 0
            u.boundary_done = False
            u.rs_reduced = self.degrees[1] == 1
        self.deferred.new_step()
        return not overflow

    # --- state ----------------------------------------------------------------------------------
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full parameters (gathered, compute dtype) named '<global chunk id>.<name in the chunk>' (as
        runners.transformer.canonical_names keys them); a collective over the parameter group."""
        out: dict[str, torch.Tensor] = {}
        s_p = self.degrees[0]
        self.lins.finish_all()
        for u in self.units:
            flat = u.flat
            if s_p > 1:
                flat = torch.empty(u.padded, dtype=u.param_shard.dtype, device=u.param_shard.device)
                self.comm.all_gather(flat, u.param_shard, self.mesh.param_group)
            for p, off in zip(u.params, u.offsets):
                out[self.names[id(p)]] = flat[off:off + p.numel()].view(p.shape).clone()
        return out

    def full_gradients(self) -> dict[str, torch.Tensor]:
        """The step's reduced gradients, whole (assembled over the grad group), named as full_state_dict.

        Valid inside optimizer_step's `before_update` (reduced over DP, not yet applied); for tests. A
        collective over the grad group that the byte counters leave out."""
        s_g = self.degrees[1]
        # Group rank r holds gradient chunk order[r] (the grad group is s_g consecutive DP positions).
        order = [shard_chunks(r, degrees=self.degrees)[1] for r in range(s_g)]
        out: dict[str, torch.Tensor] = {}
        for u in self.units:
            grad = u.grad
            if s_g > 1:
                rows = torch.empty(u.padded, dtype=grad.dtype, device=grad.device)
                all_gather_single(rows, grad, group=self.mesh.grad_group)
                grad = torch.empty_like(rows)
                grad.view(s_g, -1)[order] = rows.view(s_g, -1)
            for p, off in zip(u.params, u.offsets):
                out[self.names[id(p)]] = grad[off:off + p.numel()].view(p.shape).clone()
        return out

    def local_state(self, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """This rank's shards (parameters, fp32 master, Adam moments) and the step count, for checkpoints:
        copies, or (`copy` False) the live tensors themselves, for a caller that copies what it needs to
        host memory (no second device copy of every shard)."""
        self.lins.finish_all()
        state = {"num_steps": torch.tensor(self.num_steps)}
        for i, u in enumerate(self.units):
            for key in ("param_shard", "master", "exp_avg", "exp_avg_sq"):
                tensor = getattr(u, key)
                state[f"unit{i}.{key}"] = tensor.clone() if copy else tensor
        return state

    def load_local_state(self, state: dict[str, torch.Tensor]) -> None:
        expected = {"num_steps"} | {f"unit{i}.{k}" for i in range(len(self.units))
                                    for k in ("param_shard", "master", "exp_avg", "exp_avg_sq")}
        if set(state) != expected:
            bad = sorted(set(state) ^ expected)[0]
            raise PlannerError(f"checkpoint state does not match this engine's shards: key {bad!r}")
        self.lins.finish_all()  # an in-flight update would overwrite the loaded shards
        self.num_steps = int(state["num_steps"])
        with torch.no_grad():
            for i, u in enumerate(self.units):
                for key in ("param_shard", "master", "exp_avg", "exp_avg_sq"):
                    target = getattr(u, key)
                    if target.shape != state[f"unit{i}.{key}"].shape:
                        raise PlannerError(f"checkpoint unit{i}.{key} has shape {tuple(state[f'unit{i}.{key}'].shape)}, "
                                           f"expected {tuple(target.shape)}")
                    target.copy_(state[f"unit{i}.{key}"])

    def state_bytes(self) -> dict[str, int]:
        """Bytes of storage this rank holds now, by kind (distinct storages only)."""
        seen: set[int] = set()

        def size(t: torch.Tensor) -> int:
            storage = t.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                return 0
            seen.add(storage.data_ptr())
            return storage.nbytes()

        kinds = {"params": 0, "grads": 0, "optimizer": 0}
        for u in self.units:
            kinds["params"] += size(u.flat) + size(u.param_shard)
            kinds["grads"] += size(u.grad)
            kinds["optimizer"] += size(u.master) + size(u.exp_avg) + size(u.exp_avg_sq)
        return kinds
