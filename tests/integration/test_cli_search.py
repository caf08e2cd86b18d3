"""`planner search` and `planner estimate` end to end on the tiny model, and their bad-input paths."""

import json
import subprocess
import sys

import pytest
from typer.testing import CliRunner

from specs.errors import PlannerError

from planner.cli import app
from specs.problem import make_problem
from planner.inputs import load_plan

runner = CliRunner()
TINY = ["--model", "tiny", "--hardware", "cpu", "--gpus", "8", "--global-batch", "32", "--seq-len", "64"]


def invoke(*args: str):
    return runner.invoke(app, list(args))


def test_search_json_is_ranked_and_matches_estimate(tmp_path):
    out = tmp_path / "plan.json"
    result = invoke("search", *TINY, "--top", "3", "--format", "json", "--out", str(out))
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert set(data) == {"engine", "search_time_s", "num_evaluated", "plans", "pareto"} and data["engine"] == "ours"
    assert len(data["plans"]) == 3 and data["num_evaluated"] >= 3
    times = [p["estimate"]["step_time_s"] for p in data["plans"]]
    assert times == sorted(times) and all(p["estimate"]["fits"] for p in data["plans"])
    # Distinct plans: none within the cost model's resolution (1%) in step time of another with the same
    # degrees and micro-batches.
    layout = ("dp", "tp", "pp", "virtual_stages", "schedule", "micro_batch", "num_micro_batches", "sequence_parallel")
    for i, a in enumerate(data["plans"]):
        for b in data["plans"][i + 1:]:
            same_time = abs(a["estimate"]["step_time_s"] - b["estimate"]["step_time_s"]) <= \
                0.01 * b["estimate"]["step_time_s"]
            assert not (same_time and all(a["plan"][k] == b["plan"][k] for k in layout))
    # The file search writes loads as a plan, and estimate prices it to the same numbers.
    problem = make_problem(model="tiny", hardware="cpu", gpus=8, gpus_per_node=None, global_batch=32, seq_len=64)
    plan = load_plan(str(out), problem)
    assert plan.to_dict() == data["plans"][0]["plan"]
    saved = json.loads(out.read_text())
    assert set(saved) == {"format", "plan", "estimate", "model", "job", "cluster", "hardware", "engine"}
    est = json.loads(invoke("estimate", *TINY, "--plan", str(out), "--format", "json").stdout)
    assert est["step_time_s"] == pytest.approx(times[0])
    assert est["peak_memory_bytes"] == data["plans"][0]["estimate"]["peak_memory_bytes"]


def test_search_table_explains_the_winner():
    result = invoke("search", *TINY, "--top", "4")
    assert result.exit_code == 0, result.output
    assert "Best plans" in result.stdout and "priced" in result.stdout
    assert "#1 beats #2 by" in result.stdout or "tie" in result.stdout


def test_estimate_from_flags_reports_breakdown_and_shortfall():
    result = invoke("estimate", *TINY, "--tp", "2", "--pp", "2", "--micro-batch", "2", "--zero", "1",
                    "--sequence-parallel", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    for key in ("step_time_s", "tokens_per_s", "mfu", "tflops_per_gpu", "peak_memory_bytes", "fits", "breakdown"):
        assert key in data
    assert data["plan"]["dp"] == 2 and data["plan"]["optim_shard"] == 2
    # 1.7B parameters unsharded on one 8 GiB CPU "device" cannot fit; the table says by how much.
    big = invoke("estimate", "--model", "gpt3-1.7b", "--hardware", "cpu", "--gpus", "1", "--global-batch", "1")
    assert big.exit_code == 0, big.output
    assert "does not fit: needs" in big.stdout and "GiB more per device" in big.stdout


def test_search_with_optuna_resumes_its_study(tmp_path):
    storage = f"sqlite:///{tmp_path / 'tune.db'}"
    args = ["search", *TINY, "--optuna-trials", "5", "--storage", storage, "--study-name", "s", "--format", "json"]
    first = json.loads(invoke(*args).stdout)
    second = json.loads(invoke(*args).stdout)
    import optuna

    assert len(optuna.load_study(study_name="s", storage=storage).trials) == 10
    assert second["plans"][0]["estimate"]["step_time_s"] <= first["plans"][0]["estimate"]["step_time_s"]


@pytest.mark.parametrize("args,message", [
    (["search", "--model", "llama3-7b", "--hardware", "h100", "--gpus", "8", "--global-batch", "8"], "did you mean llama3-70b"),
    (["estimate", "--model", "tiny", "--hardware", "h10", "--gpus", "8", "--global-batch", "8"], "did you mean h100"),
    (["estimate", *TINY, "--dp", "3", "--tp", "2"], "dp x tp x pp = 3 x 2 x 1 = 6, but the cluster has 8 devices"),
    (["estimate", "--model", "tiny", "--hardware", "cpu", "--gpus", "6", "--global-batch", "6", "--tp", "3"],
     "tp 3 does not divide the model's num_heads 8"),
    (["estimate", "--model", "tiny", "--hardware", "cpu", "--gpus", "16", "--global-batch", "16", "--pp", "16"],
     "exceeds the model's 8 layers"),
    (["estimate", "--model", "tiny", "--hardware", "cpu", "--gpus", "8", "--global-batch", "12"],
     "global batch 12 is not divisible"),
    (["search", "--model", "gpt3-175b", "--hardware", "a100", "--gpus", "8", "--global-batch", "8"],
     "no plan fits in 72.0 GiB per device (80.0 GiB less the 10% memory headroom); the leanest"),
])
def test_bad_input_is_one_line_and_exit_2(args, message):
    result = invoke(*args)
    assert result.exit_code == 2, result.output
    assert message in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.output


def test_console_script_main_turns_errors_into_one_line():
    # main() (the installed entry point) rather than `app`: the same one line and exit code 2.
    proc = subprocess.run([sys.executable, "-c", "from planner.cli import main; main()", "estimate", *TINY,
                           "--tp", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and "does not divide" in proc.stderr
    ok = subprocess.run([sys.executable, "-c", "from planner.cli import main; main()", "search", "--help"],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and "Examples" in ok.stdout


def test_a_plan_file_needs_no_other_flag_and_refuses_contradicting_ones(tmp_path):
    """The issue's case: a 1024-GPU plan file, then explain and export with no other flag."""
    plan = tmp_path / "plan.json"
    searched = invoke("search", "--model", "llama3-70b", "--hardware", "h100", "--gpus", "1024", "--global-batch",
                      "1024", "--seq-len", "4096", "--engine", "megatron", "--out", str(plan), "--format", "json")
    assert searched.exit_code == 0, searched.output
    assert json.loads(searched.stdout)["engine"] == "megatron" and json.loads(plan.read_text())["engine"] == "megatron"
    explained = invoke("explain", "--plan", str(plan), "--png", str(tmp_path / "x.png"), "--format", "json")
    assert explained.exit_code == 0, explained.output
    # h100's 80 GiB less the default 10% memory headroom of a GPU, not the cpu preset
    assert json.loads(explained.stdout)["estimate"]["memory_limit_bytes"] == int(80 * 2**30 * 0.9)
    exported = invoke("export", "--plan", str(plan), "--to", "megatron")
    assert exported.exit_code == 0, exported.output
    assert "pretrain_gpt.py" in exported.stdout and "--num-layers 80" in exported.stdout
    assert "as megatron runs it:" in exported.stderr and "GiB per device" in exported.stderr
    estimated = json.loads(invoke("estimate", "--plan", str(plan), "--engine", "torchtitan", "--format", "json").stdout)
    assert estimated["engine"] == "torchtitan" and estimated["plan"] == json.loads(plan.read_text())["plan"]
    # Repeating what the file says is fine; contradicting it is one line and exit code 2.
    assert invoke("explain", "--plan", str(plan), "--model", "llama3-70b", "--gpus", "1024",
                  "--png", str(tmp_path / "y.png")).exit_code == 0
    for flags, message in ((["--model", "llama3-8b"], "--model llama3-8b contradicts the plan file"),
                           (["--hardware", "cpu"], "--hardware cpu contradicts the plan file"),
                           (["--seq-len", "2048"], "--seq-len 2048 contradicts the plan file")):
        result = invoke("explain", "--plan", str(plan), *flags)
        assert result.exit_code == 2 and message in result.stderr, result.output
        assert len(result.stderr.strip().splitlines()) == 1
    mixed = invoke("estimate", "--plan", str(plan), "--tp", "4")
    assert mixed.exit_code == 2 and "--tp cannot be combined with --plan" in mixed.stderr


def test_bare_and_old_plan_files_say_what_they_lack(tmp_path):
    bare = tmp_path / "bare.json"
    bare.write_text(json.dumps({"dp": 8}))
    result = invoke("export", "--plan", str(bare), "--to", "megatron")
    assert result.exit_code == 2 and "holds a bare plan: give --model" in result.stderr
    ok = invoke("export", "--plan", str(bare), "--to", "megatron", "--model", "tiny", "--hardware", "cpu",
                "--global-batch", "8", "--seq-len", "64")
    assert ok.exit_code == 0, ok.output
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"plan": {"dp": 8}, "model": {}, "job": {}, "estimate": {}}))
    result = invoke("explain", "--plan", str(old))
    assert result.exit_code == 2 and "older `planner search --out`" in result.stderr


def test_search_help_and_table_explain_the_notation():
    result = invoke("search", "--help")
    assert "shard=(P,G,O)" in " ".join(result.stdout.split()) and "cache=device" in result.stdout
    table = invoke("search", *TINY, "--top", "3")
    assert "Notation:" in table.stdout and "mbMxN" in table.stdout


def test_run_refuses_a_multi_node_plan_file_without_nodes_or_processes(tmp_path):
    from planner.run_command import RunRequest, resolve_request

    plan = tmp_path / "plan.json"
    assert invoke("search", "--model", "tiny", "--hardware", "cpu", "--gpus", "4", "--gpus-per-node", "2",
                  "--global-batch", "8", "--seq-len", "64", "--out", str(plan)).exit_code == 0
    unset = dict(model=None, hardware=None, global_batch=None, seq_len=None, nproc=None, nnodes=None)
    with pytest.raises(PlannerError, match="is for 2 nodes of 2: give --nnodes 2"):
        resolve_request(RunRequest(plan_file=str(plan), **unset), {})
    here, _ = resolve_request(RunRequest(plan_file=str(plan), **{**unset, "nproc": 4}), {})
    assert (here.nproc, here.nnodes, here.gpus_per_node) == (4, 1, 2)
    with pytest.raises(PlannerError, match="--global-batch 16 contradicts the plan file"):
        resolve_request(RunRequest(plan_file=str(plan), **{**unset, "nproc": 4, "global_batch": 16}), {})
