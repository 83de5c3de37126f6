"""Byte sizes: parsing what users type and printing what we computed.

``80GB`` is 80 * 10**9 bytes (SI), ``80GiB`` is 80 * 2**30 (IEC), a plain integer is bytes.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal

from hardware.errors import ConfigError

_SI = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "PB": 10**15}
_IEC = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40, "PIB": 2**50}
_MAX_BYTES = 10**24  # a yottabyte: anything larger is a typo
_PATTERN = re.compile(r"^\s*([0-9]+(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*$")


def parse_bytes(value: str | int | float, field: str = "size") -> int:
    """Parse ``80GB`` / ``80GiB`` / ``85899345920`` into bytes; raise ConfigError naming ``field``.

    Arithmetic is exact (``Decimal``), so large integers keep every digit and ``1e400`` or
    ``inf`` are refused rather than overflowing.
    """
    hint = "use e.g. 80GB (10^9), 80GiB (2^30) or plain bytes"
    if isinstance(value, bool):
        raise ConfigError(f"{field}: expected a byte size, got {value!r}; {hint}")
    if isinstance(value, int):
        number, unit = Decimal(value), ""
    elif isinstance(value, float):
        if not math.isfinite(value):
            raise ConfigError(f"{field}: {value!r} is not a finite size; {hint}")
        number, unit = Decimal(repr(value)), ""
    else:
        match = _PATTERN.match(str(value))
        if match is None:
            raise ConfigError(f"{field}: cannot parse {value!r} as a byte size; {hint}")
        number, unit = Decimal(match.group(1)), match.group(2).upper()
    scale = _SI.get(unit) or _IEC.get(unit)
    if scale is None:
        raise ConfigError(
            f"{field}: unknown unit {unit!r} in {value!r}; use B, KB, MB, GB, TB (10^3 steps) or KiB, MiB, GiB, TiB (2^10 steps)"
        )
    total = number * scale
    if total <= 0:
        raise ConfigError(f"{field}: must be positive, got {value!r}")
    if total > _MAX_BYTES:
        raise ConfigError(f"{field}: {value!r} is larger than any device ({_MAX_BYTES:.0e} bytes); {hint}")
    if total != total.to_integral_value():
        raise ConfigError(f"{field}: {value!r} is not a whole number of bytes")
    return int(total)


def format_bytes(n_bytes: float, binary: bool = False) -> str:
    """Human-readable size: ``16.1 GB`` (SI, default) or ``15.0 GiB`` (binary=True)."""
    step, units = (1024.0, ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]) if binary else (1000.0, ["B", "KB", "MB", "GB", "TB", "PB"])
    value = float(n_bytes)
    for unit in units:
        if abs(value) < step or unit == units[-1]:
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= step
    raise AssertionError("unreachable")


def format_count(count: float) -> str:
    """``8.03B``, ``124.4M``, ``6.7K`` for parameter and token counts."""
    for scale, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "K")):
        if abs(count) >= scale:
            return f"{count / scale:.2f}{suffix}" if scale >= 1e9 else f"{count / scale:.1f}{suffix}"
    return f"{count:.0f}"
