"""Training data: deterministic synthetic sequences, or byte-level tokens from a text file or folder.

Every step's global batch is a pure function of (seed, step), so a parallel run, a one-process run and a
resumed run see the same tokens; each data-parallel rank takes its contiguous slice of sequences, split
into micro-batches.
"""

from __future__ import annotations

from pathlib import Path

import torch

from specs.errors import PlannerError


class SyntheticData:
    """Arithmetic progressions modulo the vocabulary (random start and stride per sequence): learnable,
    so the loss falls visibly, and free of any download."""

    def __init__(self, *, vocab_size: int, seq_len: int, seed: int) -> None:
        self.vocab_size, self.seq_len, self.seed = vocab_size, seq_len, seed

    def global_batch(self, step: int, batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        start = torch.randint(self.vocab_size, (batch, 1), generator=gen)
        stride = torch.randint(1, 8, (batch, 1), generator=gen)
        return (start + stride * torch.arange(self.seq_len + 1)) % self.vocab_size


class ByteData:
    """Windows of a byte stream (a file, or a folder's files in name order) at seeded offsets."""

    def __init__(self, path: str | Path, *, vocab_size: int, seq_len: int, seed: int) -> None:
        path = Path(path)
        if not path.exists():
            raise PlannerError(f"data path not found: {path}")
        files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
        blob = b"".join(p.read_bytes() for p in files)
        if len(blob) < seq_len + 2:
            raise PlannerError(f"data at {path} has {len(blob)} bytes; need at least {seq_len + 2} for seq_len {seq_len}")
        if vocab_size < 256:
            raise PlannerError(f"byte-level data needs a vocabulary of at least 256, the model has {vocab_size}")
        self.tokens = torch.frombuffer(bytearray(blob), dtype=torch.uint8).long()
        self.seq_len, self.seed = seq_len, seed

    def global_batch(self, step: int, batch: int) -> torch.Tensor:
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + step)
        starts = torch.randint(len(self.tokens) - self.seq_len - 1, (batch,), generator=gen)
        return torch.stack([self.tokens[s:s + self.seq_len + 1] for s in starts.tolist()])


def make_data(path: str | None, *, vocab_size: int, seq_len: int, seed: int):
    if path:
        return ByteData(path, vocab_size=vocab_size, seq_len=seq_len, seed=seed)
    return SyntheticData(vocab_size=vocab_size, seq_len=seq_len, seed=seed)


def rank_micro_batches(sequences: torch.Tensor, *, dp: int, dp_rank: int, micro_batch: int,
                       device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """This DP rank's (inputs, targets) micro-batches from the global batch of sequences [B, S + 1]."""
    per_rank = sequences.shape[0] // dp
    mine = sequences[dp_rank * per_rank:(dp_rank + 1) * per_rank].to(device)
    return [(mb[:, :-1].contiguous(), mb[:, 1:].contiguous()) for mb in mine.split(micro_batch)]
