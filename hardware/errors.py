"""The root of roofplan's error hierarchy.

``hardware`` imports nothing else of ours, so the root error lives here and the planner
re-exports it (``planner.errors``). Only the CLI turns these into exit codes.
"""

from __future__ import annotations


class PlannerError(Exception):
    """Base class of every error roofplan raises on purpose."""

    exit_code = 2


class ConfigError(PlannerError, ValueError):
    """User input (a file, a flag, a field) is invalid; the message names the field and the fix."""


class UnknownHardwareError(ConfigError):
    """A hardware profile name that is neither bundled nor a readable YAML path."""
