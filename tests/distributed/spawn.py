"""Run a function on N local gloo processes (torch.multiprocessing, spawn) and collect every rank's result.

Usage: `results = run_on_ranks(fn, world_size=4, args=(cases,))`, where `fn(rank, world_size, *args)` is
a module-level (picklable) function; the process group is initialised before it runs. A failure on any
rank raises AssertionError carrying that rank's traceback.
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 and let the OS choose)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args, results) -> None:
    # The test machine has two cores shared by every process: one intra-op thread each.
    torch.set_num_threads(1)
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
        # Plain pickle bytes: torch's queue reductions would share tensors through file descriptors
        # that die with this process.
        results.put((rank, True, pickle.dumps(fn(rank, world_size, *args))))
    except BaseException:  # report everything, the parent turns it into a test failure
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_on_ranks(fn, *, world_size: int, args: tuple = (), timeout_s: float = 300.0) -> list:
    """fn(rank, world_size, *args) on `world_size` gloo processes; returns the results in rank order."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, fn, args, results)) for r in range(world_size)]
    for p in procs:
        p.start()
    collected: dict[int, object] = {}
    errors: list[str] = []
    try:
        for _ in range(world_size):
            rank, ok, value = results.get(timeout=timeout_s)
            if ok:
                collected[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank}:\n{value}")
                break  # the other ranks may now hang in a collective
    except queue.Empty:
        errors.append(f"timed out after {timeout_s} s waiting for ranks {sorted(set(range(world_size)) - set(collected))}")
    finally:
        for p in procs:
            p.join(timeout=5 if not errors else 0.5)
            if p.is_alive():
                p.kill()
                p.join()
    if errors:
        raise AssertionError("\n".join(errors))
    return [collected[r] for r in range(world_size)]
