"""Load planner exports through torchtitan 0.3.0's own config code; run by tests/integration/test_exports_accepted.py
in its own process (it stubs one GPU-kernel module and imports torchtitan).

    python torchtitan_check.py DIR...    # each DIR: planner_plan.py and launch.sh from `planner export --to torchtitan`

For each DIR, one JSON line: {"dir", "ok", "error", "parts", "params"} (params: the built model's count). The checks are torchtitan's own, in the order
its Trainer runs them, minus what needs a device: ConfigManager's --module/--config loader (unknown fields are
errors), Trainer.Config.__post_init__, ParallelDims' world-size check, the model's update_from_config (TP
against heads, sequence length against RoPE, weight tying against PP), _validate_cuda_graphs, EP against the
ranks it folds over (ParallelDims.build_mesh), building the model on the meta device, the loss, and for pipelines the stage metadata, the rank-to-stage mapping and
every named module part against the built model. Trainer.__init__'s two device-time checks (sequence length
divisible by TP under sequence parallelism, global batch by local batch x DP) are re-encoded from its
source (trainer.py 306-315, 414-433), as are torch's schedule constructors' micro-batch rules.
"""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

# torchtitan 0.3.0 imports triton (1 GB) unconditionally in its MoE expert-parallel kernels, which no dense
# plan uses; stand in for that one module so the config path imports without it.
_KERNELS = "torchtitan.distributed.minimal_async_ep.kernels"
_stub = types.ModuleType(_KERNELS)
for _name in ("copy_full_counts_to_peers_kernel", "copy_rows_to_peers_kernel", "expand_topk_grad_kernel",
              "fill_combine_metadata_kernel", "fill_dispatch_metadata_kernel", "invert_flat_indices_kernel",
              "reduce_topk_slots_kernel", "topk_scores_grad_kernel"):
    setattr(_stub, _name, None)
sys.modules.setdefault(_KERNELS, _stub)

import torch  # noqa: E402
from torch.distributed.pipelining.schedules import PipelineScheduleMulti, get_schedule_class  # noqa: E402
from torchtitan.config.manager import ConfigManager  # noqa: E402
from torchtitan.distributed import pipeline_parallel as ttpp  # noqa: E402
from torchtitan.distributed.parallel_dims import ParallelDims  # noqa: E402


def _world_size(launch: str) -> int:
    per_node = int(re.search(r"--nproc-per-node (\d+)", launch).group(1))
    nodes = int(re.search(r"--nnodes (\d+)", launch).group(1))
    return per_node * nodes


def check(folder: Path) -> dict:
    sys.path.insert(0, str(folder))
    sys.modules.pop("planner_plan", None)
    try:
        cfg = ConfigManager().parse_args(["--module", "planner_plan", "--config", "planner_plan"])
    finally:
        sys.path.remove(str(folder))
    world = _world_size((folder / "launch.sh").read_text())
    par, training = cfg.parallelism, cfg.training
    dims = ParallelDims.from_config(par, world)
    model_cfg = cfg.model_spec.model
    model_cfg.update_from_config(config=cfg)
    cfg._validate_cuda_graphs()
    with torch.device("meta"):
        model = model_cfg.build()
    cfg.loss.build(compile_config=cfg.compile)
    # ParallelDims.build_mesh folds EP over dp_shard x cp x tp (efsdp = dp_shard x cp x tp / ep).
    assert (dims.dp_shard * dims.cp * dims.tp) % dims.ep == 0, \
        f"expert_parallel_degree {dims.ep} does not divide dp_shard x cp x tp = {dims.dp_shard * dims.cp * dims.tp}"
    divisor = (dims.tp if par.enable_sequence_parallel else 1) * (2 * dims.cp if dims.cp > 1 else 1)
    assert training.seq_len % divisor == 0, f"Training sequence length ({training.seq_len}) must be divisible by {divisor}"
    batch_degree = dims.dp_replicate * dims.dp_shard
    assert training.global_batch_size % (training.local_batch_size * batch_degree) == 0, \
        "global batch size must be multiple of local batch size times data-parallel degree"
    parts = []
    if dims.pp > 1:
        ttpp._get_pipeline_metadata(dims, par, model_cfg)
        parts = par.module_fqns_per_model_part
        for rank in range(dims.pp):
            ttpp._get_pp_rank_to_stage_indices_mapping(rank, dims.pp, par.pipeline_parallel_schedule, len(parts))
        names = {name for name, _ in model.named_modules()}
        for part in parts:
            missing = [n for n in part if n not in names]
            assert not missing, f"module_fqns_per_model_part names {missing[0]!r}, which the model does not have"
        flat = [n for part in parts for n in part]
        assert len(flat) == len(set(flat)), "a module is in two model parts"
        _check_schedule(par, training.local_batch_size, len(parts))
    return {"ok": True, "parts": [len(p) for p in parts], "params": sum(p.numel() for p in model.parameters())}


def _check_schedule(par, local_batch_size: int, num_stages: int) -> None:
    """torch 2.13's schedule constructors' rules (torch/distributed/pipelining/schedules.py)."""
    schedule = get_schedule_class(par.pipeline_parallel_schedule)
    n_micro = local_batch_size // par.pipeline_parallel_microbatch_size
    assert local_batch_size % par.pipeline_parallel_microbatch_size == 0
    if issubclass(schedule, PipelineScheduleMulti):
        assert num_stages // par.pipeline_parallel_degree >= 2, "Multi-stage schedule requires at least 2 stages per rank"
        rounds = max(1, n_micro // par.pipeline_parallel_degree)
        assert n_micro % rounds == 0, f"Interleaved schedules need {n_micro} micro-batches divisible into {rounds} rounds"
    else:
        assert num_stages == par.pipeline_parallel_degree, "Single stage schedule requires exactly 1 stage per rank"
        if schedule.__name__ == "Schedule1F1B":
            assert n_micro >= num_stages, f"1F1B needs at least {num_stages} micro-batches, got {n_micro}"


def main() -> None:
    for arg in sys.argv[1:]:
        try:
            result = check(Path(arg))
        except (Exception, SystemExit) as exc:  # noqa: BLE001 - any rejection is reported, not raised
            result = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
        print(json.dumps({"dir": arg, **result}), flush=True)


if __name__ == "__main__":
    main()
