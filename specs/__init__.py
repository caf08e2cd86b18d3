"""specs: the bottom room. The input types every other room speaks, and nothing else.

`ModelSpec` (what is trained), `Cluster` and `Hardware` (where), `Job` (batch, sequence, precision),
`Plan` (how, with its knob table), `Problem` (model + cluster + job), the pipeline schedules as action
lists (the one definition the cost model simulates and the engine executes), strict JSON I/O and the
error type. This package imports no other room of the project and no torch, so that the cost model,
the search and the CLI's argument checks run anywhere in milliseconds.

Rooms above it (the dependency direction is fixed; tests/unit/test_layering.py checks it):
    cost_models/  prices a plan           (imports specs only)
    runners/      executes a plan         (imports specs only)
    profilers/    measures hardware       (imports specs, and the engine only through runners.launch,
                                          runners.comm, the collectives as the engine issues them, and
                                          runners.context_parallel, the ring steps it times)
    planner/      the application         (search, commands; the only room that combines the others)
"""
