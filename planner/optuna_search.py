"""Optuna TPE over the knobs that are too many to enumerate, with the degrees fixed.

    planner search --model gpt3-175b --hardware a100 --gpus 3072 --global-batch 1536 \\
        --optuna-trials 200 --storage sqlite:///tune.db --study-name gpt3-175b

Given a plan's (dp, tp, pp, virtual stages, schedule), tune micro-batch size, the DP sharding point,
recomputation per pipeline stage, the MAZ3 cache tier per stage, and every plan knob that declares a
tuning space (`Knob.tune` in specs/plan.py: sequence parallelism, commshift, gradient bucket size,
prefetch depth, and any knob added later) where it applies: with pp stages that is 3^pp x 4^pp x ...
combinations, where the enumerating search uses one policy and one tier for all stages. TPE (Bergstra
et al., NeurIPS 2011) with a fixed seed; a study in `--storage` resumes where the last call stopped.
"""

from __future__ import annotations

from dataclasses import dataclass

from specs.errors import PlannerError
from specs.problem import Problem
from specs.plan import CACHE_TIERS, PLAN_KNOBS, RECOMPUTE, Plan
from planner.search import Candidate, CostModel, default_cost_model, divisors



@dataclass(frozen=True)
class OptunaResult:
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


def _tuned_knobs(plan: Plan) -> list:
    """The plan knobs with a tuning space that have an effect on `plan` (its degrees and sharding)."""
    return [spec for spec in PLAN_KNOBS if spec.knob.tune is not None
            and (spec.knob.applies is None or spec.knob.applies(plan))
            and not (spec.name == "sequence_parallel" and plan.tp == 1)]


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
    points = sharding_points(base.dp_cp, tp=base.tp, devices_per_node=problem.cluster.devices_per_node)
    shards = points[trial.suggest_categorical("sharding", list(points))]
    ranges = base.chunk_layer_ranges(problem.model.num_layers)
    stage_rc = [trial.suggest_categorical(f"recompute_stage_{r}", list(RECOMPUTE)) for r in range(base.pp)]
    # Per-layer policies override `recompute`, which then keeps the base's value.
    changes: dict = dict(micro_batch=micro_batch, num_micro_batches=m, param_shard=shards[0], grad_shard=shards[1],
                         optim_shard=shards[2], param_cache="none",
                         recompute=stage_rc[0] if len(set(stage_rc)) == 1 else base.recompute,
                         recompute_layers=None if len(set(stage_rc)) == 1 else _per_layer(stage_rc, ranges, base.pp))
    if shards[0] > 1:
        tiers = [trial.suggest_categorical(f"cache_stage_{r}", list(CACHE_TIERS)) for r in range(base.pp)]
        changes["param_cache"] = tiers[0] if len(set(tiers)) == 1 else _per_layer(tiers, ranges, base.pp)
    # Every other knob with a tuning space: at its default unless it has an effect on this plan.
    plan = base.replace(**changes, **{spec.name: spec.default for spec in PLAN_KNOBS if spec.knob.tune is not None})
    return plan.replace(**{spec.name: trial.suggest_categorical(spec.name, list(spec.knob.tune))
                           for spec in _tuned_knobs(plan)})


def _per_layer(per_stage: list, ranges: list[range], pp: int) -> tuple:
    """Each layer's value from its pipeline stage's (chunk c lives on stage c % pp)."""
    out = [None] * sum(len(r) for r in ranges)
    for c, layers in enumerate(ranges):
        for i in layers:
            out[i] = per_stage[c % pp]
    return tuple(out)


def base_params(plan: Plan, problem: Problem) -> dict:
    """The trial parameters that reproduce `plan` (to seed a new study with the search's winner)."""
    points = sharding_points(plan.dp_cp, tp=plan.tp, devices_per_node=problem.cluster.devices_per_node)
    params: dict = {"micro_batch": plan.micro_batch}
    name = next((k for k, v in points.items() if v == plan.shard_degrees), None)
    if name is None:
        return {}
    params["sharding"] = name
    ranges = plan.chunk_layer_ranges(problem.model.num_layers)
    for r in range(plan.pp):
        params[f"recompute_stage_{r}"] = plan.layer_recompute(ranges[r][0])
        if plan.param_shard > 1:
            params[f"cache_stage_{r}"] = plan.layer_cache(ranges[r][0])
    for spec in _tuned_knobs(plan):
        value = getattr(plan, spec.name)
        # The nearest value of the space (a bucket size off the grid starts from the closest one).
        params[spec.name] = value if value in spec.knob.tune else min(spec.knob.tune, key=lambda v: abs(v - value))
    return params


def refine_with_optuna(problem: Problem, *, base: Plan, num_trials: int, seed: int = 0, storage: str | None = None,
         study_name: str | None = None, cost: CostModel | None = None) -> OptunaResult:
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
        try:
            est = cost.estimate(plan, **kwargs)
        except PlannerError as exc:  # e.g. sequence parallelism where tp does not divide the sequence
            raise optuna.TrialPruned(str(exc)) from None
        trial.set_user_attr("fits", est.fits)
        if est.fits:
            return est.step_time_s
        return est.step_time_s * (2.0 + est.memory_shortfall_bytes / est.memory_limit_bytes)

    study.optimize(objective, n_trials=num_trials)
    best = _best_fitting(study, base, problem, cost)
    return OptunaResult(best=best, num_trials=len(study.trials), num_new_trials=len(study.trials) - before)


def _best_fitting(study, base: Plan, problem: Problem, cost: CostModel) -> Candidate | None:
    import optuna

    done = [t for t in study.trials if t.state == optuna.trial.TrialState.COMPLETE and t.user_attrs.get("fits")]
    if not done:
        return None
    trial = min(done, key=lambda t: t.value)
    plan = plan_from_trial(optuna.trial.FixedTrial(trial.params), base, problem)
    return Candidate(plan, cost.estimate(plan, model=problem.model, cluster=problem.cluster, job=problem.job))


def refined_ranking(result, problem: Problem, *, num_trials: int, seed: int = 0, storage: str | None = None,
                    study_name: str | None = None, cost: CostModel | None = None) -> tuple[list[Candidate], int]:
    """The search's ranking (a planner.search.SearchResult) with the best plan of `num_trials` TPE trials
    around its winner in front when it is faster, and the number of plans priced in all."""
    ranked = list(result.candidates)
    tuned = refine_with_optuna(problem, base=result.winner.plan, num_trials=num_trials, seed=seed, storage=storage,
                               study_name=study_name, cost=cost)
    if tuned.best is not None and tuned.best.estimate.step_time_s < ranked[0].estimate.step_time_s:
        ranked.insert(0, tuned.best)
    return ranked, result.num_evaluated + tuned.num_new_trials
