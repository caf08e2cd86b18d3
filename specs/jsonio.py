"""Strict JSON loading for the project's small types: exact keys, named errors, atomic writes."""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
import typing
from pathlib import Path
from typing import Any, TypeVar

from specs.errors import PlannerError

T = TypeVar("T")


def read_json_file(path: str | Path, *, what: str) -> Any:
    """Read a JSON file; a missing, unreadable or malformed file raises PlannerError naming it."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise PlannerError(f"{what} file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise PlannerError(f"cannot read {what} file {path}: {exc}") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise PlannerError(f"{what} file {path} is not valid JSON: {exc.msg} at line {exc.lineno}") from None


def write_json_atomic(path: str | Path, data: Any) -> None:
    """Write JSON through a temporary file and rename, so a crash never leaves half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=2, sort_keys=False)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def check_keys(data: Any, *, allowed: set[str], required: set[str], what: str) -> dict:
    """Check that `data` is an object whose keys are exactly within `allowed` and cover `required`."""
    if not isinstance(data, dict):
        raise PlannerError(f"{what}: expected a JSON object, got {type(data).__name__}")
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise PlannerError(f"{what}: unknown key {unknown[0]!r} (allowed: {', '.join(sorted(allowed))})")
    missing = sorted(required - set(data))
    if missing:
        raise PlannerError(f"{what}: missing key {missing[0]!r}")
    return data


def _coerce(value: Any, annotation: Any, *, where: str) -> Any:
    """Check a JSON value against a simple type annotation (int, float, bool, str, tuples, Optional)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, getattr(__import__("types"), "UnionType", None)):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where=where)
            except PlannerError as exc:
                errors.append(str(exc))
        raise PlannerError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise PlannerError(f"{where}: expected a list, got {value!r}")
        if not args or (len(args) == 2 and args[1] is Ellipsis):  # tuple[X, ...]
            item_type = args[0] if args else Any
            return tuple(_coerce(v, item_type, where=f"{where}[{i}]") for i, v in enumerate(value))
        if len(value) != len(args):  # a fixed shape, e.g. tuple[str, float]
            raise PlannerError(f"{where}: expected {len(args)} items, got {value!r}")
        return tuple(_coerce(v, t, where=f"{where}[{i}]") for i, (v, t) in enumerate(zip(value, args)))
    if origin is dict or annotation is dict:
        if not isinstance(value, dict):
            raise PlannerError(f"{where}: expected an object, got {value!r}")
        return dict(value)
    if annotation is Any:
        return value
    if annotation is bool:
        if not isinstance(value, bool):
            raise PlannerError(f"{where}: expected true or false, got {value!r}")
        return value
    if annotation is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise PlannerError(f"{where}: expected an integer, got {value!r}")
        return value
    if annotation is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise PlannerError(f"{where}: expected a number, got {value!r}")
        return float(value)
    if annotation is str:
        if not isinstance(value, str):
            raise PlannerError(f"{where}: expected a string, got {value!r}")
        return value
    if dataclasses.is_dataclass(annotation):
        return dataclass_from_dict(annotation, value, what=where)
    return value


def dataclass_from_dict(cls: type[T], data: Any, *, what: str) -> T:
    """Build dataclass `cls` from a JSON object: unknown keys and wrong types raise PlannerError naming the key.

    Fields without a default are required. `__post_init__` validation errors (ValueError) are re-raised
    as PlannerError with `what` in front.
    """
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    required = {
        name for name, f in fields.items()
        if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
    }
    check_keys(data, allowed=set(fields), required=required, what=what)
    hints = typing.get_type_hints(cls)
    kwargs = {name: _coerce(value, hints[name], where=f"{what}.{name}") for name, value in data.items()}
    try:
        return cls(**kwargs)
    except PlannerError:
        raise
    except (ValueError, TypeError) as exc:
        raise PlannerError(f"{what}: {exc}") from None


def dataclass_to_dict(obj: Any) -> dict:
    """The JSON form of a project dataclass (tuples become lists)."""
    return json.loads(json.dumps(dataclasses.asdict(obj)))
