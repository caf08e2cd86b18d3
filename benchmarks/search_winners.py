"""python benchmarks/search_winners.py --out before.json [--compare before.json] [--only NAME ...]

The search's answers on a fixed set of settings, to show that a change to the search (its bounds, its
pruning, a faster hot spot) changes how fast it is and not what it finds: for each setting the winner, its
predicted step time and the whole ranked top k (plan, step time, peak memory), with the plans priced and
the CPU seconds the search took. `--compare` fails, naming the setting, when any answer differs from a
file written before the change (CPU seconds and plans priced are reported beside, not compared).

The settings: the two `planner search` targets and the long-context one of README "Search speed" (as the
CLI runs them: top k 4 x 5), every row of benchmarks/search_speed.py's Megatron table and of
benchmarks/search_plausibility.py (with their options and engines), and a few more (Mixtral with expert
parallelism, Llama 3 8B on one node, the tiny model on CPU, a Megatron-priced 8B search).
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from planner.search import SearchOptions, default_cost_model, search  # noqa: E402
from specs.problem import Problem, make_problem  # noqa: E402


def _cli(model, hardware, gpus, batch, seq, engine="ours", top_k=20, per_node=8):
    return {"kind": "make", "args": dict(model=model, hardware=hardware, gpus=gpus, gpus_per_node=per_node,
                                         global_batch=batch, seq_len=seq), "engine": engine, "top_k": top_k}


def settings() -> dict[str, dict]:
    out = {
        "llama3-70b 1024xh100 b1024 s4096": _cli("llama3-70b", "h100", 1024, 1024, 4096),
        "llama3.1-70b 1024xh100 b1024 s131072": _cli("llama3.1-70b", "h100", 1024, 1024, 131072),
        "gpt3-175b 3072xa100 b1536 s2048": _cli("gpt3-175b", "a100", 3072, 1536, 2048),
        "mixtral-8x7b 64xh100 b256 s4096": _cli("mixtral-8x7b", "h100", 64, 256, 4096),
        "llama3-8b 8xh100 b128 s8192": _cli("llama3-8b", "h100", 8, 128, 8192),
        "llama3-8b 64xh100 b256 s8192 megatron": _cli("llama3-8b", "h100", 64, 256, 8192, engine="megatron"),
        "tiny 8xcpu b32": {"kind": "make", "args": dict(model="tiny", hardware="cpu", gpus=8, gpus_per_node=None,
                                                        global_batch=32, seq_len=None), "engine": "ours", "top_k": 20},
    }
    import search_speed

    for row in search_speed.megatron_rows():
        model = search_speed.preset_for(row)
        out[f"megatron-table {model} {row['num_gpus']}xa100 b{row['global_batch']}"] = _cli(
            model, "a100", int(row["num_gpus"]), int(row["global_batch"]), 2048, top_k=5)
    import search_plausibility

    for key, runs in sorted(search_plausibility.settings().items()):
        preset, gpus, seq, batch, precision, engine = key
        out[f"plausibility {preset} {gpus} s{seq} b{batch} {precision} {engine}"] = {
            "kind": "published", "key": key, "engine": engine, "top_k": SearchOptions().top_k}
    return out


def _problem(setting: dict) -> Problem:
    if setting["kind"] == "make":
        return make_problem(**setting["args"])
    import search_plausibility

    runs = search_plausibility.settings()[setting["key"]]
    best = max(runs, key=search_plausibility._measured_mfu)
    from specs.model import PRESETS

    return Problem(model=PRESETS[setting["key"][0]], cluster=best.cluster, job=best.job)


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def run(setting: dict) -> dict:
    problem = _problem(setting)
    cost = default_cost_model(setting["engine"])
    start = _cpu_s()
    result = search(problem, options=SearchOptions(top_k=setting["top_k"]), cost=cost)
    cpu_s = _cpu_s() - start
    fitting = [c for c in result.candidates if c.estimate.fits][: setting["top_k"]]
    return {"winner": result.winner.plan.to_dict(), "winner_step_time_s": result.winner.estimate.step_time_s,
            "top": [[c.plan.to_dict(), c.estimate.step_time_s, c.estimate.peak_memory_bytes] for c in fitting],
            "num_evaluated": result.num_evaluated, "cpu_s": cpu_s, "bound_violations": result.bound_violations}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--compare")
    parser.add_argument("--only", nargs="*", help="substrings of the setting names to run")
    args = parser.parse_args()
    before = json.loads(Path(args.compare).read_text()) if args.compare else {}
    results, failed = {}, []
    for name, setting in settings().items():
        if args.only and not any(s in name for s in args.only):
            continue
        res = results[name] = run(setting)
        line = f"{name}: {res['num_evaluated']} priced, {res['cpu_s']:.2f} CPU s"
        if name in before:
            old = before[name]
            same = all(res[k] == old[k] for k in ("winner", "winner_step_time_s", "top"))
            line += f" (before {old['num_evaluated']}, {old['cpu_s']:.2f} s) " + ("identical" if same else "DIFFERS")
            if not same:
                failed.append(name)
        print(line, flush=True)
        Path(args.out).write_text(json.dumps(results, indent=1))
    if failed:
        print("answers differ: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
