"""A worker module for test_launch.py: reports the environment the launcher gave each rank, or fails the
way its spec says (rank `fail_rank`: exit with an error, or SIGKILL itself)."""

import os
import signal
import time

from runners.launch import emit_event, exit_worker, worker_main


def task(spec: dict) -> dict:
    rank = int(os.environ["RANK"])
    emit_event("hello", rank=rank)
    if rank == spec.get("fail_rank"):
        if spec["how"] == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        raise RuntimeError("told to fail")
    if spec.get("fail_rank") is not None:
        time.sleep(60)  # the launcher must stop this rank when the other one fails
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "OMP_NUM_THREADS")
    return {key: os.environ.get(key) for key in keys}


if __name__ == "__main__":
    exit_worker(worker_main(task))
