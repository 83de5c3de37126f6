"""Turn pydantic's ValidationError into one line that names the field and the fix."""

from __future__ import annotations

from pydantic import ValidationError


def describe_validation_error(error: ValidationError, context: str) -> str:
    """``context: field.path: message`` for the first problem (plus a count of the rest)."""
    problems = error.errors(include_url=False)
    first = problems[0]
    location = ".".join(str(part) for part in first.get("loc", ())) or "(top level)"
    message = str(first.get("msg", "invalid value"))
    message = message.removeprefix("Value error, ")
    if first.get("type") == "missing":
        message = "required field is missing"
    elif first.get("type") == "extra_forbidden":
        message = "unknown field (check the spelling against the documented schema)"
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    return f"{context}: {location}: {message}{more}"
