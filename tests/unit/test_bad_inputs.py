"""Bad input everywhere gives one clear line and exit code 2, never a traceback.

A corpus of malformed files (tests/fixtures/bad_inputs/: model configs, hardware profiles, plans, run
configs, metrics files, checkpoint metadata) and bad flags goes through the real entry points
(`planner.cli.main`, the worker's `runners.train.main`, the checkpoint loader); and hypothesis feeds
every JSON loader arbitrary JSON values, whole and as one-key mutations of a valid object: each gives a
valid object or PlannerError, nothing else.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specs.errors import PlannerError
from specs.job import Job
from specs.model import PRESETS, ModelSpec, model_from_hf_config, resolve_model
from specs.plan import Plan
from specs.planfile import HardwareSource, PlanFile
from specs.hardware import PRESETS as HARDWARE
from specs.hardware import Hardware, resolve_hardware
from runners.checkpoint import CheckpointMeta, load_meta
from runners.train import RunConfig

CORPUS = Path(__file__).resolve().parents[1] / "fixtures" / "bad_inputs"
SMALL = ["--gpus", "2", "--global-batch", "8", "--seq-len", "64"]
RUN = ["run", "--nproc", "2", "--global-batch", "8", "--seq-len", "64", "--steps", "2"]


def _cli_cases() -> list[tuple[str, list[str]]]:
    cases = []
    for path in sorted(CORPUS.glob("model_*.json")):
        cases.append((path.name, ["estimate", "--model", str(path), "--hardware", "cpu", *SMALL]))
    for path in sorted(CORPUS.glob("hardware_*.json")):
        cases.append((path.name, ["estimate", "--model", "tiny", "--hardware", str(path), *SMALL]))
    for path in sorted(CORPUS.glob("plan_*.json")):
        cases.append((path.name, [*RUN, "--plan", str(path)]))
    for path in sorted(CORPUS.glob("metrics_*.json")):
        cases.append((path.name, ["explain", "--plan", str(CORPUS / "good_plan_dp2.json"), "--measured", str(path),
                                  "--model", "tiny", "--hardware", "cpu", "--global-batch", "8", "--seq-len", "64",
                                  "--png", "/dev/null"]))
    flags = {
        "gpus-not-a-number": ["estimate", "--model", "tiny", "--hardware", "cpu", "--gpus", "two", "--global-batch", "8"],
        "unknown-flag": [*RUN, "--zero-stage", "3"],
        "missing-required": ["search", "--model", "tiny"],
        "unknown-command": ["trian"],
        "unknown-model": ["estimate", "--model", "llama4-9000b", "--hardware", "cpu", *SMALL],
        "unknown-hardware": ["estimate", "--model", "tiny", "--hardware", "tpu-v9", *SMALL],
        "precision-fp8": ["estimate", "--model", "tiny", "--hardware", "cpu", *SMALL, "--precision", "fp8"],
        "zero-stage-5": [*RUN, "--zero", "5"],
        "tp-zero": [*RUN, "--tp", "0"],
        "tp-not-dividing-devices": [*RUN, "--tp", "3"],
        "steps-zero": [*RUN[:-1], "0"],
        "global-batch-negative": ["estimate", "--model", "tiny", "--hardware", "cpu", "--gpus", "2", "--global-batch", "-8"],
        "batch-not-divisible": [*RUN, "--micro-batch", "3"],
        "nproc-zero": [*RUN, "--nproc", "0"],
        "data-path-missing": [*RUN, "--data", "/nonexistent/corpus.txt"],
        "engine-unknown": [*RUN, "--engine", "jax"],
        "checkpoint-every-negative": [*RUN, "--checkpoint-dir", "/tmp/x", "--checkpoint-every", "-1"],
        "checkpoint-every-without-dir": [*RUN, "--checkpoint-every", "5"],
        "resume-without-dir": [*RUN, "--resume"],
        "max-restarts-without-dir": [*RUN, "--max-restarts", "2"],
        "checkpoint-dir-is-a-file": [*RUN, "--checkpoint-dir", str(CORPUS / "plan_null.json")],
        "checkpoint-keep-zero": [*RUN, "--checkpoint-dir", "/tmp/x", "--checkpoint-keep", "0"],
        "timeout-zero": [*RUN, "--timeout", "0"],
        "timeout-not-a-number": [*RUN, "--timeout", "soon"],
        "lr-negative": [*RUN, "--lr", "-0.1"],
        "schedule-unknown": [*RUN, "--pp", "2", "--schedule", "zigzag"],
        "checkpoint-with-torch-engine": [*RUN, "--engine", "torch", "--checkpoint-dir", "/tmp/x"],
    }
    cases += list(flags.items())
    return cases


CLI_CASES = _cli_cases()


def test_the_corpus_is_large():
    assert len(list(CORPUS.glob("*.json"))) >= 40
    assert len(CLI_CASES) >= 55


def _main(argv: list[str], monkeypatch, capsys) -> tuple[int, str, str]:
    from planner.cli import main

    monkeypatch.setattr(sys, "argv", ["planner", *argv])
    with pytest.raises(SystemExit) as info:
        main()
    out = capsys.readouterr()
    return info.value.code, out.out, out.err


def _assert_one_clean_line(code, err: str, what: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2, f"{what}: exit code {code}, stderr:\n{err}"
    assert len(lines) == 1, f"{what}: expected one line on stderr, got:\n{err}"
    assert "Traceback" not in err and lines[0].startswith("error: "), f"{what}: {err}"


@pytest.mark.parametrize("name,argv", CLI_CASES, ids=[c[0] for c in CLI_CASES])
def test_cli_bad_input_is_one_line_and_exit_2(name, argv, monkeypatch, capsys):
    code, _, err = _main(argv, monkeypatch, capsys)
    _assert_one_clean_line(code, err, name)


def test_the_installed_script_too(tmp_path):
    """The console script (a real process) behaves as main() does."""
    import subprocess

    planner = shutil.which("planner")
    if planner is None:
        pytest.skip("the planner console script is not installed")
    proc = subprocess.run([planner, "estimate", "--model", str(CORPUS / "model_hf_bert.json"), "--hardware", "cpu",
                           *SMALL], capture_output=True, text=True, timeout=120)
    _assert_one_clean_line(proc.returncode, proc.stderr, "installed script")
    assert "bert" in proc.stderr


@pytest.mark.parametrize("path", sorted(CORPUS.glob("run_config_*.json")), ids=lambda p: p.name)
def test_worker_bad_run_config_is_one_line_and_exit_2(path, tmp_path, monkeypatch, capsys):
    """The torchrun worker's own entry (runners.train under runners.launch.worker_main) refuses a bad
    run config before any collective."""
    from runners.launch import worker_main
    from runners.train import run_task

    shutil.copy(path, tmp_path / "spec.json")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    code = worker_main(run_task, ["--work-dir", str(tmp_path)])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    report = json.loads((tmp_path / "errors" / "rank0.json").read_text())
    assert report["bad_input"] is True


@pytest.mark.parametrize("path", sorted(CORPUS.glob("ckpt_meta_*.json")), ids=lambda p: p.name)
def test_bad_checkpoint_metadata_is_a_planner_error(path, tmp_path):
    shutil.copy(path, tmp_path / "planner_meta.json")
    with pytest.raises(PlannerError) as info:
        load_meta(tmp_path)
    assert "\n" not in str(info.value)


# --- hypothesis: every JSON loader ----------------------------------------------------------------------------
JSON_SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=True, allow_infinity=True)
                | st.text(max_size=10))
JSON_VALUES = st.recursive(JSON_SCALARS, lambda inner: st.lists(inner, max_size=4)
                           | st.dictionaries(st.text(max_size=10), inner, max_size=4), max_leaves=12)


def _valid_objects() -> dict:
    from tests.distributed.harness import tiny_config

    cfg = tiny_config(Plan(dp=2, micro_batch=2, num_micro_batches=2))
    meta = CheckpointMeta(step=3, seed=1, model=cfg.model, job=cfg.job, data=None, plan=cfg.plan, world_size=2,
                          rng_states=("AAAA", "AAAA"))
    return {
        "plan": (Plan.from_dict, Plan(dp=2, tp=2, pp=2, stage_layers=(4, 4), micro_batch=1, num_micro_batches=4).to_dict()),
        "model": (ModelSpec.from_dict, PRESETS["tiny"].to_dict()),
        "job": (Job.from_dict, cfg.job.to_dict()),
        "hardware": (Hardware.from_dict, HARDWARE["h100"].to_dict()),
        "run config": (RunConfig.from_dict, json.loads(json.dumps(cfg.to_dict()))),
        "checkpoint metadata": (CheckpointMeta.from_dict, meta.to_dict()),
        "plan file": (PlanFile.from_dict, _plan_file().to_dict()),
    }


def _plan_file() -> PlanFile:
    from specs.problem import make_problem

    problem = make_problem(model="tiny", hardware="cpu", gpus=4, gpus_per_node=2, global_batch=8, seq_len=64)
    return PlanFile(plan=Plan(dp=2, pp=2, micro_batch=1, num_micro_batches=4), model=problem.model, job=problem.job,
                    cluster=problem.cluster, hardware_source=HardwareSource("cpu"))


VALID = _valid_objects()


def _loads_or_planner_error(load, value) -> None:
    try:
        load(value)
    except PlannerError as exc:
        assert str(exc)


@pytest.mark.parametrize("kind", list(VALID))
@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_every_json_value_gives_an_object_or_planner_error(kind, data):
    load, valid = VALID[kind]
    _loads_or_planner_error(load, data.draw(JSON_VALUES))
    mutated = dict(valid)
    key = data.draw(st.sampled_from(sorted(valid)))
    action = data.draw(st.sampled_from(["replace", "delete", "nested"]))
    if action == "delete":
        del mutated[key]
    elif action == "nested" and isinstance(valid[key], dict) and valid[key]:
        inner = dict(valid[key])
        inner[data.draw(st.sampled_from(sorted(inner)))] = data.draw(JSON_VALUES)
        mutated[key] = inner
    else:
        mutated[key] = data.draw(JSON_VALUES)
    _loads_or_planner_error(load, mutated)


HF_LLAMA = {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 4, "num_hidden_layers": 8,
            "hidden_size": 64, "intermediate_size": 176, "vocab_size": 256, "max_position_embeddings": 128}


HF_GPT2 = {"model_type": "gpt2", "n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 256, "n_positions": 128}


def test_hf_activation_and_norm_epsilon_are_the_configs_or_one_line(tmp_path):
    """The engine runs what the config says or the reader says why not: GPT-2's GELU (transformers' default
    gelu_new is the tanh approximation), llama's silu only, the norm epsilon as written."""
    def read(cfg):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg))
        return model_from_hf_config(path)

    assert read(HF_GPT2).gelu_approximation == "tanh" and read(HF_GPT2).norm_eps == 1e-5
    assert read(dict(HF_GPT2, activation_function="gelu", layer_norm_epsilon=1e-6)).gelu_approximation == "none"
    assert read(dict(HF_LLAMA, rms_norm_eps=1e-5)).norm_eps == 1e-5 and read(HF_LLAMA).norm_eps == 1e-6
    # A llama config's head_dim other than hidden / heads is run as written.
    assert read(dict(HF_LLAMA, head_dim=16)).head_dim == 16 and read(dict(HF_LLAMA, head_dim=8)).attention_head_dim == 0
    for cfg, message in ((dict(HF_GPT2, activation_function="relu"), "'activation_function' 'relu' is not supported"),
                         (dict(HF_LLAMA, hidden_act="gelu"), "'hidden_act' 'gelu' is not supported"),
                         (dict(HF_LLAMA, attention_bias=True), "'attention_bias' true is not supported for llama"),
                         (dict(HF_LLAMA, mlp_bias=True), "'mlp_bias' true is not supported for llama")):
        with pytest.raises(PlannerError, match=message) as exc:
            read(cfg)
        assert "\n" not in str(exc.value)


LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192}


def test_hf_rope_base_and_scaling_in_either_transformers_layout(tmp_path):
    """transformers < 5 writes rope_theta and rope_scaling, transformers 5 both inside rope_parameters; Llama
    3.1's llama3 scaling is run, HF's other types are kept by name (the engine refuses them), others refused."""
    def read(cfg):
        path = tmp_path / "config.json"
        path.write_text(json.dumps(cfg))
        return model_from_hf_config(path)

    old = read(dict(HF_LLAMA, rope_theta=500000.0, rope_scaling=LLAMA31_ROPE))
    new = read(dict(HF_LLAMA, rope_parameters=dict(LLAMA31_ROPE, rope_theta=500000.0)))
    assert old == new and (new.rope_base, new.rope_scaling, new.rope_scaling_factor) == (500000.0, "llama3", 8.0)
    plain = read(dict(HF_LLAMA, rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    assert (plain.rope_base, plain.rope_scaling) == (1e6, "none")
    assert read(dict(HF_LLAMA, rope_scaling={"type": "yarn", "factor": 4.0})).rope_scaling == "yarn"
    for scaling, message in (({"rope_type": "su"}, "rope_type 'su' is not supported"),
                             ({"rope_type": "llama3", "factor": 8.0}, "misses 'low_freq_factor'"),
                             (dict(LLAMA31_ROPE, low_freq_factor=4.0), "llama3 rope scaling needs factor >= 1"),
                             ("llama3", "must be an object or null")):
        with pytest.raises(PlannerError, match=message) as exc:
            read(dict(HF_LLAMA, rope_scaling=scaling))
        assert "\n" not in str(exc.value)


def test_the_engine_refuses_rope_scalings_it_does_not_run():
    import dataclasses

    from runners.transformer import check_model_runnable
    from specs.model import PRESETS
    from specs.plan import Plan

    check_model_runnable(PRESETS["llama3.1-8b"], Plan(dp=2))  # llama3 scaling runs
    with pytest.raises(ValueError, match="the engine does not run yarn rope scaling of model tiny"):
        check_model_runnable(dataclasses.replace(PRESETS["tiny"], rope_scaling="yarn"), Plan(dp=2))


@settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))
@given(key=st.sampled_from(sorted(HF_LLAMA) + ["tie_word_embeddings", "rms_norm_eps", "hidden_act", "head_dim",
                                               "attention_bias", "rope_scaling", "rope_parameters"]), value=JSON_VALUES,
       gpt_key=st.sampled_from(sorted(HF_GPT2) + ["activation_function", "layer_norm_epsilon"]), whole=JSON_VALUES)
def test_hf_config_files_give_a_model_or_planner_error(tmp_path_factory, key, value, gpt_key, whole):
    folder = tmp_path_factory.mktemp("hf")
    for i, data in enumerate(({**HF_LLAMA, key: value}, {**HF_GPT2, gpt_key: value}, whole)):
        path = folder / f"config{i}.json"
        path.write_text(json.dumps(data))
        for load in (model_from_hf_config, resolve_model):
            try:
                load(str(path))
            except PlannerError:
                pass


@settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))
@given(raw=st.binary(max_size=64) | JSON_VALUES.map(lambda v: json.dumps(v).encode()))
def test_profile_and_plan_files_of_any_bytes(tmp_path_factory, raw):
    from planner.inputs import load_plan

    path = tmp_path_factory.mktemp("raw") / "file.json"
    path.write_bytes(raw)
    for load in (resolve_hardware, load_plan, resolve_model, lambda p: load_meta(Path(p).parent)):
        if load is not load_plan and load is not resolve_hardware and load is not resolve_model:
            (path.parent / "planner_meta.json").write_bytes(raw)
        try:
            load(str(path))
        except PlannerError:
            pass


def test_a_worker_that_succeeded_leaves_without_the_interpreter_teardown_and_a_failed_one_with_its_code():
    import subprocess
    import sys

    script = ("import atexit, sys; from runners.launch import exit_worker; "
              "atexit.register(lambda: print('teardown ran')); print('result written'); exit_worker(int(sys.argv[1]))")
    ok = subprocess.run([sys.executable, "-c", script, "0"], capture_output=True, text=True)
    assert (ok.returncode, ok.stdout.split()) == (0, ["result", "written"])
    failed = subprocess.run([sys.executable, "-c", script, "2"], capture_output=True, text=True)
    assert failed.returncode == 2 and "teardown ran" in failed.stdout
