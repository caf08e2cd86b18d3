"""The project's error type for bad user input.

`PlannerError` subclasses `ValueError` so that library callers can catch either; the CLI turns it into one
line on stderr and exit code 2.
"""


class PlannerError(ValueError):
    """Bad input from the user: a preset, a file, a flag or a plan that cannot be used as given."""
