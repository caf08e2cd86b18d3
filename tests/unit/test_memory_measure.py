"""runners/train.py's CPU memory figures count what the process allocated, not the library files mapped
into it: a fresh venv's processes mapped ~75 MiB more of libtorch_cpu.so than an older venv's for the same
run, and the resident set (VmHWM) reported that as the plan's memory."""

import mmap

import torch

from runners.train import memory_now_bytes, peak_memory_bytes, reset_peak_memory

CPU = torch.device("cpu")
MIB = 2**20


def _touch_mapped_file(path, nbytes: int) -> mmap.mmap:
    with open(path, "wb") as f:  # a MiB at a time: a freed 64 MiB buffer may stay in the heap (steady_allocator)
        for _ in range(nbytes // MIB):
            f.write(b"\1" * MIB)
    with open(path, "rb") as f:
        mapped = mmap.mmap(f.fileno(), nbytes, prot=mmap.PROT_READ)
    assert sum(mapped[i] for i in range(0, nbytes, 4096)) == nbytes // 4096  # every page faulted in
    return mapped


def test_mapped_file_pages_are_not_counted_but_allocations_are(tmp_path):
    reset_peak_memory(CPU)
    before_peak, before_now = peak_memory_bytes(CPU), memory_now_bytes(CPU)
    mapped = _touch_mapped_file(tmp_path / "lib.bin", 64 * MIB)
    try:
        # 64 MiB of file pages now sit in the resident set; neither figure may see them.
        assert peak_memory_bytes(CPU) - before_peak < 8 * MIB
        assert memory_now_bytes(CPU) - before_now < 8 * MIB
        held = torch.ones(16 * MIB)  # 64 MiB of fp32, every page written
        assert peak_memory_bytes(CPU) - before_peak > 56 * MIB
        assert memory_now_bytes(CPU) - before_now > 56 * MIB
        del held
    finally:
        mapped.close()
