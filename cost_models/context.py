"""Context-parallel communication of one layer: the all-to-all over heads and the ring's K/V traffic.

The plan's CP group of cp ranks splits into an all-to-all part of a ranks (TP ranks apart) and a ring of
r = cp / a such parts (Plan.cp_split; runners/context_parallel.py runs them). Per layer and micro-batch,
on one rank, with s the sequence, b the micro-batch, d the head dimension, p bytes an element:

- all-to-all (a > 1): q, k, v before the core and its output after, forward; their gradients backward.
  Each moves the local tensor of b (s / cp) tokens: q and the output (num_heads / tp) d wide, k and v
  (num_kv_heads / tp) d (GQA sends only the K/V heads). They sit on the critical path (the core waits for
  its inputs), so all of their time is exposed.
- ring (r > 1): K and V of b (s / r) tokens and (num_kv_heads / (tp a)) heads, one message per step:
  r - 1 forward; backward r - 1 again plus r messages of their gradients (the compute dtype), the last of
  which returns each K/V gradient home after its full turn. Each message is issued before the step's
  partial attention and hides behind it: step 0 computes two half-squares' worth of the core, every other
  step one, so a step hides behind 2 / (r + 1) or 1 / (r + 1) of the layer's core seconds; what exceeds
  that is exposed (`ring_steps`, priced by the caller's overlap rule).

Recomputation (full, or selective, which in this engine recomputes the core with its communication)
repeats the forward part.

On a CPU profile the context-parallel probe (runners/probe.measure_context) timed the engine's own
exchanges; planner/profiling.py keeps what they took beyond this module's price at the probe's shape, per
message (a ring message, an all-to-all call), as `engine_ring_extra_s_{c}` and `engine_a2a_extra_s_{c}`
per measured group size c: seconds every message of that kind pays on top of its curve's time, the
nearest measured size's (`message_extra_s`; 0 where none was measured). The ring's are added here; the
all-to-all's by cost_models/estimate.collective_time_s to every all-to-all this engine blocks on (CP's,
and MoE's dispatch, combine, expert-TP exchange and routing counts). Per message, not a factor on the
time: what the curves miss is per call (the sends' posting beside the engine's ops, ranks reaching the
exchange at different times), not a slower wire; a message is never priced below half its curve's time.
"""

from __future__ import annotations

from dataclasses import dataclass

from cost_models.comm import nearest_group_size, ring_step_time_s
from cost_models.compute import activation_bytes_per_element


@dataclass(frozen=True)
class ContextComm:
    """One layer's CP communication per micro-batch on one rank.

    a2a_forward_s / a2a_backward_s: the all-to-alls (exposed). ring_forward / ring_backward: per ring step,
    (communication seconds, core compute seconds it hides behind). The bytes are what one rank sends."""

    a2a_forward_s: float = 0.0
    a2a_backward_s: float = 0.0
    ring_forward: tuple[tuple[float, float], ...] = ()
    ring_backward: tuple[tuple[float, float], ...] = ()
    a2a_bytes: float = 0.0  # forward + backward
    ring_bytes: float = 0.0  # forward + backward


def context_comm(plan, cluster, *, model, job, core_forward_s: float, core_backward_s: float,
                 collective_time_s) -> ContextComm:
    """The CP communication of one layer of `plan` (module docstring); `core_*_s` are the layer's attention
    core seconds on this rank, `collective_time_s(cluster, **kw)` the caller's collective pricing."""
    if plan.cp == 1:
        return ContextComm()
    a, r = plan.cp_split(ranks_per_node=cluster.devices_per_node)
    p, b, d, tp = activation_bytes_per_element(job.precision), plan.micro_batch, model.head_dim, plan.tp
    tokens = b * job.seq_len // plan.cp
    a2a_fwd = a2a_bytes = 0.0
    if a > 1:
        sizes = [tokens * model.num_heads // tp * d * p] * 2 + [tokens * model.num_kv_heads // tp * d * p] * 2
        a2a_fwd = sum(collective_time_s(cluster, collective="all_to_all", size_bytes=x, group_size=a, stride=tp)
                      for x in sizes)
        a2a_bytes = 2 * sum(sizes) * (a - 1) / a
    if r == 1:
        return ContextComm(a2a_forward_s=a2a_fwd, a2a_backward_s=a2a_fwd, a2a_bytes=a2a_bytes)
    kv_bytes = 2.0 * b * (job.seq_len // r) * (model.num_kv_heads // (tp * a)) * d * p
    # The ring's slowest edge sets its pace: the link of the whole ring (ranks tp x a apart).
    link = cluster.group_link(size=r, stride=tp * a)
    send_s = ring_step_time_s(cluster.hardware, size_bytes=kv_bytes, group_size=r, link=link)
    send_s += cluster.hardware.calibration.get("collective_overhead_s", 0.0)  # per call, as estimate.collective_time_s
    send_s = with_extra(send_s, message_extra_s(cluster.hardware.calibration, "ring", r))
    return ContextComm(a2a_forward_s=a2a_fwd, a2a_backward_s=a2a_fwd, a2a_bytes=a2a_bytes,
                       ring_forward=ring_steps(r, send_s=send_s, core_s=core_forward_s, gradients=False),
                       ring_backward=ring_steps(r, send_s=send_s, core_s=core_backward_s, gradients=True),
                       ring_bytes=(3 * r - 2) * kv_bytes)


MESSAGE_EXTRA_PREFIX = "engine_{kind}_extra_s_"


def message_extra_s(calibration: dict[str, float], kind: str, size: int) -> float:
    """The context probe's seconds per message of `kind` ("ring" or "a2a") over `size` ranks (module
    docstring): the measured group size nearest in ratio (the smaller on a tie); 0 where none was measured."""
    prefix = MESSAGE_EXTRA_PREFIX.format(kind=kind)
    extras = {int(key[len(prefix):]): value for key, value in calibration.items() if key.startswith(prefix)}
    if not extras:
        return 0.0
    return extras[nearest_group_size(extras, size)]


def with_extra(seconds: float, extra_s: float) -> float:
    """A message's curve time plus the probe's extra seconds, never below half the curve's time."""
    return max(seconds / 2, seconds + extra_s)


def messages_per_layer(kind: str, size: int) -> int:
    """Messages of one layer's forward and backward per micro-batch: an all-to-all's 4 each way (q, k, v,
    the output), a ring of `size` its 3 size - 2 (ring_bytes above)."""
    return 8 if kind == "a2a" else 3 * size - 2


def ring_steps(r: int, *, send_s: float, core_s: float, gradients: bool) -> tuple[tuple[float, float], ...]:
    """(communication, compute beside it) of each ring step; backward (`gradients`) also sends the K/V
    gradients (one message per step, as large as the K/V's), and the last one after its step's compute."""
    unit = core_s / (r + 1)
    steps = []
    for step in range(r):
        comm = (send_s if step < r - 1 else 0.0) + (send_s if gradients else 0.0)
        steps.append((comm, 2 * unit if step == 0 else unit))
    if gradients:  # the last gradient message waits for the last step's compute: nothing left to hide it
        last_comm, last_compute = steps[-1]
        steps[-1] = (0.0, last_compute)
        steps.append((last_comm, 0.0))
    return tuple(steps)
