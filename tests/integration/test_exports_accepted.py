"""Every export of tests/export_cases.py goes through its target's own configuration code: torchtitan 0.3.0's
config loader and checks, DeepSpeed 0.19.8's DeepSpeedConfig (and one real PipelineEngine), megatron-core
0.16.1's TransformerConfig and micro-batch calculator (Megatron-LM's argument rules are in
tests/unit/test_export.py). Each checker runs in its own process (tests/integration/export_checks/), and each
is also handed a few broken exports, which it must reject, so that a checker that accepts anything fails here.

The targets are test-only dependencies (pyproject's `exports` extra; scripts/test.sh installs them and sets
PLANNER_REQUIRE_EXPORT_CHECKS=1, so CI fails rather than skips when one is missing).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from planner.exports import Refused, export_plan
from runners.launch import free_port
from tests.export_cases import CASES

CHECKS = Path(__file__).resolve().parent / "export_checks"
TARGET_MODULES = {"torchtitan": "torchtitan", "deepspeed": "deepspeed", "megatron": "megatron.core"}


def _require(target: str) -> None:
    if importlib.util.find_spec(TARGET_MODULES[target].split(".")[0]) is None:
        message = f"{TARGET_MODULES[target]} is not installed (pip install -e '.[test,exports]')"
        if os.environ.get("PLANNER_REQUIRE_EXPORT_CHECKS") == "1":
            pytest.fail(message)
        pytest.skip(message)


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, dict[str, Path]]:
    """target -> case name -> the folder its export was written to (refused plans are left out)."""
    root = tmp_path_factory.mktemp("exports")
    out: dict[str, dict[str, Path]] = {t: {} for t in TARGET_MODULES}
    for case in CASES:
        for target in TARGET_MODULES:
            try:
                result, _ = export_plan(case.build_plan(), case.problem(), target=target)
            except Refused:
                assert target in case.refused_by, f"{target} refused {case.name}"
                continue
            assert target not in case.refused_by, f"{target} should refuse {case.name}"
            folder = root / target / case.name
            folder.mkdir(parents=True)
            for name, text in result.files.items():
                (folder / name).write_text(text)
            out[target][case.name] = folder
    return out


def _copy(folder: Path, name: str) -> Path:
    copy = folder.parent / name
    shutil.copytree(folder, copy)
    return copy


def _broken(folder: Path, name: str, file: str, old: str, new: str) -> Path:
    """A copy of an export with one edit a target must reject."""
    copy = _copy(folder, f"broken-{name}")
    text = (copy / file).read_text()
    assert old in text, (old, file)
    (copy / file).write_text(text.replace(old, new, 1))
    return copy


def _run(script: str, folders: list[Path], *extra: str, env: dict | None = None) -> dict[str, dict]:
    """The checker's verdict per folder (the last line it printed for it)."""
    proc = subprocess.run([sys.executable, str(CHECKS / script), *map(str, folders), *extra], capture_output=True,
                          text=True, timeout=900, env={**os.environ, **(env or {})})
    results = {}
    for line in proc.stdout.splitlines():
        if line.startswith("{"):
            row = json.loads(line)
            results[row["dir"]] = row
    assert len(results) == len(folders), proc.stdout[-2000:] + proc.stderr[-3000:]
    return results


def _assert_verdicts(results: dict, good: list[Path], bad: dict[Path, str]) -> None:
    for folder in good:
        assert results[str(folder)]["ok"], (folder.name, results[str(folder)].get("error"))
    for folder, message in bad.items():
        row = results[str(folder)]
        assert not row["ok"] and message in row["error"], (folder.name, row)


def test_torchtitan_loads_and_accepts_every_export(exports):
    _require("torchtitan")
    good = list(exports["torchtitan"].values())
    interleaved, plain = exports["torchtitan"]["70b-pp4-interleaved"], exports["torchtitan"]["8b-zero1"]
    moe = exports["torchtitan"]["qwen3-30b-a3b-ep8"]
    bad = {
        # EP folds over dp_shard x cp x tp = 16 ranks.
        _broken(moe, "ep3", "planner_plan.py", "expert_parallel_degree=8", "expert_parallel_degree=3"):
            "expert_parallel_degree 3 does not divide",
        # One stage per rank is what a single-stage schedule needs; the export has two.
        _broken(interleaved, "schedule", "planner_plan.py", "'Interleaved1F1B'", "'1F1B'"):
            "Single stage schedule requires exactly 1 stage per rank",
        # The field torchtitan removed in Oct 2025: its dataclasses reject unknown fields.
        _broken(plain, "split-points", "planner_plan.py", "tensor_parallel_degree=",
                "pipeline_parallel_split_points=['layers.8'], tensor_parallel_degree="): "pipeline_parallel_split_points",
    }
    results = _run("torchtitan_check.py", good + list(bad))
    _assert_verdicts(results, good, bad)
    # The pipeline parts are the plan's chunks: embedding + 19 layers ... 19 layers + norm + head.
    assert results[str(exports["torchtitan"]["70b-pp4-unequal"])]["parts"] == [20, 21, 21, 21]
    # The model torchtitan builds is the planner's: Llama 3, Qwen3 (head norms, head_dim 128), Mixtral and
    # Qwen3-30B-A3B (MoE) alike, parameter for parameter.
    cases = {case.name: case for case in CASES}
    for name, folder in exports["torchtitan"].items():
        assert results[str(folder)]["params"] == cases[name].problem().model.num_params(), name


def test_deepspeed_accepts_every_export_and_its_pipeline_engine_the_zero_stage(exports):
    _require("deepspeed")
    good = list(exports["deepspeed"].values())
    zero2 = exports["deepspeed"]["8b-tp8-sp-zero2"]
    bad = {_broken(zero2, "batch", "ds_config.json", '"train_batch_size": 128', '"train_batch_size": 129'):
           "train_batch_size is not equal to micro_batch_per_gpu * gradient_acc_step * world_size",
           _broken(zero2, "mics", "ds_config.json", '"stage": 2', '"stage": 3, "mics_shard_size": 8'):
           "MiCS ZeRO-3 sharding has been removed"}
    # The pipeline engine's own ZeRO check, on a copy (the results are keyed by folder).
    pipeline = exports["deepspeed"]["70b-pp4-equal"]
    assert json.loads((pipeline / "ds_config.json").read_text())["pipeline"]["stages"] == 4
    engine_copy = _copy(pipeline, "engine")
    results = _run("deepspeed_check.py", good + list(bad) + [engine_copy], "--pipe", str(engine_copy),
                   env={"PORT": str(free_port())})
    _assert_verdicts(results, good, bad)
    for folder in good:
        # "Adam" stays Adam: DeepSpeed would run AdamW without adam_w_mode false.
        assert results[str(folder)]["optimizer"] == "adam" and results[str(folder)]["adam_w_mode"] is False
    engine = results[str(engine_copy)]
    assert engine["mode"] == "pipe" and engine["ok"] and engine["zero_stage"] == 1, engine


def test_megatron_core_accepts_every_export(exports):
    _require("megatron")
    good = list(exports["megatron"].values())
    sample = exports["megatron"]["70b-pp4-unequal"]
    bad = {_broken(sample, "tp3", "launch.sh", "--tensor-model-parallel-size 8", "--tensor-model-parallel-size 3"):
           "must be a multiple of tensor_model_parallel_size (3)",
           _broken(sample, "layout", "launch.sh", "t*19L", "t*18L"): "must match num_layers 80"}
    results = _run("megatron_core_check.py", good + list(bad))
    _assert_verdicts(results, good, bad)
    assert results[str(sample)]["num_micro_batches"] == 32
