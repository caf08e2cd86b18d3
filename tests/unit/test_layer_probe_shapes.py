"""The layer probe times the Block at the shapes it names: the Block's layout is [s, b, h], so a probe
point (micro-batch b, sequence s) must run attention over s tokens, not over b (which once made every CPU
point attend over 1-4 tokens and the GPU points over 1-4 of their 1024-2048)."""

import dataclasses

import torch

import runners.probe as probe
from specs.model import PRESETS


class _Recorder(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(1))
        self.shapes: list[tuple[int, ...]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.shapes.append(tuple(x.shape))
        return x * self.weight


def test_measure_layer_feeds_each_point_as_seq_batch_hidden(monkeypatch) -> None:
    model = dataclasses.replace(PRESETS["tiny"], max_seq_len=128)
    recorders: list[_Recorder] = []

    def chunk(*_args, **_kwargs):
        recorders.append(_Recorder())
        return recorders[-1]

    monkeypatch.setattr(probe, "_probe_chunk", chunk)
    points = probe.measure_layer(model, device=torch.device("cpu"), dtype=torch.float32, budget_s=0.0, rounds=1)
    seen = {shape for r in recorders for shape in r.shapes}
    expected = {(s, b, model.hidden_size) for b, s in probe.probe_shapes(model)}
    assert seen == expected
    assert {(p.micro_batch, p.seq_len) for p in points} == set(probe.probe_shapes(model))



def test_a_small_model_gets_one_compute_bound_point_on_cpu_within_the_flop_budget() -> None:
    wide = dataclasses.replace(PRESETS["tiny"], name="h128", hidden_size=128, num_heads=4, num_kv_heads=4,
                               ffn_hidden_size=352, max_seq_len=4096)
    for model in (PRESETS["tiny"], wide):
        shapes = probe.probe_shapes(model)
        b, s = shapes[-1]
        assert len(shapes) == len(probe.PROBE_SHAPES) + 1
        assert b * s == probe.LONG_PROBE_TOKENS and s == min(probe.LONG_PROBE_SEQ, model.max_seq_len)
        flops = b * s * (2 * (model.attention_params() + model.mlp_params()) + 2 * s * model.hidden_size)
        assert flops <= probe.LONG_PROBE_FLOPS


def test_a_large_model_or_a_gpu_gets_no_extra_point() -> None:
    large = PRESETS["llama3.2-1b"]
    assert probe.probe_shapes(large) == [(b, min(s, large.max_seq_len)) for b, s in probe.PROBE_SHAPES]
    cuda = torch.device("cuda", 0)
    assert probe.probe_shapes(PRESETS["tiny"], device=cuda) == [(b, min(s, 128)) for b, s in probe.CUDA_PROBE_SHAPES]


def test_the_sharding_probes_local_collectives_fill_what_the_engine_reads() -> None:
    """LocalComm (runners/probe.py) stands in for the data-parallel collectives: an all-gather's output
    holds the shard once per rank, a reduce-scatter's output the input's first chunk, an all-reduce leaves
    its tensor; none returns a work to wait for."""
    shard, full = torch.tensor([1.0, 2.0, 3.0]), torch.arange(6.0)
    gathered, scattered, reduced = torch.empty(6), torch.empty(3), torch.ones(4)
    assert probe.LocalComm._c10d_all_gather(gathered, shard, group=None, async_op=True) is None
    assert gathered.tolist() == [1.0, 2.0, 3.0, 1.0, 2.0, 3.0]
    assert probe.LocalComm._c10d_reduce_scatter(scattered, full, group=None, async_op=True) is None
    assert scattered.tolist() == [0.0, 1.0, 2.0]
    assert probe.LocalComm._c10d_all_reduce(reduced, op=None, group=None, async_op=True) is None
    assert reduced.tolist() == [1.0] * 4


def test_the_context_probes_local_exchanges_return_what_was_sent() -> None:
    """LocalComm's CP exchanges: a ring step receives its own send (no work to wait for), an all-to-all
    returns its input; the group sizes the context probe times are the powers of 2 dividing the world."""
    comm = probe.LocalComm(ranks_per_node=2)
    send, recv = torch.arange(4.0), torch.zeros(4)
    assert comm.exchange(send, recv, dst=1, src=1, group=None, tag=11) == [] and recv.tolist() == send.tolist()
    out = torch.zeros(4)
    comm.all_to_all(out, send, None)
    assert out.tolist() == send.tolist()
    assert probe.context_probe_sizes(1) == [] and probe.context_probe_sizes(2) == [2]
    assert probe.context_probe_sizes(4) == [2, 4] and probe.context_probe_sizes(6) == [2]
    assert probe.context_probe_sizes(8) == [2, 4, 8]
