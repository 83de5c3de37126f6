"""roofplan's errors: one root (``PlannerError``), narrow subclasses.

Only the CLI turns them into exit codes: 2 for bad input, 1 when nothing fits.
"""

from __future__ import annotations

from hardware.errors import ConfigError, PlannerError, UnknownHardwareError


class UnknownPresetError(ConfigError):
    """A model name that is neither a bundled preset nor a readable file."""


class UnsupportedPrecisionError(ConfigError):
    """A precision policy the chosen device cannot run (e.g. fp8 on an A100)."""


class InfeasibleError(PlannerError):
    """Nothing fits under the memory cap; the message says what the smallest plan needs."""

    exit_code = 1


__all__ = [
    "ConfigError",
    "InfeasibleError",
    "PlannerError",
    "UnknownHardwareError",
    "UnknownPresetError",
    "UnsupportedPrecisionError",
]
