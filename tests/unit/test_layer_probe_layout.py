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

