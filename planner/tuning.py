"""Optuna TPE over the knobs that are too many to enumerate, with the degrees fixed.

    planner search --model gpt3-175b --hardware a100 --gpus 3072 --global-batch 1536 \\
        --optuna-trials 200 --storage sqlite:///tune.db --study-name gpt3-175b

Given a plan's (dp, tp, pp, virtual stages, schedule), tune micro-batch size, the DP sharding point,
sequence parallelism, commshift, gradient bucket size, prefetch depth, recomputation per pipeline stage
and MAZ3 cache tier per stage: with pp stages that is 3^pp x 4^pp x ... combinations, where the
enumerating search uses one policy and one tier for all stages. TPE (Bergstra et al., NeurIPS 2011)
with a fixed seed; a study in `--storage` resumes where the last call stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.errors import PlannerError
from specs.problem import Problem
from specs.plan import CACHE_TIERS, RECOMPUTE, Plan
from planner.search import Candidate, CostModel, default_cost_model, divisors

BUCKET_MB_CHOICES = (1, 5, 25, 100, 400)
MAX_PREFETCH_DEPTH = 4


@dataclass(frozen=True)
class TuneResult:
    best: Candidate | None  # the fastest fitting plan any trial of the study found (None if none fits)
    num_trials: int  # trials in the study after this call, earlier calls included
    num_new_trials: int


def sharding_points(dp: int, *, tp: int, devices_per_node: int) -> dict[str, tuple[int, int, int]]:
    """Every Lins point of the search (planner.search.lins_points) by name: zero0..3, hsdp for one
    node's DP ranks, lins-<s_p>-<s_g>-<s_os> for the rest."""
    from planner.search import lins_points

    if dp == 1:
        return {"zero0": (1, 1, 1)}
    named = {(1, 1, 1): "zero0", (1, 1, dp): "zero1", (1, dp, dp): "zero2", (dp, dp, dp): "zero3"}
    in_node = max(1, min(dp, devices_per_node // tp))
    if 1 < in_node < dp:
        named.setdefault((in_node, in_node, in_node), "hsdp")
    return {named.get(point, "lins-%d-%d-%d" % point): point for point in lins_points(dp, dp_per_node=in_node)}


def plan_from_trial(trial, base: Plan, problem: Problem) -> Plan:
    """The plan a trial's choices describe; the degrees and schedule come from `base`.

    Raises optuna.TrialPruned for a micro-batch count the schedule cannot run (interleaving needs it
    divisible by pp), so TPE learns to avoid it.
    """
    import optuna

    per_replica = problem.job.global_batch // base.dp
    micro_batch = trial.suggest_categorical("micro_batch", divisors(per_replica))
    m = per_replica // micro_batch
    if base.schedule == "interleaved-1f1b" and m % base.pp:
        raise optuna.TrialPruned(f"{m} micro-batches do not divide by pp {base.pp}")
    points = sharding_points(base.dp, tp=base.tp, devices_per_node=problem.cluster.devices_per_node)
    shards = points[trial.suggest_categorical("sharding", list(points))]
    sp = trial.suggest_categorical("sequence_parallel", [False, True]) if base.tp > 1 and problem.job.seq_len % base.tp == 0 else False
    shift = trial.suggest_categorical("commshift", [False, True]) if base.pp > 1 and base.dp > 1 else False
    bucket_mb = trial.suggest_categorical("bucket_mb", list(BUCKET_MB_CHOICES)) if base.dp > 1 else None
    num_layers = problem.model.num_layers
    ranges = base.chunk_layer_ranges(num_layers)
    stage_rc = [trial.suggest_categorical(f"recompute_stage_{r}", list(RECOMPUTE)) for r in range(base.pp)]
    recompute_layers = [""] * num_layers
    for c, layers in enumerate(ranges):
        for i in layers:
            recompute_layers[i] = stage_rc[c % base.pp]
    changes: dict = dict(micro_batch=micro_batch, num_micro_batches=m, sequence_parallel=sp, commshift=shift,
                         param_shard=shards[0], grad_shard=shards[1], optim_shard=shards[2], param_cache="none",
                         # Per-layer policies override `recompute`, which then keeps the base's value.
                         recompute=stage_rc[0] if len(set(stage_rc)) == 1 else base.recompute,
                         recompute_layers=None if len(set(stage_rc)) == 1 else tuple(recompute_layers),
                         prefetch_depth=1)
    if bucket_mb is not None:
        changes["bucket_size_bytes"] = bucket_mb * 2**20
    if shards[0] > 1:
        changes["prefetch_depth"] = trial.suggest_int("prefetch_depth", 0, MAX_PREFETCH_DEPTH)
        tiers = [trial.suggest_categorical(f"cache_stage_{r}", list(CACHE_TIERS)) for r in range(base.pp)]
        per_layer = [""] * num_layers
        for c, layers in enumerate(ranges):
            for i in layers:
                per_layer[i] = tiers[c % base.pp]
        changes["param_cache"] = tiers[0] if len(set(tiers)) == 1 else tuple(per_layer)
    return base.replace(**changes)


def base_params(plan: Plan, problem: Problem) -> dict:
    """The trial parameters that reproduce `plan` (to seed a new study with the search's winner)."""
    points = sharding_points(plan.dp, tp=plan.tp, devices_per_node=problem.cluster.devices_per_node)
    params: dict = {"micro_batch": plan.micro_batch}
    name = next((k for k, v in points.items() if v == plan.shard_degrees), None)
    if name is None:
        return {}
    params["sharding"] = name
    if plan.tp > 1 and problem.job.seq_len % plan.tp == 0:
        params["sequence_parallel"] = plan.sequence_parallel
    if plan.pp > 1 and plan.dp > 1:
        params["commshift"] = plan.commshift
    if plan.dp > 1:
        mb = plan.bucket_size_bytes / 2**20
        params["bucket_mb"] = min(BUCKET_MB_CHOICES, key=lambda c: abs(c - mb))
    ranges = plan.chunk_layer_ranges(problem.model.num_layers)
    for r in range(plan.pp):
        params[f"recompute_stage_{r}"] = plan.layer_recompute(ranges[r][0])
        if plan.param_shard > 1:
            params[f"cache_stage_{r}"] = plan.layer_cache(ranges[r][0])
    if plan.param_shard > 1:
        params["prefetch_depth"] = min(plan.prefetch_depth, MAX_PREFETCH_DEPTH)
    return params


def tune(problem: Problem, *, base: Plan, num_trials: int, seed: int = 0, storage: str | None = None,
         study_name: str | None = None, cost: CostModel | None = None) -> TuneResult:
    """Run `num_trials` more TPE trials around `base`'s degrees; the best fitting plan of the study.

    The objective is the predicted step time; a plan that does not fit scores its step time times
    (2 + shortfall / limit), so TPE is steered back into memory without a cliff.
    """
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    cost = cost or default_cost_model()
    kwargs = {"model": problem.model, "cluster": problem.cluster, "job": problem.job}
    name = study_name or f"{problem.model.name}-{problem.cluster.num_devices}-{base.describe()}"
    try:
        study = optuna.create_study(study_name=name, storage=storage, direction="minimize", load_if_exists=True,
                                    sampler=optuna.samplers.TPESampler(seed=seed))
    except Exception as exc:  # noqa: BLE001 - a bad URL fails deep in SQLAlchemy with many error types
        raise PlannerError(f"--storage {storage!r}: {str(exc).splitlines()[0]}") from None
    if not study.trials and (params := base_params(base, problem)):
        study.enqueue_trial(params)
    before = len(study.trials)

    def objective(trial) -> float:
        plan = plan_from_trial(trial, base, problem)
        est = cost.estimate(plan, **kwargs)
        trial.set_user_attr("fits", est.fits)
        if est.fits:
            return est.step_time_s
        return est.step_time_s * (2.0 + est.memory_shortfall_bytes / est.memory_limit_bytes)

    study.optimize(objective, n_trials=num_trials)
    best = _best_fitting(study, base, problem, cost)
    return TuneResult(best=best, num_trials=len(study.trials), num_new_trials=len(study.trials) - before)


def _best_fitting(study, base: Plan, problem: Problem, cost: CostModel) -> Candidate | None:
    import optuna

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("fits")]
    if not done:
        return None
    trial = min(done, key=lambda t: t.value)
    plan = plan_from_trial(optuna.trial.FixedTrial(trial.params), base, problem)
    return Candidate(plan, cost.estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job))
