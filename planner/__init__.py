"""planner: an auto-tuning planner for distributed LLM training.

The data types (`specs.model`, `specs.job`, `specs.plan`, `specs.cluster`) are leaf modules that
`cost_models/` and `runners/` import; this package's `__init__` imports nothing so that importing a type
never pulls in the CLI, the search or torch.
"""

__version__ = "0.1.0"
