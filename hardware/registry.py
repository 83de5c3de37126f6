"""Find hardware profiles: bundled YAML by name, or the user's own YAML by path."""

from __future__ import annotations

from functools import cache
from importlib import resources
from pathlib import Path

from pydantic import ValidationError

from hardware.errors import ConfigError, UnknownHardwareError
from hardware.files import parse_text, read_text_file
from hardware.profile import HardwareProfile
from hardware.validation import describe_validation_error

DEFAULT_HARDWARE = "h100-sxm"
_PACKAGE_DIR = "profiles"


def _bundled_dir() -> Path:
    return Path(str(resources.files("hardware").joinpath(_PACKAGE_DIR)))


@cache
def bundled_names() -> tuple[str, ...]:
    """Names of the bundled profiles, sorted."""
    return tuple(sorted(p.stem for p in _bundled_dir().glob("*.yaml")))


def profile_from_mapping(data: object, context: str) -> HardwareProfile:
    """Validate a parsed YAML mapping as a profile; errors name ``context`` and the field."""
    if not isinstance(data, dict):
        raise ConfigError(f"{context}: expected a YAML mapping of profile fields, got {type(data).__name__}")
    if data.get("step_efficiency", 1.0) != 1.0 or data.get("applied_stack") is not None:
        key = "step_efficiency" if data.get("step_efficiency", 1.0) != 1.0 else "applied_stack"
        raise ConfigError(f"{context}: {key}: a profile holds the device's own figures; a step efficiency fitted "
                          "to a framework's runs belongs to that software stack (hardware/stacks/<stack>.yaml, "
                          "chosen with --stack): remove the key")
    try:
        return HardwareProfile.model_validate(data)
    except ValidationError as error:
        raise ConfigError(describe_validation_error(error, context)) from None


def load_profile_file(path: Path) -> HardwareProfile:
    """Read and validate one profile YAML file."""
    text = read_text_file(path, f"hardware: {path}", "a profile YAML (see `hardware show h100-sxm`)")
    return profile_from_mapping(parse_text(text, f"hardware: {path}"), f"hardware profile {path}")


@cache
def _load_bundled(name: str) -> HardwareProfile:
    return load_profile_file(_bundled_dir() / f"{name}.yaml")


def load_hardware(spec: str | Path | HardwareProfile | None = None) -> HardwareProfile:
    """A profile from a bundled name (``h100-sxm``), a YAML path, or an existing profile."""
    if isinstance(spec, HardwareProfile):
        return spec
    if spec is None:
        spec = DEFAULT_HARDWARE
    text = str(spec)
    if text in bundled_names():
        return _load_bundled(text)
    path = Path(text).expanduser()
    if isinstance(spec, Path) or text.endswith((".yaml", ".yml")) or path.exists():
        if not path.exists():
            raise ConfigError(f"hardware: file {text} does not exist; give a bundled name or a path to a profile YAML")
        return load_profile_file(path)
    raise UnknownHardwareError(
        f"hardware: unknown profile {text!r}; bundled profiles: {', '.join(bundled_names())} (or give a path to a YAML file)"
    )
