"""Data-parallel sharding engine: per-unit flat buffers, three sharding degrees, Adam on fp32 shards.

One file per technique: layout.py (the nested shards, a unit's flat buffers), gather.py (parameter
gather and prefetch), maz3.py (MAZ3 tiers), buckets.py (reduce-scatter buckets and the boundary
all-reduce), commshift.py (held reductions), lins.py (the optimizer-shard redistribution), adam.py (the
optimizer); engine.py (`ShardedDataParallel`) wires them to a rank's chunks.

Parameters, gradients and optimizer states are sharded over their own degree of the DP group,
s_p | s_g | s_os | dp (Lins' generalisation of ZeRO; ZeRO-0..3 and HSDP/MiCS are points of it), one
*unit* (embedding, transformer block, head) at a time. The semantics are the ones the cost model prices:

- s_p > 1: a unit's parameters live as a 1/s_p shard; they are all-gathered in the s_p group before the
  unit's forward and again before its backward, and the gathered buffer is freed (its storage resized to
  zero, FSDP1-style, so the module's parameter views stay valid) after each. `prefetch_depth` units
  ahead (behind, in backward) are gathered asynchronously; the wait is just before use.
- s_g == 1: the full fp32 gradient is accumulated over micro-batches and all-reduced (sum) over the DP
  group at the accumulation boundary. s_g > 1: after every micro-batch's backward of a unit, its
  gradient is reduce-scattered in the s_g group into an fp32 shard; the shard is all-reduced across the
  dp / s_g replica groups only at the boundary. Reductions are bucketed (`bucket_size_bytes`, units in
  backward order) and asynchronous; the boundary of a unit is its num_micro_batches-th backward of the
  step, so pipeline schedules whose chunks finish at different times work unchanged.
- Adam (exactly torch.optim.Adam's single-tensor arithmetic) on the 1/s_os shard with fp32 master
  weights, then the updated shards are all-gathered inside the s_os / s_p ranks that share my parameter
  shard (nothing when s_os == s_p). Lins (Chen et al., IWQoS 2024, AMSP): that redistribution is issued
  asynchronously at the end of optimizer_step and overlaps the next step's forward; each unit waits for
  its bucket in its forward pre-hook (before its first gather), and everything that reads parameters
  outside forward (full_state_dict, local_state, load_local_state, the next optimizer_step) waits first.
- MAZ3, memory-assisted ZeRO-3 (Liu et al., ICNP 2025), per transformer layer (`plan.layer_cache(i)`;
  units that are not transformer blocks use "none"). What happens to a layer's forward-gathered
  parameters until its backward: "none" freed, all-gathered again for backward (plain ZeRO-3);
  "device" kept gathered until the backward of the last micro-batch in flight (no backward gather);
  "host" copied to host memory after every forward (pinned, on a side stream, on CUDA) and copied back
  before backward instead of the gather, counted as "host_device" bytes; "secondary" (ZeRO++ hpZ) each
  rank keeps the 1/(param-group ranks in its node) slice and the backward gather runs inside the node.
  Host and secondary copies are dropped once no micro-batch of the unit is in flight.
- Commshift (Hosoki et al., CCGrid 2025), defer_grad_sync: every gradient reduction of a chunk's last
  micro-batch (its reduce-scatter and the boundary all-reduce) waits for start_grad_sync(chunk), which
  the pipeline calls right after the chunk's last input-gradient send, so it never delays that send.

Nested shard layout (so each rank's optimizer shard lies inside its gradient shard, inside its parameter
shard): a unit's flat buffer, padded to a multiple of s_os, is cut into s_p parameter chunks, each into
s_g / s_p gradient chunks, each into s_os / s_g optimizer chunks. DP position q holds parameter chunk
p(q) = q % s_p, gradient chunk g(q) = p(q) * (s_g/s_p) + (q % s_g) // s_p and optimizer chunk
o(q) = g(q) * (s_os/s_g) + (q % s_os) // s_g (`shard_chunks`). Collectives put chunk i on *group rank*
i, and groups are sorted consecutive DP positions, so the parameter all-gather is direct while the
gradient reduce-scatter and the optimizer redistribution permute chunks while packing their buckets
(a no-op for ZeRO-0..3 and HSDP, a copy only for mixes such as (2, 4, 4)).

Precision: parameters are held in the compute dtype (`param_dtype`, default the modules' dtype), and so
are gradients, accumulated and reduced in it (Rajbhandari et al., "ZeRO", SC'20, section 3.1: fp16
parameters and gradients); the optimizer keeps fp32 master weights (the parameter shard itself when that
is fp32) and fp32 Adam moments, and Adam reads the gradient shard upcast to fp32. The state bytes per
parameter are then the ZeRO paper's: bf16/fp16: 2/s_p + 2/s_g + 12/s_os (16, 4 + 12/N, 2 + 14/N, 16/N for
ZeRO-0..3); fp32: 4/s_p + 4/s_g + 8/s_os (`state_bytes_per_param`).

All ranks of a DP group must start with identical parameters (same seed); nothing is broadcast.
"""

from runners.sharding.engine import ShardedDataParallel
from runners.sharding.layout import shard_chunks, state_bytes_per_param

__all__ = ["ShardedDataParallel", "shard_chunks", "state_bytes_per_param"]
