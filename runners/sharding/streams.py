"""Side streams of the sharding engine, as FSDP2 uses them: gradient reduce-scatters, boundary all-reduces
and MAZ3 host copies each run on a stream of their own, so none of them waits in line behind compute
kernels and compute never waits for them before it needs their result.

Under NCCL (`ordered`) a collective is ordered on the device: `work.wait()` makes the *current* stream wait
for it and returns at once. The reducer therefore issues a reduce-scatter from the reduce-scatter stream,
waits for it there, adds the micro-batch's share into the gradient shard there, and issues the boundary
all-reduce from the all-reduce stream right behind it: no CPU thread ever polls for completion (gloo's
collectives complete on the CPU, so there the reducer polls, `ordered` False). The compute stream joins
the side streams once, before the optimizer reads the gradients (`join`).

On CPU the same code runs with torch.cpu's stream stand-ins (no-ops), so the ordered path can be
exercised and checked for exactness on gloo (`ShardedDataParallel(stream_ordered=True)`).
"""

from __future__ import annotations

import contextlib

import torch


def device_module(device: torch.device):
    """torch.cuda for CUDA devices, torch.cpu (stream and event stand-ins) otherwise."""
    return torch.cuda if device.type == "cuda" else torch.cpu


class SideStreams:
    """The reduce-scatter, all-reduce and host-copy streams of one rank (created on first use)."""

    NAMES = ("reduce_scatter", "all_reduce", "host_copy")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.module = device_module(device)
        self._streams: dict[str, object] = {}

    def get(self, name: str):
        assert name in self.NAMES, name
        if name not in self._streams:
            self._streams[name] = self.module.Stream(self.device) if self.device.type == "cuda" else self.module.Stream()
        return self._streams[name]

    @contextlib.contextmanager
    def on(self, name: str, *, after: tuple[str, ...] = ()):
        """Run the block on side stream `name`, after all work issued so far on the current stream and on
        the side streams `after` (their results are its inputs)."""
        stream = self.get(name)
        stream.wait_stream(self.module.current_stream())
        for other in after:
            if other in self._streams:
                stream.wait_stream(self._streams[other])
        with self.module.stream(stream):
            yield stream

    def join(self) -> None:
        """The current stream waits for everything issued on the side streams (before reading their results)."""
        current = self.module.current_stream()
        for stream in self._streams.values():
            current.wait_stream(stream)


class EventWork:
    """A work handle for a copy issued on a side stream: `wait()` makes the current stream wait for it."""

    def __init__(self, event) -> None:
        self.event = event

    def wait(self) -> bool:
        torch.cuda.current_stream().wait_event(self.event)
        return True

    def is_completed(self) -> bool:
        return bool(self.event.query())
