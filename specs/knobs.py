"""Each plan knob is declared once, as a field of `Plan` with its `Knob` (specs/plan.py): its help, CLI
flag, limits, tuning space, and how each export target spells it. The CLI options of every command
that takes plan flags (planner/cli.py), the checks (`check_knob`), the JSON form (the dataclass), the
tuning space (planner/optuna_search.py) and the exporters' mapping (planner/exports/) all read it from
here, so a new knob is one field plus its pricing and its engine code.

    commshift: bool = knob(False, help="...", applies=lambda plan: plan.pp > 1 and plan.dp > 1,
                           tune=(False, True))
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Callable

# An export rule: what a target engine can express of a knob (planner/exports/). CUSTOM: the target's
# exporter maps every value by hand (the knob feeds several of the target's settings, or the other way
# round), and says itself what it cannot express. A tuple: the values the target expresses (its exporter
# maps them); any other value is reported from the knob's help and exported as the knob's default. No
# rule: the target has no such setting; a non-default value is reported and exported as the default.
CUSTOM = "custom"


def export_rule_allows(rule: str | tuple | None, value: Any, default: Any) -> bool:
    """Whether a target with export `rule` for a knob expresses `value` (see CUSTOM)."""
    if rule == CUSTOM or value == default:
        return True
    return isinstance(rule, tuple) and value in rule


@dataclass(frozen=True)
class Knob:
    """How one plan field is offered and checked. `applies(plan)` says when a non-default value has an
    effect (a plan that sets it elsewhere warns); `tune` lists the values the Optuna search tries where it
    applies (None: not tuned generically); `minimum` bounds integers."""

    help: str
    flag: str | None = None  # the CLI option; default: "--" + the field name with dashes
    choices: tuple[str, ...] = ()
    minimum: int | None = None
    cli: bool = True  # offered by commands that take plan flags (False: set by the search or a plan file)
    cli_unit: float = 1.0  # the plan value is the CLI value times this (e.g. MiB -> bytes)
    cli_help_unit: str = ""
    applies: Callable[[Any], bool] | None = None
    needs: str = ""  # what `applies` asks for, in words ("data parallelism (dp > 1)")
    tune: tuple | None = None
    exports: dict[str, str | tuple] = field(default_factory=dict)  # target -> export rule (CUSTOM above)


def knob(default: Any, **meta: Any):
    """A dataclass field with its Knob (see the module docstring)."""
    return dataclasses.field(default=default, metadata={"knob": Knob(**meta)})


@dataclass(frozen=True)
class KnobField:
    name: str
    type: Any  # the field's type: int, float, bool, str, or a union/tuple of them
    default: Any
    knob: Knob

    @property
    def flag(self) -> str:
        return self.knob.flag or "--" + self.name.replace("_", "-")

    @property
    def scalar_type(self) -> type:
        """The type a CLI option parses: the first of int, float, bool, str the field's type admits."""
        args = typing.get_args(self.type) or (self.type,)
        for candidate in (bool, int, float, str):
            if candidate in args or self.type is candidate:
                return float if self.knob.cli_unit != 1.0 else candidate
        return str


def knob_fields(cls: type) -> tuple[KnobField, ...]:
    """Every field of dataclass `cls` that carries a Knob, in declaration order."""
    hints = typing.get_type_hints(cls)
    return tuple(KnobField(f.name, hints[f.name], f.default, f.metadata["knob"])
                 for f in dataclasses.fields(cls) if "knob" in f.metadata)


def check_knob(spec: KnobField, value: Any) -> None:
    """Raise ValueError naming the knob when `value` is of the wrong kind, below its minimum or not one of
    its choices (per-layer tuples are checked entry by entry; None is an unset optional knob)."""
    if value is None:
        return
    values = value if isinstance(value, tuple) else (value,)
    for v in values:
        if spec.knob.minimum is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < spec.knob.minimum:
                kind = "a positive integer" if spec.knob.minimum == 1 else f"an integer of at least {spec.knob.minimum}"
                raise ValueError(f"{spec.name} must be {kind}, got {v!r}")
        if spec.knob.choices and v not in spec.knob.choices:
            raise ValueError(f"{spec.name} must be one of {', '.join(spec.knob.choices)}, got {v!r}")


def is_default(spec: KnobField, value: Any) -> bool:
    return value == spec.default


def cli_value(spec: KnobField, value: Any) -> Any:
    """A CLI option's value as the plan field's value (units applied)."""
    if value is None or spec.knob.cli_unit == 1.0:
        return value
    return max(1, int(value * spec.knob.cli_unit))


def show_value(value: Any) -> str:
    """A knob value in a message: a long per-layer tuple as counts, e.g. 'per-layer (20 full, 12 none)',
    never all its entries; strings quoted."""
    if isinstance(value, tuple) and len(value) > 6:
        counts: dict = {}
        for v in value:
            counts[v] = counts.get(v, 0) + 1
        return f"per-layer ({', '.join(f'{n} {v}' for v, n in counts.items())})"
    if isinstance(value, tuple):
        return "(" + ", ".join(map(str, value)) + ")"
    return repr(value) if isinstance(value, str) else str(value)
