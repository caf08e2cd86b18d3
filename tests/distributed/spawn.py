"""Run a function on N local gloo processes (torch.multiprocessing) and collect every rank's result.

Usage: `results = run_on_ranks(fn, world_size=4, args=(cases,))`, where `fn(rank, world_size, *args)` is
a module-level (picklable) function; the process group is initialised before it runs. A failure on any
rank raises AssertionError carrying that rank's traceback.

Every test process comes from `context()`: a fork server that imported torch and the engine once, so a
rank starts in a fraction of a second instead of importing torch again (spawn: 13-25 s for 4 ranks on
this 2-core host under the suite's load, the fork server 0.2 s). Each rank is still a fresh fork of a
process that only imported modules: no process group, seed or thread setting carries over.
"""

from __future__ import annotations

import os
import pickle
import queue
import signal
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from runners.launch import free_port


# Imported once by the fork server, before it forks any rank: torch, the engine, and what --engine torch
# imports on first use (DDP's constructor alone imports torch._dynamo: 3.3 s a process here).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor",
           "torch.distributed.tensor.parallel", "torch.distributed.pipelining", "torch.distributed.optim",
           "torch.distributed.checkpoint", "runners.train", "runners.torch_engine", "runners.reference",
           "tests.distributed.harness"]
_CONTEXT = None


def context():
    """The multiprocessing context every distributed test starts its ranks from (see the module note)."""
    global _CONTEXT
    if _CONTEXT is None:
        _CONTEXT = mp.get_context("forkserver")
        _CONTEXT.set_forkserver_preload(PRELOAD)
    return _CONTEXT


# A rank that a signal ends (SIGABRT from "double free or corruption" or "terminate called without an
# active exception") crashed inside torch's gloo transport, not in the engine: Python code cannot free
# memory twice. Seen once in a fresh-clone suite (2 processes, DTensor's asynchronous collectives) and
# twice in ~30 profile runs (profilers/profile.py PROBE_ATTEMPTS), on this 2-core host, with spawn and
# fork alike. Such a run is started once more from scratch; a rank that raises, a wrong loss or a
# timeout is never retried.
CRASH_ATTEMPTS = 2
CRASH_SIGNALS = (signal.SIGABRT, signal.SIGSEGV, signal.SIGBUS)  # not SIGKILL: the harness kills hung ranks


class RankCrashed(AssertionError):
    """A rank was ended by a signal (see CRASH_ATTEMPTS)."""


def crash_of(procs) -> str:
    """'rank R ended by SIGABRT' for each joined process a crash signal (CRASH_SIGNALS) ended; '' if none."""
    return "; ".join(f"rank {r} ended by {signal.Signals(-p.exitcode).name}" for r, p in enumerate(procs)
                     if p.exitcode is not None and -p.exitcode in CRASH_SIGNALS)


def rank_failure(procs, message: str) -> AssertionError:
    """What a failed run of the joined `procs` raises: RankCrashed, naming the ranks a crash signal ended
    (retry_crashed runs it again), else AssertionError."""
    crash = crash_of(procs)
    return RankCrashed(f"{crash}\n{message}") if crash else AssertionError(message)


def retry_crashed(run, what: str):
    """run() again once when it raised RankCrashed (see CRASH_ATTEMPTS); its result."""
    import warnings

    for attempt in range(CRASH_ATTEMPTS):
        try:
            return run()
        except RankCrashed as exc:
            if attempt == CRASH_ATTEMPTS - 1:
                raise
            warnings.warn(f"{what}: {str(exc).splitlines()[0]}; running it again from the start")


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
    return retry_crashed(lambda: _run_on_ranks_once(fn, world_size=world_size, args=args, timeout_s=timeout_s),
                         f"{getattr(fn, '__name__', fn)} on {world_size} ranks")


def _run_on_ranks_once(fn, *, world_size: int, args: tuple, timeout_s: float) -> list:
    ctx = context()
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
        raise rank_failure(procs, "\n".join(errors))
    return [collected[r] for r in range(world_size)]
