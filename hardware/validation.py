"""Turn pydantic's ValidationError into one line that names every bad field and its fix."""

from __future__ import annotations

from collections.abc import Mapping

from pydantic import ValidationError


def _problem(problem: dict, names: Mapping[str, str]) -> str:  # type: ignore[type-arg]
    location = ".".join(str(part) for part in problem.get("loc", ())) or "(top level)"
    location = names.get(location, location)
    message = str(problem.get("msg", "invalid value")).removeprefix("Value error, ")
    if problem.get("type") == "missing":
        message = "required field is missing"
    elif problem.get("type") == "extra_forbidden":
        message = "unknown field (check the spelling against the documented schema)"
    return f"{location}: {message}"


def describe_validation_error(error: ValidationError, context: str, names: Mapping[str, str] | None = None) -> str:
    """``context: field.path: message`` for every problem, in one line (``; `` between them), so a
    file with several wrong fields is fixed in one go. ``names`` renames a field path to what the
    user's file calls it (a transformers config.json's keys)."""
    problems = list(dict.fromkeys(_problem(p, names or {}) for p in error.errors(include_url=False)))  # type: ignore[arg-type]
    return f"{context}: {'; '.join(problems)}"
