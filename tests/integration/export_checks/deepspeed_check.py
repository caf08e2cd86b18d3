"""Load planner exports through DeepSpeed 0.19.8's own config classes; run by
tests/integration/test_exports_accepted.py in its own process.

    python deepspeed_check.py DIR... [--pipe DIR]   # each DIR: ds_config.json and launch.sh from `planner export
                                                    # --to deepspeed`; --pipe: also build a real PipelineEngine
                                                    # with that DIR's ZeRO stage (gloo, 1 rank, $PORT)

For each DIR, one JSON line: {"dir", "ok", "error", ...}. DeepSpeedConfig checks the batch identity
(train_batch_size = micro x accumulation x data-parallel size), every pydantic block (zero_optimization,
bf16/fp16, tensor_parallel: unknown keys are errors), the removed keys (MiCS, amp, ...) and the precision
rules; it takes the data-parallel size from an `mpu`, here one that answers the export's DP size. The
pipeline engine's own assertion ("ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism") runs only
when a PipelineEngine is built, which --pipe does on one CPU rank.
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import deepspeed.comm as ds_dist
from deepspeed.runtime.config import DeepSpeedConfig


class _DataParallelOnly:
    """The one question DeepSpeedConfig asks an mpu: the data-parallel world size."""

    def __init__(self, dp: int) -> None:
        self.dp = dp

    def get_data_parallel_world_size(self) -> int:
        return self.dp


def _dp(folder: Path, config: dict) -> int:
    launch = (folder / "launch.sh").read_text()
    world = int(re.search(r"--num_nodes (\d+)", launch).group(1)) * int(re.search(r"--num_gpus (\d+)", launch).group(1))
    tp = config.get("tensor_parallel", {}).get("autotp_size", 1)
    pp = config.get("pipeline", {}).get("stages", 1)
    return world // (tp * pp)


def check(folder: Path) -> dict:
    config = json.loads((folder / "ds_config.json").read_text())
    original = ds_dist.get_rank
    ds_dist.get_rank = lambda *args, **kwargs: 0  # no process group in a test: rank 0 reads the config
    try:
        parsed = DeepSpeedConfig(config, mpu=_DataParallelOnly(_dp(folder, config)))
    finally:
        ds_dist.get_rank = original
    return {"ok": True, "zero_stage": parsed.zero_optimization_stage, "optimizer": parsed.optimizer_name,
            "adam_w_mode": parsed.optimizer_params.get("adam_w_mode"), "world_size": parsed.world_size,
            "gradient_accumulation_steps": parsed.gradient_accumulation_steps}


def check_pipeline_engine(folder: Path) -> dict:
    """A real PipelineEngine (one stage, one gloo rank, fp32) with the export's ZeRO stage."""
    import deepspeed
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("PORT", "29533"), "RANK": "0",
                       "WORLD_SIZE": "1", "LOCAL_RANK": "0"}.items():
        os.environ[key] = value
    stage = json.loads((folder / "ds_config.json").read_text())["zero_optimization"]["stage"]
    deepspeed.init_distributed(dist_backend="gloo")
    net = PipelineModule(layers=[LayerSpec(torch.nn.Linear, 8, 8) for _ in range(2)], num_stages=1,
                         loss_fn=torch.nn.MSELoss())
    config = {"train_batch_size": 2, "train_micro_batch_size_per_gpu": 1,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True, "adam_w_mode": False}},
              "zero_optimization": {"stage": stage}}
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(), config=config)
    return {"ok": True, "zero_stage": stage, "micro_batches": engine.gradient_accumulation_steps()}


def main() -> None:
    args = sys.argv[1:]
    pipe = args[args.index("--pipe") + 1] if "--pipe" in args else None
    jobs = [(arg, check) for arg in args if arg not in ("--pipe", pipe)]
    if pipe is not None:
        jobs.append((pipe, check_pipeline_engine))  # last: it initialises torch.distributed for the process
    for arg, job in jobs:
        try:
            result = job(Path(arg))
        except Exception as exc:  # noqa: BLE001 - any rejection is reported, not raised
            result = {"ok": False, "error": f"{type(exc).__name__}: {' '.join(str(exc).split())[:400]}"}
        print(json.dumps({"dir": arg, "mode": "pipe" if job is check_pipeline_engine else "config", **result}),
              flush=True)


if __name__ == "__main__":
    main()
