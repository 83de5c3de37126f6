"""roofplan's errors: one root (``PlannerError``), narrow subclasses.

Only the CLI turns them into exit codes: 2 for bad input, 1 when nothing fits.
"""

from __future__ import annotations

from hardware.errors import ConfigError, PlannerError, UnknownHardwareError


class UnknownPresetError(ConfigError):
    """A model name that is neither a bundled preset nor a readable file."""


class UnsupportedPrecisionError(ConfigError):
    """A precision policy the chosen device cannot run (e.g. fp8 on an A100)."""


class ConfigWarning(UserWarning):
    """Input that is accepted but probably not what the user meant; the CLI prints it as one line
    (``plan: warning: ...``), the API raises it as a Python warning."""


class InfeasibleError(PlannerError):
    """Nothing fits under the memory cap; the message says what the smallest plan needs.

    ``closest`` holds the smallest plan found (a ``PlanResult`` whose estimate does not fit),
    when one could be priced.
    """

    exit_code = 1

    def __init__(self, message: str, closest: object | None = None) -> None:
        super().__init__(message)
        self.closest = closest


__all__ = [
    "ConfigError",
    "ConfigWarning",
    "InfeasibleError",
    "PlannerError",
    "UnknownHardwareError",
    "UnknownPresetError",
    "UnsupportedPrecisionError",
]
