"""python benchmarks/fresh_plan.py TREE LEVEL STEPS

One plan of our engine (ZeRO-LEVEL, 0 = DDP; benchmarks/engine_vs_torch.py's model and batch) alone on 4
fresh gloo CPU processes, with the code of the checkout at TREE (any commit whose engine_vs_torch has
`make_config` and `cpu_seconds` and whose runners.train has `train`): prints "FRESH <median step wall s on rank 0> <CPU s per
step summed over ranks>", the first step dropped. `benchmarks/engine_before_after.py --fresh` runs it per tree.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORLD = 4


def worker(rank: int, port: int, tree: str, level: int, steps: int) -> None:
    sys.path.insert(0, tree)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD))
    torch.set_num_threads(1)
    spec = importlib.util.spec_from_file_location("tree_engine_vs_torch",
                                                  os.path.join(tree, "benchmarks", "engine_vs_torch.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    from runners.train import train

    dist.init_process_group("gloo", rank=rank, world_size=WORLD, timeout=datetime.timedelta(seconds=600))
    marks: list[tuple[float, float]] = []  # (wall, CPU) at the end of each step
    train(bench.make_config(level, "ours", steps=steps), device=torch.device("cpu"),
          on_step=lambda record: marks.append((time.perf_counter(), bench.cpu_seconds())))
    wall = sorted(b[0] - a[0] for a, b in zip(marks, marks[1:]))
    cpu = torch.tensor([(marks[-1][1] - marks[0][1]) / (len(marks) - 1)], dtype=torch.float64)
    dist.all_reduce(cpu)
    if rank == 0:
        print(f"FRESH {wall[len(wall) // 2]:.6f} {cpu.item():.6f}", flush=True)
    dist.destroy_process_group()


def main() -> None:
    tree, level, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.start_processes(worker, args=(port, tree, level, steps), nprocs=WORLD, start_method="spawn")


if __name__ == "__main__":
    main()
