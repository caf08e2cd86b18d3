"""Seeded, shardable parameter initialisation: every weight drawn in full from generators seeded by (seed,
parameter name), so that any slice can be drawn alone and every plan starts from exactly the one-process
model while each rank only ever draws what it holds (runners/transformer.py's units, runners/moe.py's
experts)."""

from __future__ import annotations

import concurrent.futures
import contextlib
import contextvars
import functools
import hashlib
import math
import os
from dataclasses import dataclass

import torch
from torch import nn

INIT_STD = 0.02
# Seeded values are drawn in blocks of this many elements, each from its own generator, so that any slice
# of a weight can be drawn alone (an engine that shards parameters draws only its shard: ParamInit).
INIT_BLOCK = 1 << 20
_DEFERRED = contextvars.ContextVar("deferred_init", default=False)


def _seeded_block(*, seed: int, name: str, numel: int, block: int) -> torch.Tensor:
    """Block `block` of the flattened full weight `name` (INIT_BLOCK elements, fewer for the last), drawn
    whole from its own generator seeded by (seed, name, block), unscaled."""
    digest = hashlib.sha256(f"{seed}:{name}:{block}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    return torch.randn(min(INIT_BLOCK, numel - block * INIT_BLOCK), generator=gen, dtype=torch.float32)


def _seeded_range(*, seed: int, name: str, numel: int, start: int, stop: int, std: float) -> torch.Tensor:
    """Elements [start, stop) of the flattened full weight `name` of `numel` elements: N(0, std^2), the
    same values whichever slice is asked for (each block is drawn whole, `_seeded_block`). Blocks are
    independent, so a long range draws them on several threads (torch's generator releases the GIL)."""
    out = torch.empty(stop - start, dtype=torch.float32)
    blocks = range(start // INIT_BLOCK, (stop - 1) // INIT_BLOCK + 1 if stop > start else 0)

    def fill(block: int) -> None:
        base = block * INIT_BLOCK
        lo, hi = max(start, base), min(stop, base + INIT_BLOCK)
        out[lo - start:hi - start] = _seeded_block(seed=seed, name=name, numel=numel, block=block)[lo - base:hi - base]

    workers = min(len(blocks), os.cpu_count() or 1, 16)
    if workers > 1:
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            list(pool.map(fill, blocks))
    else:
        for block in blocks:
            fill(block)
    return out.mul_(std)


@dataclass(frozen=True)
class ParamInit:
    """How one parameter's initial values are drawn: a constant `fill`, or N(0, std^2) seeded by (seed,
    canonical name); the parameter is this TP rank's slice of the full weight along `split_dim`. Any
    slice of the flattened local tensor can be drawn alone (`values`), so every plan starts from exactly
    the one-process model while each rank only ever draws what it holds."""

    name: str
    seed: int
    std: float
    fill: float | None
    full_shape: tuple[int, ...]
    split_dim: int | None
    tp_rank: int = 0
    tp_size: int = 1
    # A second split (dim, rank, size): an MoE expert weight is split over EP along dim 0 (the split above)
    # and over expert TP along its FFN dim (runners/moe.py).
    extra_split: tuple[int, int, int] | None = None

    @property
    def splits(self) -> list[tuple[int, int, int]]:
        """(dim, rank, parts) of every split that cuts the full weight."""
        out = [(self.split_dim, self.tp_rank, self.tp_size)] if self.split_dim is not None else []
        out += [self.extra_split] if self.extra_split is not None else []
        return [s for s in out if s[2] > 1]

    @property
    def local_shape(self) -> tuple[int, ...]:
        shape = list(self.full_shape)
        for dim, _, parts in self.splits:
            shape[dim] //= parts
        return tuple(shape)

    def values(self, start: int, stop: int) -> torch.Tensor:
        """fp32 CPU values of elements [start, stop) of the flattened local (TP-sliced) parameter."""
        if self.fill is not None:
            return torch.full((stop - start,), float(self.fill), dtype=torch.float32)
        draw = functools.partial(_seeded_range, seed=self.seed, name=self.name, numel=math.prod(self.full_shape),
                                 std=self.std)
        splits, local = self.splits, self.local_shape
        if not splits:
            return draw(start=start, stop=stop)
        (dim, rank, _), = splits if len(splits) == 1 else [(None, 0, 1)]
        if dim == 0:  # whole rows: one contiguous range of the full weight
            offset = rank * math.prod(local)
            return draw(start=offset + start, stop=offset + stop)
        if dim != 1 or len(local) != 2:  # several cuts, or one inside a 3-D weight
            return self._values_of_box(draw, start, stop)
        cols, full_cols = local[1], self.full_shape[1]
        first, last = start // cols, (stop - 1) // cols
        rows = draw(start=first * full_cols, stop=(last + 1) * full_cols).view(-1, full_cols)
        mine = rows[:, rank * cols:(rank + 1) * cols].reshape(-1)
        return mine[start - first * cols:stop - first * cols].clone()

    def _values_of_box(self, draw, start: int, stop: int) -> torch.Tensor:
        """Elements [start, stop) of a local tensor cut along several dims, INIT_BLOCK at a time (so the index
        tensors of an expert shard of billions of elements stay small)."""
        if stop - start <= INIT_BLOCK:
            return self._values_of_run(draw, start, stop)
        return torch.cat([self._values_of_run(draw, lo, min(stop, lo + INIT_BLOCK))
                          for lo in range(start, stop, INIT_BLOCK)])

    def _values_of_run(self, draw, start: int, stop: int) -> torch.Tensor:
        """Their full-weight indices by index arithmetic, drawn as the one contiguous span of the full weight
        that holds them."""
        local, full = self.local_shape, self.full_shape
        offsets = [0] * len(full)
        for dim, rank, _ in self.splits:
            offsets[dim] = rank * local[dim]
        index, rest = torch.zeros(stop - start, dtype=torch.int64), torch.arange(start, stop)
        for dim in reversed(range(len(local))):  # unravel over the local shape, ravel over the full one
            rest, coord = rest.div(local[dim], rounding_mode="floor"), rest % local[dim]
            index += (coord + offsets[dim]) * math.prod(full[dim + 1:])
        if index.numel() == 0:
            return torch.empty(0)
        lo = int(index.min())
        return draw(start=lo, stop=int(index.max()) + 1)[index - lo]


@contextlib.contextmanager
def deferred_init():
    """Parameters built inside hold no storage: their values are drawn later, slice by slice, by the engine
    that shards them (ParamInit.values), so no rank ever holds a weight it does not own."""
    token = _DEFERRED.set(True)
    try:
        yield
    finally:
        _DEFERRED.reset(token)


def _param(full_shape, *, name, seed, std, tp, split_dim=None, fill=None, extra_split=None) -> nn.Parameter:
    """`extra_split`: (dim, rank, parts), a second cut of the weight besides `split_dim` over `tp`."""
    init = ParamInit(name=name, seed=seed, std=std, fill=fill, full_shape=tuple(full_shape),
                     split_dim=split_dim if tp.size > 1 else None, tp_rank=tp.rank, tp_size=tp.size,
                     extra_split=extra_split)
    numel = math.prod(init.local_shape)
    if _DEFERRED.get():
        data = torch.empty(init.local_shape)  # never touched: no pages are committed
        data.untyped_storage().resize_(0)
    else:
        data = init.values(0, numel).view(init.local_shape)
    param = nn.Parameter(data)
    # The canonical name and TP split let any plan's shards be reassembled into one-process names.
    param.canonical_name, param.tp_split_dim, param.init = name, split_dim, init
    return param
