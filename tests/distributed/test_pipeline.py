"""The pipeline executor on gloo processes against one-process training of the same toy model.

Run: python -m pytest -q tests/distributed/test_pipeline.py

The toy model is an embedding, L units Linear(h, h) + tanh, and a linear head with a summed cross entropy
divided by the global token count; chunks are cut per Plan.chunk_layer_ranges. Every configuration of a
pipeline width runs in one spawn (process start-up dominates on two cores), 8 Adam steps each.
"""

from __future__ import annotations

import weakref

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from specs.schedule import max_in_flight, rank_actions
from specs.plan import Plan
from runners.comm import Comm
from runners.pipeline import GRADIENT, Message, message_tag, run_pipeline
from tests.distributed.spawn import run_on_ranks

VOCAB, HIDDEN, SEQ, MICRO_BATCH, STEPS, LR, SEED = 16, 8, 4, 2, 8, 1e-2, 7
LOSS_TOL, PARAM_TOL = 1e-4, 1e-3

# name -> (schedule, pp, virtual_stages, num_micro_batches, stage_layers, num_layers, pass the table)
CONFIGS = {
    "gpipe-pp2-m4-(1,3)": ("gpipe", 2, 1, 4, (1, 3), 4, True),
    "1f1b-pp2-m8-(3,1)": ("1f1b", 2, 1, 8, (3, 1), 4, True),
    "1f1b-pp2-m4-on-demand": ("1f1b", 2, 1, 4, None, 4, False),
    "interleaved-pp2-v2-m4-(2,1,1,2)": ("interleaved-1f1b", 2, 2, 4, (2, 1, 1, 2), 6, True),
    # Receives posted on demand (no table): the path a caller without the schedule table takes on gloo.
    "interleaved-pp2-v2-m4-on-demand": ("interleaved-1f1b", 2, 2, 4, None, 4, False),
    "gpipe-pp4-m4": ("gpipe", 4, 1, 4, None, 4, True),
    "1f1b-pp4-m8-(1,2,1,2)": ("1f1b", 4, 1, 8, (1, 2, 1, 2), 6, True),
    "interleaved-pp4-v2-m8": ("interleaved-1f1b", 4, 2, 8, None, 8, True),
}


def plan_of(name: str) -> Plan:
    schedule, pp, v, m, stage_layers, _, _ = CONFIGS[name]
    return Plan(pp=pp, virtual_stages=v, num_micro_batches=m, micro_batch=MICRO_BATCH, schedule=schedule,
                stage_layers=stage_layers)


class ToyChunk(nn.Module):
    def __init__(self, *, embedding: nn.Module | None, units: list[nn.Module], head: nn.Module | None,
                 num_tokens: int) -> None:
        super().__init__()
        self.embedding, self.units, self.head = embedding, nn.ModuleList(units), head
        self.num_tokens = num_tokens
        self.live: LiveCount | None = None

    def forward(self, x: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if self.embedding is not None:
            x = self.embedding(x)
        for unit in self.units:
            x = torch.tanh(unit(x))
        if self.head is not None:
            x = F.cross_entropy(self.head(x).flatten(0, 1), targets.flatten(), reduction="sum") / self.num_tokens
        if self.live is not None:
            self.live.track(x)
        return x


class LiveCount:
    """Chunk outputs not yet garbage: the micro-batch activations a rank holds (its peak is what
    max_in_flight predicts if the executor frees each micro-batch right after its backward)."""

    def __init__(self) -> None:
        self.live = self.peak = 0

    def track(self, output: torch.Tensor) -> None:
        self.live += 1
        self.peak = max(self.peak, self.live)
        weakref.finalize(output, self._release)

    def _release(self) -> None:
        self.live -= 1


def build_chunks(plan: Plan, num_layers: int) -> list[ToyChunk]:
    """The whole model, initialised from SEED, cut into the plan's chunks."""
    torch.manual_seed(SEED)
    embedding, head = nn.Embedding(VOCAB, HIDDEN), nn.Linear(HIDDEN, VOCAB)
    units = [nn.Linear(HIDDEN, HIDDEN) for _ in range(num_layers)]
    ranges = plan.chunk_layer_ranges(num_layers)
    num_tokens = plan.global_batch * SEQ
    return [ToyChunk(embedding=embedding if c == 0 else None, units=[units[i] for i in r],
                     head=head if c == len(ranges) - 1 else None, num_tokens=num_tokens)
            for c, r in enumerate(ranges)]


def micro_batches(plan: Plan, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1000 + step)
    seqs = torch.randint(0, VOCAB, (plan.global_batch, SEQ + 1), generator=g)
    return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in seqs.split(MICRO_BATCH)]


def grads_of(chunk: nn.Module) -> dict[str, torch.Tensor]:
    return {k: p.grad.clone() for k, p in chunk.named_parameters()}


def train_reference(name: str) -> tuple[list[float], dict[int, dict[str, torch.Tensor]], dict[int, dict]]:
    """Losses per step, final parameters and first-step gradients per chunk, trained in this process."""
    plan = plan_of(name)
    chunks = build_chunks(plan, CONFIGS[name][5])
    opt = torch.optim.Adam([p for c in chunks for p in c.parameters()], lr=LR)
    losses, first_grads = [], {}
    for step in range(STEPS):
        total = 0.0
        for tokens, targets in micro_batches(plan, step):
            x = tokens
            for chunk in chunks:
                x = chunk(x, targets)
            x.backward()
            total += x.item()
        if step == 0:
            first_grads = {c: grads_of(ch) for c, ch in enumerate(chunks)}
        opt.step()
        opt.zero_grad()
        losses.append(total)
    params = {c: {k: v.detach().clone() for k, v in ch.state_dict().items()} for c, ch in enumerate(chunks)}
    return losses, params, first_grads


class RecordingComm(Comm):
    """Logs every gradient send's tag, so the hook's position among the sends can be checked."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self.log: list[tuple[str, int]] = []

    def isend(self, tensor, *, dst, group=None, tag=0):
        self.log.append(("send", tag))
        return super().isend(tensor, dst=dst, group=group, tag=tag)


def train_pipelined(name: str, rank: int, pp: int) -> dict:
    schedule, _, v, m, _, num_layers, pass_table = CONFIGS[name]
    plan = plan_of(name)
    all_chunks = build_chunks(plan, num_layers)
    mine = {c: all_chunks[c] for c in range(rank, plan.num_chunks, pp)}
    opt = torch.optim.Adam([p for c in mine.values() for p in c.parameters()], lr=LR)
    table = rank_actions(schedule=schedule, pp=pp, virtual_stages=v, num_micro_batches=m)
    comm = RecordingComm(ranks_per_node=pp)
    losses, hook_checks, first_grads, live_counts = [], [], {}, []
    for step in range(STEPS):
        live = LiveCount()
        for chunk in mine.values():
            chunk.live = live
        at_hook: dict[int, list[torch.Tensor]] = {}

        def after_last_backward(chunk: int) -> None:
            assert chunk not in at_hook, f"hook called twice for chunk {chunk}"
            at_hook[chunk] = [p.grad.clone() for p in mine[chunk].parameters()]
            last_grad = message_tag(Message(GRADIENT, chunk, m - 1), num_chunks=plan.num_chunks, num_micro_batches=m)
            comm.log.append(("hook", chunk))
            hook_checks.append(("send", last_grad) in comm.log or chunk == 0)

        comm.log.clear()
        out = run_pipeline(actions=table[rank], chunks=mine, micro_batches=micro_batches(plan, step),
                           pp_ranks=list(range(pp)), num_chunks=plan.num_chunks, comm=comm,
                           activation_shape=(MICRO_BATCH, SEQ, HIDDEN), dtype=torch.float32,
                           device=torch.device("cpu"), after_last_backward=after_last_backward,
                           schedule_table=table if pass_table else None)
        assert sorted(at_hook) == sorted(mine), f"hooks for {sorted(at_hook)}, chunks {sorted(mine)}"
        # The hook came after the chunk's last backward iff the gradient did not change afterwards.
        for c, grads in at_hook.items():
            hook_checks.append(all(torch.equal(g, p.grad) for g, p in zip(grads, mine[c].parameters())))
        if out:
            losses.append(sum(x.item() for x in out))
            assert len(out) == m
        if step == 0:
            first_grads = {c: grads_of(ch) for c, ch in mine.items()}
        live_counts.append((live.peak, live.live, max_in_flight(table[rank])))
        opt.step()
        opt.zero_grad()
    return {"losses": losses, "hook_checks": hook_checks, "p2p_bytes": comm.counters.bytes_by_kind["p2p"],
            "first_grads": first_grads, "live_counts": live_counts,
            "params": {c: {k: v.detach().clone() for k, v in ch.state_dict().items()} for c, ch in mine.items()}}


def _worker(rank: int, pp: int, names: list[str]) -> dict:
    return {name: train_pipelined(name, rank, pp) for name in names}


@pytest.fixture(scope="module")
def pipelined():
    cache: dict[int, list[dict]] = {}

    def get(pp: int) -> list[dict]:
        if pp not in cache:
            names = [n for n, cfg in CONFIGS.items() if cfg[1] == pp]
            cache[pp] = run_on_ranks(_worker, world_size=pp, args=(names,), timeout_s=240)
        return cache[pp]
    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_pipeline_matches_one_process_training(name, pipelined):
    pp, num_chunks = CONFIGS[name][1], plan_of(name).num_chunks
    per_rank = [r[name] for r in pipelined(pp)]
    ref_losses, ref_params, ref_grads = train_reference(name)
    losses = per_rank[(num_chunks - 1) % pp]["losses"]
    assert all(not r["losses"] for p, r in enumerate(per_rank) if p != (num_chunks - 1) % pp)
    assert len(losses) == STEPS
    worst = max(abs(a - b) for a, b in zip(losses, ref_losses))
    assert worst <= LOSS_TOL, f"losses differ by {worst:.2e}: {losses} vs {ref_losses}"
    assert ref_losses[-1] < ref_losses[0]  # the comparison is over a run that actually trains
    # Adam's update is nearly invariant to a gradient's scale, so compare the first step's gradients too.
    for c in range(num_chunks):
        for key, ref in ref_grads[c].items():
            got = per_rank[c % pp]["first_grads"][c][key]
            assert torch.allclose(got, ref, rtol=1e-4, atol=1e-7), f"chunk {c} grad {key} differs"
        got = per_rank[c % pp]["params"][c]
        for key, ref in ref_params[c].items():
            diff = (got[key] - ref).abs().max().item()
            assert diff <= PARAM_TOL, f"chunk {c} {key} differs by {diff:.2e}"


@pytest.mark.parametrize("name", list(CONFIGS))
def test_hook_once_per_chunk_after_its_last_backward_and_gradient_send(name, pipelined):
    pp = CONFIGS[name][1]
    for r in pipelined(pp):
        checks = r[name]["hook_checks"]
        assert checks and all(checks)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_activations_are_freed_right_after_their_backward(name, pipelined):
    for rank, r in enumerate(pipelined(CONFIGS[name][1])):
        for peak, left, expected in r[name]["live_counts"]:
            assert (peak, left) == (expected, 0), f"rank {rank}: peak {peak} live activations, schedule holds {expected}"


def test_p2p_bytes_are_counted_per_message(pipelined):
    # 1F1B pp=2, m=4, one boundary: each step rank 0 sends 4 activations, rank 1 sends 4 gradients.
    message_bytes = MICRO_BATCH * SEQ * HIDDEN * 4
    for r in pipelined(2):
        assert r["1f1b-pp2-m4-on-demand"]["p2p_bytes"] == STEPS * 4 * message_bytes


def test_real_tiny_model_through_the_training_loop_interleaved():
    # The executor under runners.train on the transformer: [seq, batch, hidden] messages, two chunks per
    # rank so both directions between the ranks carry activations and gradients.
    from tests.distributed.harness import check_against_reference, run_plans, spread_seeds, tiny_config

    plan = Plan(pp=2, virtual_stages=2, micro_batch=1, num_micro_batches=4, schedule="interleaved-1f1b",
                stage_layers=(1, 3, 2, 2))
    cfgs = [tiny_config(plan, seed=seed) for _, seed in spread_seeds([plan])]
    for cfg, (metrics, params) in zip(cfgs, run_plans(cfgs)):
        check_against_reference(cfg, metrics, params)
